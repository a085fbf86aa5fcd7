"""The reward pool: runs verifiers over trajectories in worker threads, with a time limit each.

Why threads and not processes: the normal path scores ~32 trajectories with cheap verifiers
per step, and handing a job to a warm thread costs microseconds, while a process pool would
pickle every sample and forbid lambdas and closures as verifiers.

The price is that a thread cannot be killed. When a verifier overruns `timeout_s`:

- its score is 0 and the trajectory records the timeout; `score` returns without waiting;
- its worker is retired and a fresh worker takes its place, so the pool keeps its capacity;
- the retired worker is interrupted with an asynchronous exception (`PyThreadState_SetAsyncExc`).
  That stops pure-Python loops (``while True: pass``) at their next bytecode, but not a call
  blocked in C (``time.sleep(100)``, a catastrophic regex): such a worker lives on in the
  background until the call returns, then exits. Workers are daemon threads, so a stuck one
  never blocks interpreter exit. Verifiers that can block in C for long should be made
  time-bounded themselves (or run in a subprocess by the verifier).
"""

from __future__ import annotations

import ctypes
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollwise.types import Sample, Trajectory

if TYPE_CHECKING:
    from typing_extensions import Self


@dataclass
class RewardSpec:
    """One verifier in the reward: trajectory.reward = sum of weight * fn(text, sample)."""

    name: str  # key of this score in trajectory.reward_info
    fn: Callable[[str, Sample], float]  # (completion, sample) -> score
    weight: float = 1.0


@dataclass
class RewardStats:
    """What one `RewardPool.score` call did."""

    num_scored: int  # trajectories scored
    num_errors: int  # verifier calls that raised (or returned a non-finite / non-number)
    num_timeouts: int  # verifier calls cut off after timeout_s
    seconds: float  # wall time of the call

    def __add__(self, other: RewardStats) -> RewardStats:
        """The stats of two calls together (a step that rolled out more than once)."""
        return RewardStats(self.num_scored + other.num_scored, self.num_errors + other.num_errors,
                           self.num_timeouts + other.num_timeouts, self.seconds + other.seconds)


class _Interrupt(BaseException):
    """Raised asynchronously inside a worker whose verifier overran; BaseException so that a
    verifier's own ``except Exception`` does not swallow it."""


@dataclass(eq=False)
class _Job:
    """One verifier call on one trajectory. `lock` orders 'finished' against 'abandoned'."""

    row: int  # index of the trajectory in the score() call
    spec: RewardSpec
    text: str
    sample: Sample
    results: queue.SimpleQueue  # the score() call's result queue
    started: float | None = None  # perf_counter when a worker picked it up
    finished: bool = False
    abandoned: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Worker(threading.Thread):
    """Takes jobs from the shared queue until it gets None or is retired."""

    def __init__(self, jobs: queue.SimpleQueue, index: int) -> None:
        super().__init__(name=f"rollwise-reward-{index}", daemon=True)
        self.jobs = jobs
        self.current: _Job | None = None
        self.retired = False

    def run(self) -> None:
        while not self.retired:
            try:
                job = self.jobs.get()
                if job is None:
                    return
                self._run_one(job)
            except _Interrupt:
                continue  # a late interrupt; the pool has already recorded the timeout

    def _run_one(self, job: _Job) -> None:
        self.current, job.started = job, time.perf_counter()
        try:
            try:
                value, error = job.spec.fn(job.text, job.sample), None
            except _Interrupt:
                raise
            except BaseException as err:  # noqa: BLE001 - any verifier failure scores 0
                value, error = 0.0, f"{type(err).__name__}: {err}"
            with job.lock:
                job.finished = True
        except _Interrupt:
            return  # the pool gave up on this job and retired this worker
        seconds = time.perf_counter() - job.started
        self.current = None
        if not job.abandoned:
            job.results.put((job, value, error, seconds))


def _interrupt(thread: threading.Thread) -> None:
    """Best effort: raise `_Interrupt` in `thread` at its next Python bytecode."""
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(_Interrupt)
        )


