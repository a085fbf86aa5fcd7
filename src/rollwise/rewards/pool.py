"""The reward pool: runs verifiers over trajectories in worker processes, with a hard time limit.

Why processes: a verifier that overruns `task.reward_timeout_s` must stop, whatever it is
doing. A thread cannot be stopped: one blocked in C holding the GIL (a catastrophic regex)
ignores every interrupt and stalls the run, and one blocked in C without it lives on, a
thread per time-out. A worker process is killed (SIGKILL) and a fresh one forked in its
place, so the pool keeps its capacity and nothing leaks.

Why `fork`: the verifiers are plain callables, lambdas and closures included; a forked
worker inherits them, so nothing but the (text, sample) of each call and its score cross
the pipe, in microseconds. Workers start with `start()` or the first `score` call of a
process (a pool copied into a forked process starts its own): `build` starts them before
the model loads, so they do not hold copy-on-write copies of its pages. They ignore SIGINT
(Ctrl-C is the driver's to handle), and exit when the pool closes or its process dies (their
pipe closes).
Where `fork` does not exist (Windows) the `spawn` method is used and verifiers must be
importable functions.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

from rollwise.types import IssueKind, RewardIssue, Sample, Trajectory

if TYPE_CHECKING:
    from typing_extensions import Self


class InfraError(RuntimeError):
    """Raised by a verifier whose infrastructure failed (a sandbox that could not start, a
    judge that did not answer) after its own retries: not the completion's fault. The pool
    records it as an "infra" `RewardIssue`, counts it in `RewardStats.num_infra` (not in
    num_errors), and the step masks the trajectory (`mask_infra_failures`)."""


class Scored(float):
    """A score with a note on how it came about (e.g. "sandbox timeout (2/5): wall time limit
    4s"): a verifier may return one; the pool keeps the score and records the note in
    `Trajectory.reward_errors` as a "note" `RewardIssue`, not counted as an error.

    >>> s = Scored(0.4, "2 of 5 tests passed"); s + 0.1, s.note
    (0.5, '2 of 5 tests passed')
    """

    note: str

    def __new__(cls, value: float, note: str = "") -> Scored:  # noqa: PYI034
        obj = super().__new__(cls, value)
        obj.note = note
        return obj


@dataclass
class RewardSpec:
    """One verifier in the reward: trajectory.reward = sum of weight * fn(text, sample)."""

    name: str  # key of this score in trajectory.scores
    fn: Callable[[str, Sample], float]  # (completion, sample) -> score
    weight: float = 1.0


@dataclass
class RewardStats:
    """What one `RewardPool.score` call did."""

    num_scored: int  # trajectories scored
    num_errors: int  # verifier calls that raised (or returned a non-finite / non-number)
    num_timeouts: int  # verifier calls cut off after timeout_s
    seconds: float  # wall time of the call
    num_infra: int = 0  # verifier calls whose infrastructure failed (InfraError): masked

    def __add__(self, other: RewardStats) -> RewardStats:
        """The stats of two calls together (a step that rolled out more than once)."""
        return RewardStats(self.num_scored + other.num_scored, self.num_errors + other.num_errors,
                           self.num_timeouts + other.num_timeouts, self.seconds + other.seconds,
                           self.num_infra + other.num_infra)


def _serve(conn, specs: list[RewardSpec]) -> None:
    """A worker process: (job id, spec index, text, sample) in, (job id, score, issue kind
    or None, its message, seconds, note) out, until the pipe closes or None arrives."""
    from rollwise.system.runlock import close_inherited

    close_inherited()  # never keep the parent's run directory locked
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    while True:
        try:
            # Sibling workers forked later hold copies of this pipe's other end, so a dead
            # parent does not always mean end-of-file here: check who the parent is.
            if not conn.poll(1.0):
                if os.getppid() != parent:
                    return
                continue
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        job_id, index, text, sample = msg
        start = time.perf_counter()
        kind: IssueKind | None = None
        try:
            value, message = specs[index].fn(text, sample), ""
        except InfraError as err:
            value, kind, message = 0.0, "infra", str(err)
        except BaseException as err:  # noqa: BLE001 - any verifier failure scores 0
            value, kind, message = 0.0, "error", f"{type(err).__name__}: {err}"
        if kind is None and (problem := _check_value(value)):
            kind, message = "error", problem
        note = str(getattr(value, "note", "") or "")[:500]
        conn.send((job_id, 0.0 if kind else float(value), kind, message,
                   time.perf_counter() - start, note))


def _context():
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


class _Worker:
    """One worker process and the job it is running (if any)."""

    def __init__(self, specs: list[RewardSpec]):
        ctx = _context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, specs), daemon=True,
                                name="rollwise-reward")
        self.proc.start()
        child.close()
        self.job: int | None = None  # index into the score() call's job list
        self.started = 0.0

    def send(self, job: int, payload: tuple) -> None:
        self.job, self.started = job, time.perf_counter()
        self.conn.send((job, *payload))

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(timeout=1)
        self.kill()


class RewardPool:
    """Scores trajectories with weighted verifiers, in worker processes, with a time limit
    per verifier call after which the worker is killed.

    >>> from rollwise.rewards.verifiers import final_number, format_reward
    >>> specs = [RewardSpec("correct", final_number), RewardSpec("format", format_reward, 0.1)]
    >>> pool = RewardPool(specs, timeout_s=5.0, num_workers=2)
    >>> t = Trajectory(Sample("a/0", "23+45=", "68"), [], [], [], [], "stop", text="68#68")
    >>> pool.score([t]).num_scored, t.reward, t.scores, t.reward_errors
    (1, 1.1, {'correct': 1.0, 'format': 1.0}, [])
    >>> pool.close()
    """

    def __init__(self, specs: list[RewardSpec], timeout_s: float = 5.0, num_workers: int = 2):
        names = [spec.name for spec in specs]
        if not specs or len(set(names)) != len(names) or "errors" in names:
            raise ValueError(
                f"reward specs need at least one verifier, unique names, none called 'errors'; "
                f"got names {names}"
            )
        if timeout_s <= 0 or num_workers < 1:
            raise ValueError(
                f"timeout_s must be > 0 and num_workers >= 1, got {timeout_s} and {num_workers}"
            )
        self.specs = list(specs)
        self.timeout_s = timeout_s
        self.num_workers = num_workers
        self.workers_started = 0  # processes forked over the pool's life (replacements too)
        self._workers: list[_Worker] = []
        self._owner = os.getpid()
        self._forked_with: list[RewardSpec] | None = None
        self._lock = threading.Lock()  # one score() at a time: the workers are shared
        self._closed = False

    def _ready_workers(self) -> list[_Worker]:
        """The pool's live workers, (re)started when missing, when this is a forked copy of
        the pool, or when `specs` changed since they were forked."""
        if os.getpid() != self._owner:  # a forked process: the pipes belong to the parent
            self._workers, self._owner = [], os.getpid()
        if self._forked_with != self.specs:
            for w in self._workers:
                w.stop()
            self._workers, self._forked_with = [], list(self.specs)
        while len(self._workers) < self.num_workers:
            self._workers.append(self._spawn())
        return self._workers

    def start(self) -> RewardPool:
        """Fork the workers now (else the first `score` does); returns the pool."""
        with self._lock:
            self._ready_workers()
        return self

    def _spawn(self) -> _Worker:
        self.workers_started += 1
        return _Worker(self._forked_with or self.specs)

    def score(self, trajectories: list[Trajectory]) -> RewardStats:
        """Score `trajectories` in place and return counts.

        Sets ``t.reward = sum(weight * score)``, ``t.scores = {name: score, ...}``,
        ``t.reward_errors = [RewardIssue, ...]`` (a failure of a term, or its note; a timeout's
        message reads "timeout after Xs") and ``t.timings["reward"]`` = seconds its verifiers
        ran (a timed-out call counts as timeout_s). A verifier that raises, times out, returns
        a non-finite value
        or kills its worker scores 0.
        """
        if self._closed:
            raise RuntimeError("RewardPool.score called after close()")
        start = time.perf_counter()
        for traj in trajectories:
            traj.scores = {spec.name: 0.0 for spec in self.specs}
            traj.reward_errors = []
            traj.timings["reward"] = 0.0
        jobs = [(row, i) for row in range(len(trajectories)) for i in range(len(self.specs))]
        with self._lock:
            counts = self._run(jobs, trajectories) if jobs else (0, 0, 0)
        for traj in trajectories:
            traj.reward = sum(spec.weight * traj.scores[spec.name] for spec in self.specs)
        errors, timeouts, infra = counts
        return RewardStats(len(trajectories), errors, timeouts, time.perf_counter() - start,
                           infra)

    def _run(self, jobs: list[tuple[int, int]], trajs: list[Trajectory]
             ) -> tuple[int, int, int]:
        """Hand jobs to idle workers, collect results, kill overrunning workers; returns
        (errors, timeouts, infrastructure failures)."""
        workers = self._ready_workers()
        todo, done = deque(range(len(jobs))), 0
        errors = timeouts = infra = 0
        while done < len(jobs):
            for w in workers:
                if w.job is None and todo:
                    job = todo.popleft()
                    row, i = jobs[job]
                    w.send(job, (i, trajs[row].text, trajs[row].sample))
            busy = [w for w in workers if w.job is not None]
            deadline = min(w.started for w in busy) + self.timeout_s
            ready = wait([w.conn for w in busy], timeout=max(deadline - time.perf_counter(),
                                                               1e-3))
            for w in busy:
                row, i = jobs[w.job]
                if w.conn in ready:
                    try:
                        _, value, kind, message, seconds, note = w.conn.recv()
                    except (EOFError, OSError):  # the verifier took its process down
                        value, kind, message, seconds, note = \
                            0.0, "error", "worker process died", 0.0, ""
                        self._replace(workers, w)
                elif time.perf_counter() - w.started >= self.timeout_s:
                    value, kind, seconds, note = 0.0, "timeout", self.timeout_s, ""
                    message = f"timeout after {self.timeout_s:g}s"
                    self._replace(workers, w)
                else:
                    continue
                errors, timeouts = errors + (kind == "error"), timeouts + (kind == "timeout")
                infra += kind == "infra"
                name = self.specs[i].name
                self._record(trajs[row], self.specs[i], value,
                             RewardIssue(kind, name, message) if kind else None, seconds)
                if note and not kind:
                    trajs[row].reward_errors.append(RewardIssue("note", name, note))
                w.job = None
                done += 1
        return errors, timeouts, infra

    def _replace(self, workers: list[_Worker], worker: _Worker) -> None:
        """Kill `worker` (a stuck verifier stops now, whatever it was doing), fork another."""
        worker.kill()
        workers[workers.index(worker)] = self._spawn()

    @staticmethod
    def _record(traj: Trajectory, spec: RewardSpec, value: object, issue: RewardIssue | None,
                seconds: float) -> None:
        traj.scores[spec.name] = 0.0 if issue else float(value)  # type: ignore[arg-type]
        if issue:
            traj.reward_errors.append(issue)
        traj.timings["reward"] += seconds

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() == self._owner:
            for w in self._workers:
                w.stop()
        self._workers.clear()

    def __del__(self):
        with contextlib.suppress(Exception):  # interpreter shutdown: modules may be gone
            self.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_value(value: object) -> str | None:
    """None when `value` is a finite real number, else what is wrong with it."""
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return f"returned {type(value).__name__} {value!r}, not a number"
    return None if math.isfinite(number) else f"returned non-finite {number}"


def infra_failed(traj: Trajectory) -> bool:
    """Whether a verifier of `traj` failed for infrastructure reasons (see InfraError)."""
    return any(e.kind == "infra" for e in traj.reward_errors)


def mask_infra_failures(trajectories: list[Trajectory]) -> int:
    """Give each trajectory of one group whose scoring hit an infrastructure failure the mean
    reward of its siblings that scored cleanly, so its group-relative advantage is zero: it
    neither rewards nor punishes the policy. Returns how many were masked (all of a group's
    failed: their rewards are left at 0 and every advantage of the group is zero anyway).

    >>> ts = [Trajectory(Sample("a", "q", "1"), [], [], [], [], "stop") for _ in range(3)]
    >>> ts[0].reward, ts[1].reward = 1.0, 0.0
    >>> ts[2].reward_errors = [RewardIssue("infra", "correct", "sandbox did not start")]
    >>> mask_infra_failures(ts), ts[2].reward
    (1, 0.5)
    """
    bad = [t for t in trajectories if infra_failed(t)]
    good = [t.reward for t in trajectories if not infra_failed(t)]
    if bad and good:
        for t in bad:
            t.reward = sum(good) / len(good)
    return len(bad)
