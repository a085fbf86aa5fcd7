"""The run directory: everything a run produced, and resuming from it.

    runs/<name>/config.toml          the resolved config
    runs/<name>/metrics.jsonl        one line per training step (kind "train") or evaluation ("eval")
    runs/<name>/trajectories.sqlite  every trajectory of the run
    runs/<name>/checkpoints/step_N/  weights, optimizer, RNG and data-cursor state
    runs/<name>/summary.json         final figures (eval_before, eval_after, train_seconds, ...)
    runs/<name>/report.html          plots
"""

from __future__ import annotations

import contextlib
import json
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from rollwise.learner.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from rollwise.observe import (
    MetricsWriter,
    format_step_line,
    progress_bar,
    summarize_lengths,
    write_report,
)
from rollwise.observe.progress import ProgressHandle
from rollwise.replay import TrajectoryStore
from rollwise.rewards import RewardStats
from rollwise.types import Group


class StepTimer:
    """Wall time per named phase of one step; `other` is what no phase covered."""

    def __init__(self, bar: ProgressHandle | None = None):
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.bar = bar

    @contextlib.contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        if self.bar is not None:
            self.bar.set_description(name)
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t

    def total(self) -> float:
        return time.perf_counter() - self.start


@contextlib.contextmanager
def defer_interrupt():
    """Hold Ctrl-C until the block ends, so an update is never half-recorded."""
    pending: list[Any] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda *a: pending.append(a))
    except ValueError:  # not the main thread: nothing to defer
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pending:
            raise KeyboardInterrupt