class RewardPool:
    """Scores trajectories with weighted verifiers, in threads, with a per-call time limit.

    >>> from rollwise.rewards.verifiers import final_number, format_reward
    >>> specs = [RewardSpec("correct", final_number), RewardSpec("format", format_reward, 0.1)]
    >>> pool = RewardPool(specs, timeout_s=5.0, num_workers=2)
    >>> t = Trajectory(Sample("a/0", "23+45=", "68"), [], [], [], [], "stop", text="68#68")
    >>> pool.score([t]).num_scored, t.reward, t.reward_info
    (1, 1.1, {'correct': 1.0, 'format': 1.0, 'errors': []})
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
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[_Worker] = []
        self._spawned = 0
        self._closed = False
        for _ in range(num_workers):
            self._spawn()

    def _spawn(self) -> None:
        worker = _Worker(self._jobs, self._spawned)
        self._spawned += 1
        self._workers.append(worker)
        worker.start()

    def score(self, trajectories: list[Trajectory]) -> RewardStats:
        """Score `trajectories` in place and return counts.

        Sets ``t.reward = sum(weight * score)``, ``t.reward_info = {name: score, ...,
        "errors": [...]}`` (each error "name: what happened"; a timeout reads "name: timeout
        after Xs") and ``t.timings["reward"]`` = seconds its verifiers ran (a timed-out call
        counts as timeout_s). A verifier that raises, times out, or returns a non-finite value
        scores 0.
        """
        if self._closed:
            raise RuntimeError("RewardPool.score called after close()")
        start = time.perf_counter()
        results: queue.SimpleQueue = queue.SimpleQueue()
        pending: set[_Job] = set()
        for row, traj in enumerate(trajectories):
            traj.reward_info = {**{spec.name: 0.0 for spec in self.specs}, "errors": []}
            traj.timings["reward"] = 0.0
            for spec in self.specs:
                job = _Job(row, spec, traj.text, traj.sample, results)
                pending.add(job)
                self._jobs.put(job)
        num_errors = num_timeouts = 0
        while pending:
            try:
                job, value, error, seconds = results.get(timeout=self._wait_time())
            except queue.Empty:
                num_timeouts += self._expire(pending, trajectories)
                continue
            pending.discard(job)
            error = error or _check_value(value)
            num_errors += error is not None
            self._record(trajectories[job.row], job.spec, value, error, seconds)
        for traj in trajectories:
            info = traj.reward_info
            traj.reward = sum(spec.weight * info[spec.name] for spec in self.specs)
        seconds = time.perf_counter() - start
        return RewardStats(len(trajectories), num_errors, num_timeouts, seconds)

    def _wait_time(self) -> float:
        """Seconds until the earliest running job reaches its time limit (>= 1 ms)."""
        now, wait = time.perf_counter(), self.timeout_s
        for worker in self._workers:
            job = worker.current
            if job is not None and job.started is not None:
                wait = min(wait, job.started + self.timeout_s - now)
        return max(wait, 1e-3)

    def _expire(self, pending: set[_Job], trajectories: list[Trajectory]) -> int:
        """Abandon running jobs past their limit, replace their workers; returns how many."""
        now, expired = time.perf_counter(), 0
        for worker in list(self._workers):
            job = worker.current
            if job is None or job not in pending or job.started is None:
                continue
            if now - job.started < self.timeout_s:
                continue
            with job.lock:
                if job.finished:
                    continue  # it made it; its result is on the queue
                job.abandoned = True
                worker.retired = True
                _interrupt(worker)
            pending.discard(job)
            self._workers.remove(worker)
            self._spawn()
            expired += 1
            message = f"timeout after {self.timeout_s:g}s"
            self._record(trajectories[job.row], job.spec, 0.0, message, self.timeout_s)
        return expired

    @staticmethod
    def _record(
        traj: Trajectory, spec: RewardSpec, value: object, error: str | None, seconds: float
    ) -> None:
        traj.reward_info[spec.name] = 0.0 if error else float(value)  # type: ignore[arg-type]
        if error:
            traj.reward_info["errors"].append(f"{spec.name}: {error}")
        traj.timings["reward"] += seconds

    def close(self) -> None:
        """Stop the workers (a stuck one exits when its call returns). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for _ in self._workers:
            self._jobs.put(None)
        self._workers.clear()

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
