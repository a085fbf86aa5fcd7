"""From settings to parts: the config schema, its migration table and loading (`config`),
the checks run before anything loads (`preflight`), precision chosen by the machine
(`precision`) and one builder per part (`parts`).

May import: types, registry, system, algos, models, replay, engine, rewards, control, envs,
tasks, learner, rollout.
"""
