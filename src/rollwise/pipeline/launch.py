"""Opening a run: the one path from a config to a run directory being trained, taken by
`rollwise train` and by `rollwise.train` alike.

    opened = open_run(cfg, resume=None, rewards={name: (fn, weight)}, echo=print)
    summary = train_run(opened)

In this order, so that a typo costs a second, not a model load, and nothing on disk
changes before every check has passed:

1. `run.memory` settles (compose/memory.py: the low-memory settings where less memory is
   free than the run's expected peak; a resumed run keeps its first start's choice);
   resuming: what the config (and the reward functions passed from Python) change from
   the run's own is refused where it alters what the finished steps used, unless
   `allow_changes`; a run started from Python with functions config.toml cannot name is
   resumed only with the same functions; a finished run stops here (`RunFinished`),
   touching nothing;
2. every name, option and signature (preflight) and the loggers' extras;
3. the model loads (`build`);
4. a new run claims its directory; the run directory is opened, and its loggers continue
   the logger runs it started (their ids are kept in run.json).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollwise.compose.config import Config, ConfigError, flatten, load_config, to_toml
from rollwise.run.rundir import Run, claim_run_dir, finished_step, read_run_file, update_run_file

if TYPE_CHECKING:  # the stages import torch; this module is read before the model loads
    from rollwise.pipeline.stages import BuildInfo, Stages

Rewards = dict[str, tuple[Callable, float]]  # name -> (function, weight), from Python

# Keys a resumed run may change freely: how long and where it runs, not what it computes.
FREE_TO_CHANGE = ("run.num_steps", "run.threads", "run.allocator", "run.checkpoint_every",
                  "run.checkpoint_minutes", "run.keep_checkpoints", "run.loggers", "run.device",
                  "eval.", "health.")
# where the stages run, not what they compute (group numbering makes the samples the same)
FREE_TO_CHANGE += ("run.backend", "ray.")
# how the memory settings were chosen: the learner keys it set are compared themselves
FREE_TO_CHANGE += ("run.memory",)


class RunFinished(Exception):
    """Resuming a run that already trained its run.num_steps steps: nothing to do."""

    def __init__(self, root: Path, step: int):
        super().__init__(f"{root}: run finished at step {step}; nothing to do (raise "
                         "run.num_steps to train further)")
        self.root, self.step = root, step


@dataclass
class Opened:
    """A run ready to train: its config, directory, stages and open `Run`."""

    cfg: Config
    root: Path
    stages: Stages  # its ports in this process or on Ray actors
    run: Run


def config_changes(old: Config, new: Config) -> dict[str, tuple]:
    """{dotted key: (old, new)} of the values that differ."""
    a, b = flatten(old.model_dump()), flatten(new.model_dump())
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and not isinstance(a.get(k, b.get(k)), dict)}


def describe_functions(rewards: Rewards) -> dict[str, str]:
    """What run.json keeps of the reward functions passed from Python: name -> "module:
    qualified name (kind, weight w)"; a resumed run must be given the same."""
    from rollwise.rewards.group import is_group_term

    return {name: f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))} "
                  f"({'group term' if is_group_term(fn) else 'verifier'}, weight {w:g})"
            for name, (fn, w) in rewards.items()}


def resume_changes(root: Path, cfg: Config, functions: dict[str, str],
                   allow_changes: bool) -> dict[str, tuple]:
    """What `cfg` and the Python reward `functions` change from the run in `root`. A
    ConfigError names the changes to what the finished steps used (the resumed run would
    silently be another experiment), unless `allow_changes`; first among them, the
    functions a run from Python was started with and that are not given again."""
    if not (root / "config.toml").is_file():
        raise ConfigError(f"--resume {root}: not a run directory (no config.toml)")
    changes = config_changes(load_config(root / "config.toml"), cfg)
    before = read_run_file(root).get("functions", {})
    changes |= {f"rewards.{name}": (before.get(name), functions.get(name))
                for name in sorted(set(before) | set(functions))
                if before.get(name) != functions.get(name)}
    binding = [k for k in changes if not k.startswith(FREE_TO_CHANGE)]
    if not binding or allow_changes:
        return changes
    missing = [f"{name} = {before[name]}" for name in before if name not in functions]
    if missing:
        raise ConfigError(
            f"--resume {root}: the run was started from Python with reward functions that "
            f"config.toml cannot name: {'; '.join(missing)}. Resume it from Python with the "
            "same functions, rollwise.train(..., rewards=[...], resume=...), or name them "
            "by import path in task.rewards; --allow-changes (allow_changes=True) continues "
            "without them, recorded in summary.json")
    shown = ", ".join(f"{k}: {changes[k][0]!r} -> {changes[k][1]!r}" for k in binding[:5])
    raise ConfigError(f"--resume {root}: these changes alter what the finished steps used: "
                      f"{shown}; add --allow-changes (allow_changes=True from Python) to "
                      "continue anyway (the change is recorded in summary.json)")


