"""The crash-test harness: kill a tiny run at random instants, resume it, compare.

    report = crash_test(cfg, kills=30, seed=0, workdir=Path("/tmp/crash"))

The stages are built once here; every run is a forked child that inherits that pristine
copy (exactly what a fresh process would build, without the seconds of imports and
model loading), so hundreds of kills fit in minutes. One child trains the reference
run uninterrupted. Then, round after round, a child trains a new run directory with
`--resume` semantics and is sent SIGKILL or SIGINT after a random delay (anywhere in
rollout, scoring, the update, an evaluation, a checkpoint write, the report); the next
child resumes it; a round ends when a child finishes. Each finished round must have:

- every step's metrics equal to the reference's (timings aside),
- every completed trajectory stored exactly once, equal to the reference's,
- `summary.json` counters that add up to the per-step records,
- a `config.toml` that reads back as the run's config (each resumed child checks it, as
  `--resume` reads it: import-path keys included).

An asynchronous run (`schedule.mode = "async"`, `max_staleness >= 1`) mixes policy versions
by timing, so there only what timing cannot change is compared (`compare(exact=False)`:
records, every trajectory once with the reference's prompt, the counters) and checked
(`async_checks`: each step's requested trajectories all accounted for, none trained beyond
the bound); and every batch a checkpoint kept (collected ahead of its step) that a resumed
child went on from must be stored for its step exactly as the checkpoint held it
(`kept_batches`, `check_kept`: tokens, log-probs, versions).

With `USER_CODE` in its overrides the run plugs in users' own code by import path: a
verifier and a group term with an option, both below (tests/test_crash.py does;
`scripts/crash_harness.py --user-code`).

`scripts/crash_harness.py` runs it from the command line for longer.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from rollwise.compose.config import Config, load_config, to_toml
from rollwise.learner.checkpoint import list_checkpoints
from rollwise.replay import TrajectoryStore
from rollwise.rewards.group import group_reward
from rollwise.types import Sample, Trajectory

# metric names holding wall-clock figures, or the process's memory (peak_rss_mb: a resumed
# process has its own history, and a fork inherits its parent's); how far a server's probe
# log-probs sit from the trainer's (its float32 rounding, which depends on how it batched);
# and how far the version a step loaded is from the one the servers held before it, which
# after a resume is the weights the resumed trainer published first (version 0 at build,
# then its checkpoint's), not the version the interrupted trainer had loaded
# (rollout/remote.py `_verify`)
VOLATILE = ("time", "seconds", "per_s", "peak_rss", "cuda_max_allocated",
            "remote_weights_probe_error", "remote_weights_probe_gap")


def short_answer(completion: str, sample: Sample) -> float:
    """A user's verifier, named by import path: 1 for a response of at most 8 characters."""
    return float(len(completion) <= 8)


@group_reward
def shorter_than_siblings(trajectories: list[Trajectory], *, margin: int = 0) -> list[float]:
    """A user's group term, named by import path: 1 for a response at least `margin`
    tokens shorter than its group's longest."""
    longest = max(t.num_tokens for t in trajectories)
    return [float(t.num_tokens + margin <= longest) for t in trajectories]


USER_CODE = [  # overrides plugging both in, the group term with an option
    (f"task.rewards={{correct = 1.0, '{__name__}:short_answer' = 0.2, "
     f"'{__name__}:shorter_than_siblings' = 0.1}}"),
    f"task.reward_options={{'{__name__}:shorter_than_siblings' = {{ margin = 1 }} }}"]


@dataclass
class CrashReport:
    kills: int = 0
    sigkills: int = 0
    sigints: int = 0
    rounds: int = 0
    resumes: int = 0
    reference_seconds: float = 0.0
    kept: int = 0  # batches collected ahead that resumed runs trained as checkpointed
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def _child(stages, root: Path, cfg: Config, resume: bool) -> None:
    """Body of a forked child: train `root` to the end; never returns."""

    def work() -> None:
        from rollwise.pipeline.build import run_steps
        from rollwise.pipeline.loop import train
        from rollwise.run.rundir import Run

        stored = root / "config.toml"  # absent when the first child died before it
        if resume and stored.is_file() and load_config(stored) != cfg:
            raise ValueError("config.toml does not read back as the run's config")
        run = Run(root, resume=resume, echo=lambda s: None, config_toml=to_toml(cfg),
                  keep_checkpoints=cfg.run.keep_checkpoints)
        train(stages, run, cfg.run.num_steps, eval_every=cfg.eval.every,
              eval_before=cfg.eval.before, checkpoint_every=cfg.run.checkpoint_every,
              steps=run_steps(cfg))

    child_exit(work, root.parent / f"{root.name}.error")


