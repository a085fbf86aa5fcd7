"""The run lifecycle: the run directory (records, snapshots, checkpoints, resume:
`rundir`; the step's metrics record and the snapshot as records of their own: `records`),
the health check that stops runs that learn nothing (`health`), and export of a
run's policy (`export`).

May import: types, registry, system, algos, models, replay, engine, rewards, control, envs,
tasks, learner, rollout, observe, compose.
"""
