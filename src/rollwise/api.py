"""The Python API: train from a script or a notebook with your own reward functions.

    import rollwise

    def short(completion: str, sample) -> float:   # a verifier: (completion, sample) -> float
        return 1.0 if len(completion) < 12 else 0.0

    summary = rollwise.train("configs/tiny_arith.toml", rewards=[short],
                             overrides=["run.num_steps=20"])

A function marked with `@rollwise.group_reward` is a group term instead:
`fn(trajectories, **options) -> one score per trajectory`, seeing the whole group.

The same functions can be named in a config by import path instead
(`task.rewards = {"mypkg.rewards:short" = 1.0}`), which is what makes a run resumable from
its directory alone (`rollwise train --resume RUN_DIR`): a callable passed here is not
recorded in config.toml, so a run started here is resumed here, with the same functions
and `resume=True` (docs/extending.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rollwise.config import Config, ConfigError, load_config, to_toml


def train(config: Config | str | Path, *,
          rewards: Sequence[Callable] | Mapping[str, Callable] = (),
          weights: Mapping[str, float] | None = None, overrides: Sequence[str] = (),
          resume: bool = False, echo: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Train as `rollwise train` does and return the run's summary. `rewards`: extra
    verifiers `(completion: str, sample: Sample) -> float`, added to the config's
    task.rewards under their names (a function's `__name__` for a list) with weight 1 or
    `weights[name]`; functions marked `@rollwise.group_reward` are group terms. `overrides`:
    "a.b=c" strings, as `--set` takes. `resume`: continue the run in run.output_dir/run.name
    from its last checkpoint (pass the same functions). Raises ConfigError naming the
    problem (a name taken, a function whose signature does not fit)."""
    from rollwise.build import build_run, run_steps
    from rollwise.loop import train as train_loop
    from rollwise.rundir import Run

    cfg = config if isinstance(config, Config) else load_config(config, list(overrides))
    extra = _reward_terms(cfg, rewards, dict(weights or {}))
    root = Path(cfg.run.output_dir) / cfg.run.name
    stages = build_run(cfg, rewards=extra)
    run = Run(root, resume=resume, config_toml=to_toml(cfg),
              echo=echo or (lambda s: None), keep_checkpoints=cfg.run.keep_checkpoints)
    run.summary.update({"model": cfg.model.name, "task": cfg.task.name, **stages.info,
                        "python_rewards": sorted(extra)})
    try:
        return train_loop(stages, run, cfg.run.num_steps, eval_every=cfg.eval.every,
                          eval_before=cfg.eval.before, checkpoint_every=cfg.run.checkpoint_every,
                          checkpoint_seconds=cfg.run.checkpoint_minutes * 60,
                          steps=run_steps(cfg))
    finally:
        if hasattr(stages, "shutdown"):  # the Ray backend's actors
            stages.shutdown()


def _reward_terms(cfg: Config, rewards, weights: dict[str, float]
                  ) -> dict[str, tuple[Callable, float]]:
    """name -> (function, weight), each checked against the verifier signature (or the
    group term's, for a function marked `group_reward`)."""
    from rollwise.rewards.group import GROUP_REWARDS, is_group_term
    from rollwise.rewards.verifiers import VERIFIERS

    named = dict(rewards) if isinstance(rewards, Mapping) else {
        getattr(fn, "__name__", repr(fn)): fn for fn in rewards}
    out = {}
    for name, fn in named.items():
        if name in cfg.task.rewards:
            raise ConfigError(f"rewards: {name!r} is already a term of task.rewards; "
                              "give the function another name")
        registry = GROUP_REWARDS if is_group_term(fn) else VERIFIERS
        problem = registry.misfit(fn) if callable(fn) else f"{fn!r} is not callable"
        if problem:
            raise ConfigError(f"rewards: {name!r}: {problem}")
        out[name] = (fn, float(weights.pop(name, 1.0)))
    if weights:
        raise ConfigError(f"weights: {', '.join(sorted(weights))} name no function of rewards")
    return out
