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
its directory alone (`rollwise train --resume RUN_DIR`): a callable passed here cannot be
named in config.toml (run.json records its name), so a run started here is resumed here,
with the same functions and `resume=True`; `rollwise train --resume` refuses it, naming
the functions it lacks (docs/extending.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rollwise.compose.config import Config, ConfigError, load_config


def train(config: Config | str | Path, *,
          rewards: Sequence[Callable] | Mapping[str, Callable] = (),
          weights: Mapping[str, float] | None = None, overrides: Sequence[str] = (),
          resume: bool | str | Path = False, allow_changes: bool = False,
          echo: Callable[[str], None] | None = print) -> dict[str, Any]:
    """Train as `rollwise train` does (the same checks, run directory, loggers of
    run.loggers; a new run whose name is taken goes to `<name>-2`, ...: the summary's
    `run_dir`) and return the run's summary. `rewards`: extra
    verifiers `(completion: str, sample: Sample) -> float`, added to the config's
    task.rewards under their names (a function's `__name__` for a list) with weight 1 or
    `weights[name]`; functions marked `@rollwise.group_reward` are group terms (their
    options in task.reward_options, by name). `overrides`: "a.b=c" strings, as `--set`
    takes. `resume`: continue a run from its last checkpoint, given the same functions:
    True for the one in run.output_dir/run.name, or its directory. `allow_changes`: as
    `--allow-changes`. Raises ConfigError naming the problem (a name taken, a function
    whose signature or options do not fit, a change to a resumed run) before the model
    loads. A resumed run that already finished returns its summary, touching nothing."""
    from rollwise.pipeline.launch import RunFinished, open_run, train_run

    cfg = config if isinstance(config, Config) else load_config(config, list(overrides))
    extra = _reward_terms(cfg, rewards, dict(weights or {}))
    root = None if resume is False else (
        Path(cfg.run.output_dir) / cfg.run.name if resume is True else Path(resume))
    say = echo or (lambda s: None)
    try:
        opened = open_run(cfg, resume=root, rewards=extra, allow_changes=allow_changes,
                          echo=say)
    except RunFinished as done:
        say(str(done))
        return json.loads((done.root / "summary.json").read_text())
    return train_run(opened)


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