def child_exit(work, error_file: Path) -> None:
    """Run `work()` in a forked child, then exit it: 0 when it returned, 130 on Ctrl-C,
    1 with "Type: message" in `error_file` when it raised. Never returns (an exception
    must not climb into the copy of the harness's own stack)."""
    code = 1
    try:
        try:
            work()
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # finished: a late Ctrl-C is moot
            code = 0
        except KeyboardInterrupt:
            code = 130
        except BaseException as e:  # noqa: BLE001 - reported by exit code and a file
            error_file.write_text(f"{type(e).__name__}: {e}")
    except KeyboardInterrupt:  # a signal while handling the first one
        code = 130
    finally:
        os._exit(code)


def _spawn(stages, root: Path, cfg: Config, resume: bool) -> int:
    pid = os.fork()
    if pid == 0:
        _child(stages, root, cfg, resume)
    return pid


def wait_exit(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def stable(record: dict) -> dict:
    """A metrics record without its wall-clock and memory figures (names with time,
    seconds, per_s, peak_rss, or ending in _s)."""
    return {k: v for k, v in record.items()
            if not (k.endswith("_s") or any(s in k for s in VOLATILE))}


def read_run(root: Path) -> tuple[list[dict], list[tuple], dict]:
    """(stable metrics records, stored trajectories as rows, summary) of a run directory."""
    records = [stable(json.loads(x)) for x in (root / "metrics.jsonl").read_text().splitlines()]
    conn = sqlite3.connect(root / "trajectories.sqlite")
    try:
        rows = conn.execute("SELECT step, group_idx, traj_idx, sample_id, response_ids, reward,"
                            " text FROM trajectories ORDER BY step, group_idx, traj_idx"
                            ).fetchall()
    finally:
        conn.close()
    return records, rows, json.loads((root / "summary.json").read_text())


def alike(a, b, rel: float) -> bool:
    """Equal, numbers to a relative `rel` (0: exactly), records and lists item by item."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(alike(a[k], b[k], rel) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(alike(x, y, rel) for x, y in zip(a, b))
    if rel and isinstance(a, float) and isinstance(b, (int, float)):
        return abs(a - b) <= rel * max(abs(a), abs(b)) + 1e-6
    return a == b


def compare(root: Path, reference: tuple[list[dict], list[tuple], dict],
            rel: float = 0.0, exact: bool = True) -> list[str]:
    """What differs between a crashed-and-resumed run and the reference ([] if nothing).
    `rel`: metrics equal to that relative difference (0: exactly; a run against a server
    gets its log-probs to float32 rounding, which the losses carry). Not `exact`: only
    what timing cannot change (an asynchronous run's version mix can): each record's
    kind and step, each trajectory's (step, group, index, prompt), the counters."""
    records, rows, summary = read_run(root)
    ref_records, ref_rows, _ = reference
    train = [r for r in records if r.get("kind") == "train"]
    out = []
    if not exact:
        records, rows = [(r["kind"], r["step"]) for r in records], [r[:4] for r in rows]
        ref_records = [(r["kind"], r["step"]) for r in ref_records]
        ref_rows = [r[:4] for r in ref_rows]
    if not alike(records, ref_records, rel):
        diff = next((i for i, (a, b) in enumerate(zip(records, ref_records))
                     if not alike(a, b, rel)), min(len(records), len(ref_records)))
        out.append(f"{root.name}: metrics differ from line {diff + 1} "
                   f"({len(records)} lines vs {len(ref_records)})")
    keys = [r[:3] for r in rows]
    if len(set(keys)) != len(keys):
        out.append(f"{root.name}: {len(keys) - len(set(keys))} duplicated trajectories")
    if rows != ref_rows:
        out.append(f"{root.name}: stored trajectories differ ({len(rows)} vs {len(ref_rows)})")
    sums = {"rollouts": sum(r["step_rollouts"] for r in train),
            "tokens": sum(r["step_tokens"] for r in train),
            "reward_errors": sum(r["reward_errors"] for r in train), "steps": len(train)}
    for key, total in sums.items():
        if summary.get(key) != total:
            out.append(f"{root.name}: summary {key} = {summary.get(key)}, steps add to {total}")
    return out


def timing_free(cfg: Config) -> bool:
    """Whether two uninterrupted runs of `cfg` equal each other exactly: not so for an
    asynchronous run with staleness (the version each step's rollouts start from)."""
    return cfg.schedule.mode == "sync" or cfg.schedule.max_staleness == 0


def async_checks(root: Path, bound: int) -> list[str]:
    """What must hold of an asynchronous run whatever the timing ([] if it does): each
    step's requested trajectories trained, filtered or dropped as stale, none trained
    with a token more than `bound` versions old."""
    out = []
    for r in read_run(root)[0]:
        if r["kind"] != "train":
            continue
        if r["traj_requested"] != r["traj_trained"] + r["traj_filtered"] \
                + r["traj_stale_dropped"]:
            out.append(f"{root.name}: step {r['step']} lost requested trajectories")
        if any(r.get(f"staleness_hist_{k}", 0) for k in (*range(bound + 1, 3), "3plus")):
            out.append(f"{root.name}: step {r['step']} trained tokens over the bound")
    return out


def kept_batches(root: Path) -> dict[int, list[tuple]]:
    """The batches collected ahead that the run's latest checkpoint keeps (what a resumed
    run trains first), by the step each is recorded as: each trajectory's (prompt id,
    response ids, log-probs, versions), in order."""
    saved = list_checkpoints(root / "checkpoints")
    if not saved:
        return {}
    state = json.loads((saved[-1] / "state.json").read_text())
    return {state["step"] + 1 + i: [(t["sample"], t["response_ids"], t["logprobs"],
                                     t["versions"]) for g in b["groups"]
                                    for t in g["trajectories"]]
            for i, b in enumerate(state["stages"].get("ahead", []))}


def check_kept(root: Path, kept: dict[int, list[tuple]]) -> list[str]:
    """Each kept batch stored for its step exactly as its checkpoint held it ([] if so);
    trajectories regenerated for stale groups may follow it."""
    store = TrajectoryStore(root / "trajectories.sqlite")
    try:
        stored = {step: [(t.sample.id, t.response_ids, t.logprobs, t.versions)
                         for t in store.load_step(step)] for step in kept}
    finally:
        store.close()
    return [f"{root.name}: step {step} did not train the batch its checkpoint kept"
            for step, rows in kept.items() if stored[step][:len(rows)] != rows]


def crash_test(cfg: Config, kills: int, seed: int, workdir: Path,
               sigint_share: float = 0.3, log=lambda s: None) -> CrashReport:
    """Run the harness (see the module docstring) with at least `kills` kills."""
    from rollwise.pipeline.build import build

    workdir.mkdir(parents=True, exist_ok=True)
    stages = build(cfg)
    report = CrashReport()
    start = time.perf_counter()
    ref_root = workdir / "reference"
    if (code := wait_exit(_spawn(stages, ref_root, cfg, resume=False))) != 0:
        raise RuntimeError(f"reference run failed ({code}): "
                           f"{(workdir / 'reference.error').read_text()[:500]}")
    report.reference_seconds = time.perf_counter() - start
    reference = read_run(ref_root)
    rng = random.Random(seed)
    exact = timing_free(cfg)
    while report.kills < kills:
        report.rounds += 1
        root = workdir / f"round_{report.rounds}"
        kept = _crash_round(stages, root, cfg, rng, report, sigint_share, kills)
        failures = compare(root, reference, exact=exact) + check_kept(root, kept)
        if not exact:
            failures += async_checks(root, cfg.schedule.max_staleness)
        report.kept += len(kept)
        report.failures += failures
        log(f"round {report.rounds}: {report.kills} kills so far"
            + (f"; FAILED: {failures}" if failures else ""))
    return report


def _crash_round(stages, root: Path, cfg: Config, rng: random.Random, report: CrashReport,
                 sigint_share: float, kills: int) -> dict[int, list[tuple]]:
    """Kill and resume one run directory until a child finishes it; the batches kept by
    the checkpoints resumed from (`kept_batches`, the latest for each step)."""
    resume, kept = False, {}
    while True:
        if resume:
            kept.update(kept_batches(root))
        pid = _spawn(stages, root, cfg, resume=resume)
        report.resumes += resume
        code = None
        if report.kills < kills:
            time.sleep(rng.uniform(0.0, 1.1 * report.reference_seconds))
            sig = signal.SIGINT if rng.random() < sigint_share else signal.SIGKILL
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:  # it finished before the signal
                code = os.waitstatus_to_exitcode(status)
            else:
                os.kill(pid, sig)
                report.kills += 1
                report.sigints += sig == signal.SIGINT
                report.sigkills += sig == signal.SIGKILL
        if code is None:
            code = wait_exit(pid)
        if code == 0:
            return kept
        if code == 1:
            error = (root.parent / f"{root.name}.error").read_text()
            report.failures.append(f"{root.name}: a run failed: {error[:300]}")
            return {}
        resume = True