def check_output_dir(out: Path) -> None:
    """Fail now, not after the model has loaded, when runs cannot be created under `out`."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"run.output_dir = '{out}': {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"run.output_dir = '{out}': {existing} is not writable")


def open_run(cfg: Config, *, resume: Path | None = None, rewards: Rewards | None = None,
             allow_changes: bool = False, echo: Callable[[str], None] = print,
             warn: Callable[[str], None] | None = None) -> Opened:
    """Check, build and open a run (see the module docstring): a new one in
    run.output_dir/run.name (or a numbered sibling), or the run directory `resume`.
    `rewards`: reward functions passed from Python. `echo` gets the header lines and the
    run's step lines, `warn` what deserves attention (default: `echo`). Raises
    ConfigError (and ValueError, RunLockedError) before anything changes on disk, and
    `RunFinished` when `resume` has nothing left to train."""
    from rollwise.compose.memory import choose_memory
    from rollwise.compose.preflight import check_config
    from rollwise.observe.loggers import check_loggers
    from rollwise.pipeline.build import build
    from rollwise.run.health import HealthCheck
    from rollwise.system.runlock import RunLock

    warn = warn or echo
    rewards = rewards or {}
    functions = describe_functions(rewards)
    changes: dict[str, tuple] = {}
    # run.memory: the low-memory settings when too little is free (a resumed run: its own)
    cfg, memory = choose_memory(
        cfg, resumed=None if resume is None else read_run_file(resume).get("memory", {}))
    if resume is not None:
        changes = resume_changes(resume, cfg, functions, allow_changes)
        step = finished_step(resume, cfg.run.num_steps)
        if step is not None:
            raise RunFinished(resume, step)
    else:
        check_output_dir(Path(cfg.run.output_dir))
    check_config(cfg, {name: fn for name, (fn, _) in rewards.items()})
    check_loggers(cfg.run.loggers)  # a missing extra is named before the model loads
    lock = RunLock(resume) if resume is not None else None  # refuse a live run first
    echo(f"rollwise {cfg.run.name}: model {cfg.model.name}, task {cfg.task.name}, "
         f"{cfg.run.num_steps} steps -> {resume if resume is not None else cfg.run.output_dir}")
    if (line := memory.line()) is not None:  # a switch the machine made deserves attention
        (warn if memory.setting == "auto" and not memory.resumed else echo)(line)
    try:
        stages = build(cfg, rewards)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    _echo_build(stages.info, echo, warn)
    root = resume
    if lock is None:
        root, lock = claim_run_dir(Path(cfg.run.output_dir) / cfg.run.name, cfg.run.overwrite)
    run = Run(root, resume=resume is not None, config_toml=to_toml(cfg), lock=lock, echo=echo,
              keep_checkpoints=cfg.run.keep_checkpoints, loggers=_loggers(cfg, root, warn),
              health=HealthCheck(**cfg.health.model_dump()))
    update_run_file(root, functions=functions, memory=memory.record())
    run.summary.update({"model": cfg.model.name, "task": cfg.task.name,
                        **stages.info.summary(), "memory": memory.record()})
    if functions:
        run.summary["python_rewards"] = sorted(functions)
    run.config_changes = {k: list(v) for k, v in changes.items()}
    return Opened(cfg, root, stages, run)


def _echo_build(info: BuildInfo, echo: Callable[[str], None], warn: Callable[[str], None]) -> None:
    """The build's lines: the precision chosen, the sandbox of code tasks, prompts skipped."""
    echo(f"{info.precision_line} | allocator {info.allocator}")
    if "sandbox" in info.task:  # code tasks: what isolates model-written code here
        box = info.task["sandbox"]
        line = f"sandbox: {box['isolation']} ({'; '.join(box.get('layers', []))})"
        if box["security_boundary"]:
            echo(line)
        else:
            warn(f"{line} (limits only: NOT a security boundary, docs/rewards.md)")
    skipped = info.skipped_train_prompts + info.skipped_eval_prompts
    if skipped:
        warn(f"skipped {skipped} prompts longer than the context budget (counted in "
             "summary.json)")


def _loggers(cfg: Config, root: Path, warn: Callable[[str], None]):
    """The run's metric sinks, each continuing the logger run it started before (a
    resumed run); their ids are kept in run.json."""
    from rollwise.observe.loggers import make_loggers

    loggers = make_loggers(cfg.run.loggers, root, cfg.run.name, cfg.model_dump(), echo=warn,
                           run_ids=read_run_file(root).get("loggers", {}))
    update_run_file(root, loggers=loggers.run_ids())
    return loggers


def train_run(opened: Opened) -> dict:
    """Train an opened run to run.num_steps; its summary."""
    from rollwise.pipeline.build import run_steps
    from rollwise.pipeline.loop import train

    cfg, stages, run = opened.cfg, opened.stages, opened.run
    try:
        return train(stages, run, cfg.run.num_steps, eval_every=cfg.eval.every,
                     eval_before=cfg.eval.before, checkpoint_every=cfg.run.checkpoint_every,
                     checkpoint_seconds=cfg.run.checkpoint_minutes * 60, steps=run_steps(cfg))
    finally:
        stages.close()


def serve_learner_rank(cfg: Config) -> bool:
    """Under torchrun, ranks 1..N-1 only serve rank 0's learner (distributed/torchrun.py):
    True once this process did so, False for rank 0 and any other launch."""
    from rollwise.distributed import torchrun

    launch = torchrun.launched()
    if not launch or launch[0] == 0:
        return False
    torchrun.serve(cfg.learner.shard_timeout_s, cfg.run.device)
    return True
