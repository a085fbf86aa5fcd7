"""From settings to parts: the config schema, its migration table and loading (`config`),
the checks run before anything loads (`preflight`), precision chosen by the machine
(`precision`) and one builder per part (`parts`).

May import the components (engine, rollout, rewards, learner, tasks, control, models,
algos) and `system`; never `run`, `distributed` or `pipeline`.
"""
