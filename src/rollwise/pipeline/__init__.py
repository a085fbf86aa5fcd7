"""The drivers, their stages and the composition root: `Stages` (one method per stage),
`build` (a config becomes the stages, for a placement), the synchronous and asynchronous
drivers (`loop`, `asyncloop`), what one step collects (`collect`: a frozen `Collected`)
and what is in flight between collection and training (`inflight`), the evaluator and
`launch` (the one path from a config to a run being trained). The crash harness that
kills runs and compares them is test tooling (`tests/crashtest.py`, `tests/crashpair.py`).

May import: types, registry, system, algos, models, replay, engine, rewards, control, envs,
tasks, learner, rollout, observe, compose, run, distributed.
"""
