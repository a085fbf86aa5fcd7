"""From settings to parts: the config schema (`sections`, built in part from the settings
the components declare: `schema`), its migration table and loading (`config`), the one
place a config is checked before anything loads (`preflight`), precision chosen by the
machine (`precision`) and one builder per part (`parts`).

May import: types, registry, system, algos, models, replay, engine, rewards, control, envs,
tasks, learner, rollout, observe.
"""
