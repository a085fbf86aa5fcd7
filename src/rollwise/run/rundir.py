"""The run directory: everything a run produced, and resuming from it.

    runs/<name>/config.toml          the resolved config
    runs/<name>/metrics.jsonl        one line per training step (kind "train") or
                                     evaluation ("eval")
    runs/<name>/trajectories.sqlite  every trajectory of the run
    runs/<name>/checkpoints/step_N/  weights, optimizer, RNG and data-cursor state
    runs/<name>/summary.json         final figures (eval_before, eval_after, train_seconds, ...)
    runs/<name>/report.html          plots
    runs/<name>/run.json             what config.toml cannot hold: the reward functions a
                                     run from Python was started with (by name), and the
                                     ids of its logger runs (a resumed run continues them)
    runs/<name>/.lock                held (flock) by the one process writing the run

What makes a resumed run equal an uninterrupted one: at the end of every step (inside the
block Ctrl-C waits for) the run takes a `snapshot` (a `records.Snapshot`) of everything
that changes between steps and is not the weights or the optimizer: RNG states, data
cursor, allocator and rollout-pool state, counters. Every checkpoint, the periodic ones
and the one written on Ctrl-C, is written from the latest snapshot, so an interrupt in the
middle of step N+1 (prompts drawn, RNG advanced) still saves exactly the state after step N.
The stages' part is `stages.stage_state()`, its one source: with batches collected ahead
(the asynchronous driver), those batches and the state as of the last of them
(pipeline/inflight.py).
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from rollwise.learner.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    rng_state,
    save_checkpoint,
)
from rollwise.observe import MetricsWriter, format_step_line, progress_bar, write_report
from rollwise.observe.progress import ProgressHandle
from rollwise.replay import TrajectoryStore
from rollwise.rewards import RewardStats
from rollwise.run.health import HealthCheck, RunUnhealthy
from rollwise.run.records import COUNTERS, Snapshot, StepTimes, counted, step_record
from rollwise.system.atomic import atomic_write_text
from rollwise.system.runlock import RunLock
from rollwise.system.runtime import device_memory, rss_peak, run_peak_rss_mb
from rollwise.types import Group

RUN_FILE = "run.json"


def read_run_file(root: Path) -> dict[str, Any]:
    """The run's `run.json` ({} when absent or unreadable: older runs have none)."""
    try:
        data = json.loads((Path(root) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def update_run_file(root: Path, **fields: Any) -> None:
    """Set `fields` in the run's `run.json` (atomically; the other fields are kept)."""
    data = read_run_file(root) | fields
    atomic_write_text(Path(root) / RUN_FILE, json.dumps(data, indent=2, sort_keys=True))


def finished_step(root: Path, num_steps: int) -> int | None:
    """The step a run finished at when it already trained `num_steps` steps (its
    summary.json says so and the checkpoint of that step exists), else None."""
    try:
        summary = json.loads((Path(root) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    steps = summary.get("steps") if isinstance(summary, dict) else None
    if not isinstance(steps, int) or steps < num_steps or "interrupted_at_step" in summary:
        return None
    saved = list_checkpoints(Path(root) / "checkpoints")
    return steps if saved and saved[-1].name == f"step_{steps}" else None


def claim_run_dir(base: Path, overwrite: bool) -> tuple[Path, RunLock]:
    """(the run directory, its lock) for a new run meant for `base`: an existing run is
    kept and a numbered sibling created (`base-2`, `base-3`, ...), or, with `overwrite`,
    emptied (refused while another process holds it). Call it only once the config has
    passed every check and the model has loaded."""
    if overwrite and base.is_dir():
        lock = RunLock(base)
        for child in base.iterdir():
            if child.name != ".lock":
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        return base, lock
    root, n = base, 2
    while True:  # mkdir is the atomic claim: two runs of one name get two directories
        try:
            root.mkdir(parents=True)
            return root, RunLock(root)
        except FileExistsError:
            root, n = base.with_name(f"{base.name}-{n}"), n + 1


def new_run(base: Path, **options) -> Run:
    """A new run in `base`, emptied first (a benchmark's side, run again in its place): a
    `Run` holding `base`'s lock, `options` passed on."""
    root, lock = claim_run_dir(base, overwrite=True)
    return Run(root, resume=False, lock=lock, **options)


class StepTimer:
    """Wall time per named phase of one step; `other` is what no phase covered."""

    def __init__(self, bar: ProgressHandle | None = None):
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.peaks: dict[str, float] = {}  # peak resident set (MiB) per phase
        self.bar = bar

    @contextlib.contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        if self.bar is not None:
            self.bar.set_description(name)
        try:
            with rss_peak() as peak:
                yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t
            self.peaks[name] = max(self.peaks.get(name, 0.0), peak.get("mb", 0.0))

    def total(self) -> float:
        return time.perf_counter() - self.start

    def times(self) -> StepTimes:
        """The step's times so far, as `records.step_record` takes them."""
        return StepTimes(dict(self.phases), self.total(), dict(self.peaks))


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
    """The run directory of one run, held exclusively while open.

    `lock`: a `RunLock` the caller already holds on `root` (the CLI takes it while choosing
    the directory); otherwise one is taken here, and a live holder raises `RunLockedError`.
    `loggers`: extra metric sinks (`observe.loggers`), each fed every metrics record.
    """

    def __init__(self, root: Path, *, resume: bool, config_toml: str | None = None,
                 keep_checkpoints: int = 2, echo=print, health: HealthCheck | None = None,
                 loggers=None, lock: RunLock | None = None):
        self.root = Path(root)
        self.lock = lock if lock is not None else RunLock(self.root)
        old = self.root / "metrics.jsonl"
        if not resume and old.is_file() and old.stat().st_size:
            if lock is None:
                self.lock.release()
            # its records would pass for this run's (an evaluation found done is skipped)
            raise FileExistsError(f"{self.root} holds a run already: resume it, or empty it "
                                  "first (claim_run_dir(root, overwrite=True); "
                                  "run.overwrite = true)")
        if config_toml is not None:
            atomic_write_text(self.root / "config.toml", config_toml)
        self.resuming = resume
        self.keep = keep_checkpoints
        self.echo = echo
        self._step_times: list[float] = []  # this process's step wall times (the eta)
        self.health = health or HealthCheck(patience=0)
        self.loggers = loggers
        self.metrics = MetricsWriter(self.root / "metrics.jsonl")
        self.store = TrajectoryStore(self.root / "trajectories.sqlite")
        self.summary: dict[str, Any] = {}
        self.bar: ProgressHandle | None = None
        self.step = 0  # last completed step
        self.counters = dict(COUNTERS)
        self._snap: Snapshot | None = None
        self._saved: tuple[int, int] | None = None  # (step, snapshot id) last checkpointed
        self._snap_id = 0
        self._last_save = time.monotonic()
        self.config_changes: dict[str, list] = {}  # --resume --allow-changes: recorded

    # -- snapshots and checkpoints ---------------------------------------------------------
    def snapshot(self, stages) -> None:
        """Remember the state after the last completed step (see the module docstring)."""
        stage_state = stages.stage_state()
        self._snap_id += 1
        self._snap = Snapshot(step=self.step, counters=dict(self.counters),
                              summary=copy.deepcopy(self.summary),
                              stages=json.loads(json.dumps(stage_state)),
                              health=self.health.state_dict(), rng=rng_state(), id=self._snap_id)

    def resume(self, stages) -> int:
        """Restore the latest readable checkpoint (when resuming); the step to continue from."""
        if self.resuming:
            self._restore(stages)
        if self.config_changes:
            self.summary.setdefault("config_changes", []).append(
                {"at_step": self.step, "changes": self.config_changes})
        self.snapshot(stages)
        return self.step

    def _restore(self, stages) -> None:
        for path in reversed(list_checkpoints(self.root / "checkpoints")):
            try:
                learner_state, state = load_checkpoint(path, stages.model)
                snap = Snapshot.from_json(state)
                stages.load_state_dict(learner_state, snap.stages)
            except (OSError, ValueError, KeyError) as e:  # a damaged copy: try the one before
                self.echo(f"checkpoint {path} unreadable ({type(e).__name__}: {e}); "
                          "trying the one before")
                continue
            self.step, self.counters, self.summary = snap.step, snap.counters, snap.summary
            self.health.load_state_dict(snap.health)
            dropped = self.store.delete_after(self.step)
            self.metrics.drop_after(self.step)
            kept = len(snap.stages.get("ahead", []))
            self.echo(f"resumed from {path} (step {self.step}; {dropped} trajectories of "
                      "unfinished steps dropped and regenerated"
                      + (f"; {kept} batches collected ahead kept)" if kept else ")"))
            return
        # nothing to continue from: start over, dropping every partial record
        self.store.delete_after(0)
        self.metrics.drop_after(-1)
        self.echo(f"{self.root} has no checkpoint yet; starting from step 0")

    def checkpoint(self, step: int, stages) -> Path:
        """Write the checkpoint of the last completed step (`step`) from the latest snapshot."""
        snap = self._snap
        if snap is None or snap.step != step:
            self.step = step
            self.snapshot(stages)
            snap = self._snap
        folder = self.root / "checkpoints"
        if self._saved == (step, snap.id):  # nothing happened since it was written
            return folder / f"step_{step}"
        # the stages' own state is the snapshot's: read now, an asynchronous producer
        # could be changing the rollout pools
        learner_state = stages.learner.state_dict()
        path = save_checkpoint(folder, stages.model, learner_state, snap.to_json(),
                               keep=self.keep, rng=snap.rng)
        self._saved, self._last_save = (step, snap.id), time.monotonic()
        return path

    def maybe_checkpoint(self, step: int, stages, every: int = 0, seconds: float = 0.0) -> None:
        """A periodic checkpoint: every `every` steps, or once `seconds` have passed."""
        by_step = every and step % every == 0
        by_time = seconds and time.monotonic() - self._last_save >= seconds
        if by_step or by_time:
            self.checkpoint(step, stages)

    def interrupted(self, stages) -> None:
        """Ctrl-C: the checkpoint of the last completed step, then the lock is released."""
        try:
            path = self.checkpoint(self.step, stages) if self._snap is not None else None
            self.summary["interrupted_at_step"] = self.step
            self.write_summary()
            self.echo(f"interrupted: checkpoint of step {self.step} in {path}; "
                      f"continue with --resume {self.root}")
        finally:
            self.close()

    def has_eval(self, step: int) -> bool:
        """Whether metrics.jsonl already holds an evaluation at `step` (a resumed run does
        not evaluate twice)."""
        from rollwise.observe import read_metrics

        return any(r.get("kind") == "eval" and r.get("step") == step
                   for r in read_metrics(self.metrics.path, strict=False))

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
        """One metrics line (`records.step_record`): `groups` are all groups rolled out this
        step, `kept` those trained on, `control` the allocator's figures (zero_adv_frac,
        effective_samples, calib_brier..); the run's counters advance, the health check
        judges the record, and the step's trajectories are stored."""
        times = timer.times()
        self.counters = counted(self.counters, groups, rewards, times.seconds)
        record = step_record(step, num_steps, groups, kept, rewards, update, times,
                             self.counters, (control or {}) | device_memory())
        problems = self.health.observe(record)
        record["health_problems"] = len(problems)
        self.store.add_groups(step, groups)  # one transaction: the step's rows or none
        self._log(record)
        self.step = step
        line = format_step_line(record) + self._eta(times.seconds, step, num_steps)
        self.echo(line + (f" | WARNING: {'; '.join(problems)}" if problems else ""))
        if self.bar is not None:
            self.bar.advance(1)
        return record

    def _eta(self, seconds: float, step: int, num_steps: int) -> str:
        """' | eta 5m10s': the mean step time of this process so far times the steps left
        (evaluations not included), so a slow machine shows after one step what is coming."""
        self._step_times.append(seconds)
        left = num_steps - step
        if left <= 0:
            return ""
        eta = statistics.fmean(self._step_times) * left
        return f" | eta {int(eta // 60)}m{int(eta % 60):02d}s"

    def record_eval(self, step: int, result: dict, before: bool = False, after: bool = False):
        record = {"kind": "eval", "step": step, "wall_time": self.counters["train_seconds"],
                  "rollouts": self.counters["rollouts"], "tokens": self.counters["tokens"],
                  "eval_accuracy": result["accuracy"],
                  **{f"eval_{k}": v for k, v in result.items() if k != "accuracy"}}
        self._log(record)
        if before:
            self.summary["eval_before"] = result
        if after:
            self.summary["eval_after"] = result
        label = "before" if before else "after" if after else f"step {step}"
        self.echo(f"eval {label}: greedy accuracy {result['accuracy']:.3f} "
                  f"({int(result['num_prompts'])} prompts, {result['seconds']:.1f}s)")

    def record_sft(self, figures: dict) -> None:
        """One logging interval of the warm start ([sft]): a "sft" record and a line."""
        self._log({"kind": "sft", "step": 0, **figures})
        self.echo(f"sft {figures['sft_step']}/{figures['sft_steps']}: loss "
                  f"{figures['loss']:.4f}, token accuracy {figures['token_accuracy']:.3f}, "
                  f"{figures['tokens']} tokens, {figures['seconds']:.1f}s")

    def warm_started(self, stages, figures: dict | None) -> None:
        """The warm start is done: the run remembers it (a resumed run does not redo it)
        and checkpoints its weights as step 0. `None`: it was interrupted; nothing of it
        is kept (a resumed run starts over)."""
        if figures is None:
            self._snap = None
            return
        self.summary["sft"] = figures
        self.snapshot(stages)
        self.checkpoint(0, stages)

    def _log(self, record: dict) -> None:
        self.metrics.write(record)
        if self.loggers is not None:
            self.loggers.log(record)

    def raise_if_unhealthy(self, stages) -> None:
        """Stop the run (checkpoint and summary written) when the health check says so."""
        reason = self.health.verdict()
        if reason is None:
            return
        self.summary["stopped"] = reason
        self.checkpoint(self.step, stages)
        self.write_summary()
        self.close()
        raise RunUnhealthy(reason)

    def write_summary(self) -> dict:
        # the peak resident set of this process, or of an earlier one of the run if higher
        self.summary["peak_rss_mb"] = max(self.summary.get("peak_rss_mb", 0.0), run_peak_rss_mb())
        out = {**self.summary, **self.counters, "steps": self.step, "run_dir": str(self.root),
               "health_problem_steps": self.health.problem_steps}
        atomic_write_text(self.root / "summary.json", json.dumps(out, indent=2))
        return out

    def finish(self) -> dict:
        summary = self.write_summary()
        report = write_report(self.root)
        self.close()
        summary["report"] = str(report)
        return summary

    def close(self) -> None:
        """Close the files and release the run directory (idempotent)."""
        self.store.close()
        self.metrics.close()
        if self.loggers is not None:
            self.loggers.close()
        self.lock.release()
