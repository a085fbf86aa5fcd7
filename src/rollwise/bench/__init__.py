"""`rollwise bench ...`: benchmarks that print a table, write JSON and an HTML page.

One module per benchmark (B1 `rollout`, B2 `tail`, B3 `e2e`, B4 `alloc`); each exposes
`run(...) -> dict` and is registered as a command in `rollwise.bench.cli`.

May import: types, registry, system, algos, models, replay, engine, rewards, control, envs,
tasks, learner, rollout, observe, compose, run, distributed, pipeline, serve.
"""