class Run:
    def __init__(self, root: Path, *, resume: bool, config_toml: str | None = None,
                 keep_checkpoints: int = 2, echo=print):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        if config_toml is not None:
            (self.root / "config.toml").write_text(config_toml)
        self.resuming = resume
        self.keep = keep_checkpoints
        self.echo = echo
        self.metrics = MetricsWriter(self.root / "metrics.jsonl")
        self.store = TrajectoryStore(self.root / "trajectories.sqlite")
        self.summary: dict[str, Any] = {}
        self.bar: ProgressHandle | None = None
        self.step = 0  # last completed step
        self.counters = {"train_seconds": 0.0, "rollouts": 0, "tokens": 0, "reward_errors": 0,
                         "reward_timeouts": 0}

    # -- resume / checkpoints ------------------------------------------------------------
    def resume(self, stages) -> int:
        """Restore the latest checkpoint (when resuming); the step to continue from."""
        found = list_checkpoints(self.root / "checkpoints")
        if not self.resuming:
            return 0
        if not found:  # nothing to continue from: start over, dropping partial records
            self.store.delete_after(0)
            self.metrics.drop_after(0)
            self.echo(f"{self.root} has no checkpoint yet; starting from step 0")
            return 0
        learner_state, state = load_checkpoint(found[-1], stages.model)
        stages.load_state_dict(learner_state, state["stages"])
        self.step, self.counters, self.summary = state["step"], state["counters"], state["summary"]
        dropped = self.store.delete_after(self.step)
        self.metrics.drop_after(self.step)
        self.echo(f"resumed from {found[-1]} (step {self.step}; {dropped} trajectories of "
                  "unfinished steps dropped and regenerated)")
        return self.step

    def checkpoint(self, step: int, stages) -> Path:
        learner_state, stage_state = stages.state_dict()
        state = {"step": step, "counters": self.counters, "summary": self.summary,
                 "stages": stage_state}
        return save_checkpoint(self.root / "checkpoints", stages.model, learner_state, state,
                               keep=self.keep)

    def interrupted(self, stages) -> None:
        path = self.checkpoint(self.step, stages)
        self.summary["interrupted_at_step"] = self.step
        self.write_summary()
        self.echo(f"interrupted: checkpoint of step {self.step} in {path}; "
                  f"continue with --resume {self.root}")

    # -- progress ------------------------------------------------------------------------
    @contextlib.contextmanager
    def progress(self, start: int, num_steps: int):
        """A bar over the training steps (phase names shown as they run)."""
        with progress_bar(num_steps, "training") as bar:
            bar.advance(start)
            self.bar = bar
            try:
                yield
            finally:
                self.bar = None

    def timer(self) -> StepTimer:
        return StepTimer(self.bar)

    # -- records -------------------------------------------------------------------------
    def record_step(self, step: int, num_steps: int, groups: list[Group], kept: list[Group],
                    rewards: RewardStats, update: dict, timer: StepTimer,
                    control: dict | None = None) -> dict:
        """One metrics line: `groups` are all groups rolled out this step, `kept` those trained
        on, `control` the allocator's figures (zero_adv_frac, effective_samples, calib_brier..)."""
        trajs = [t for g in groups for t in g.trajectories]
        lengths = [t.num_tokens for t in trajs]
        phases = timer.phases
        seconds = timer.total()
        c = self.counters
        c["train_seconds"] += seconds
        c["rollouts"] += len(trajs)
        c["tokens"] += sum(lengths)
        c["reward_errors"] += rewards.num_errors
        c["reward_timeouts"] += rewards.num_timeouts
        lens = summarize_lengths(lengths)
        record = {
            "kind": "train", "step": step, "num_steps": num_steps, "wall_time": c["train_seconds"],
            "reward_mean": statistics.fmean(t.reward for t in trajs),
            "accuracy": statistics.fmean(float(t.reward_info.get("correct", 0.0) >= 1.0) for t in trajs),
            **{f"response_len_{k}": v for k, v in lens.items()},
            "truncated_frac": statistics.fmean(t.finish_reason == "length" for t in trajs),
            "zero_var_frac": statistics.fmean(g.zero_variance for g in groups),
            "groups": len(groups), "groups_kept": len(kept),
            "rollouts": c["rollouts"], "tokens": c["tokens"],
            "step_rollouts": len(trajs), "step_tokens": sum(lengths),
            "rollout_tokens_per_s": sum(lengths) / max(phases.get("rollout", 0.0), 1e-9),
            "train_tokens_per_s": sum(len(t.prompt_ids) + t.num_tokens for g in kept
                                      for t in g.trajectories) / max(phases.get("train", 1e-9), 1e-9),
            **{f"time_{k}": v for k, v in phases.items()},
            "time_other": max(seconds - sum(phases.values()), 0.0),
            "reward_errors": rewards.num_errors, "reward_timeouts": rewards.num_timeouts,
            **update, **(control or {}),
        }
        self.store.add_groups(step, groups)
        self.metrics.write(record)
        self.step = step
        self.echo(format_step_line(record))
        if self.bar is not None:
            self.bar.advance(1)
        return record

    def record_eval(self, step: int, result: dict, before: bool = False, after: bool = False):
        record = {"kind": "eval", "step": step, "wall_time": self.counters["train_seconds"],
                  "rollouts": self.counters["rollouts"], "tokens": self.counters["tokens"],
                  "eval_accuracy": result["accuracy"],
                  **{f"eval_{k}": v for k, v in result.items() if k != "accuracy"}}
        self.metrics.write(record)
        if before:
            self.summary["eval_before"] = result
        if after:
            self.summary["eval_after"] = result
        label = "before" if before else "after" if after else f"step {step}"
        self.echo(f"eval {label}: greedy accuracy {result['accuracy']:.3f} "
                  f"({int(result['num_prompts'])} prompts, {result['seconds']:.1f}s)")

    def write_summary(self) -> dict:
        out = {**self.summary, **self.counters, "steps": self.step, "run_dir": str(self.root)}
        (self.root / "summary.json").write_text(json.dumps(out, indent=2))
        return out

    def finish(self) -> dict:
        summary = self.write_summary()
        report = write_report(self.root)
        self.store.close()
        self.metrics.close()
        summary["report"] = str(report)
        return summary
