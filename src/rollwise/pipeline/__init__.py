"""The drivers, their stages and the composition root: `Stages` (one method per stage),
`build` (a config becomes the stages, for a placement), the synchronous and asynchronous
drivers (`loop`, `asyncloop`), the evaluator, `launch` (the one path from a config to a
run being trained) and the crash test.

May import: types, registry, system, algos, models, replay, engine, rewards, control, envs,
tasks, learner, rollout, observe, compose, run, distributed.
"""
