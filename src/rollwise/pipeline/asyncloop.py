"""The asynchronous driver: the rollouts of the next steps are generated while a step trains.

Built from the synchronous driver's two halves (`loop.collect`, `loop.learn`), nothing else:

    producer thread                        the caller's thread (trains)
    for step k:                            for step k:
      wait until version >= k - S            take step k's batch (wait while none is ready)
      collect(k)   (select, roll out,        drop (or roll out again) groups whose oldest
                    score, allocate)           token is more than S versions behind
      queue it                               learn(k)   (advantages, update, publish k+1)

`S = schedule.max_staleness` is AReaL's bound on off-policyness: the rollouts of step k start
once the learner has published version k - S, so at most S updates happen between a
token's sampling and its training. `S = 0` is synchronous training exactly: the rollouts
of step k start after the update of step k-1, with the same prompts, seeds and weights.

The stage objects must allow one rollout while another thread trains. With the Ray
backend the engines are separate processes with their own copy of the weights. In one
process the engine reads the learner's tensors, which an update changes in place, so the
local backend runs only `S = 0` (build.check_run_config says so).
"""

from __future__ import annotations

import json
import threading
import time

from rollwise.pipeline.loop import Collected, collect, learn, staleness_histogram
from rollwise.run.rundir import Run, StepTimer
from rollwise.pipeline.stages import Stages
from rollwise.types import Group

STALE_POLICIES = ("drop", "regenerate")


def staleness(group: Group, version: int) -> int:
    """Versions between the group's oldest token and `version` (0 when it has no tokens)."""
    return max((t.age(version) for t in group.trajectories), default=0)


def bound_staleness(stages: Stages, batch: Collected, version: int, max_staleness: int,
                    policy: str) -> int:
    """Remove from `batch.kept` the groups with a trajectory more than `max_staleness`
    versions behind `version` and count their trajectories (`batch.stale_dropped`); with
    policy 'regenerate' the controller asks for their prompts again (current weights),
    sees their scores, and they are trained in their place. The groups removed: how many."""
    if policy not in STALE_POLICIES:
        raise ValueError(f"stale_policy must be one of {', '.join(STALE_POLICIES)}, "
                         f"got '{policy}'")
    stale = [g for g in batch.kept if staleness(g, version) > max_staleness]
    if not stale:
        return 0
    batch.kept = [g for g in batch.kept if all(g is not s for s in stale)]
    batch.stale_dropped += sum(len(g.trajectories) for g in stale)
    if policy == "regenerate":
        groups, stats, requested = stages.regenerate(stale)
        batch.reward_stats = batch.reward_stats + stats
        batch.requested += requested
        batch.groups = batch.groups + groups
        batch.kept = batch.kept + groups
    return len(stale)


class AsyncSteps:
    """The asynchronous step, in the shape of `loop.SyncSteps` (pass it to `loop.train`
    with `functools.partial(AsyncSteps, max_staleness=S, stale_policy=...)`)."""

    def __init__(self, stages: Stages, run: Run, start: int, num_steps: int, *,
                 max_staleness: int = 1, stale_policy: str = "drop"):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if stale_policy not in STALE_POLICIES:
            raise ValueError(f"stale_policy must be one of {', '.join(STALE_POLICIES)}, "
                             f"got '{stale_policy}'")
        self.stages, self.run, self.num_steps = stages, run, num_steps
        self.max_staleness, self.stale_policy = max_staleness, stale_policy
        self._cv = threading.Condition()
        self._version = start  # the policy version the learner has published
        self._ready: dict[int, Collected] = {}
        self._error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._produce, args=(start,), daemon=True,
                                        name="rollwise-producer")
        self._thread.start()

    # -- the producer thread ---------------------------------------------------------------
    def _produce(self, start: int) -> None:
        try:
            for step in range(start, self.num_steps):
                with self._cv:
                    while not self._stop and self._version < step - self.max_staleness:
                        self._cv.wait()
                    if self._stop:
                        return
                    version = self._version
                timer = StepTimer()
                batch = collect(self.stages, timer)
                batch.phases = dict(timer.phases)
                # the stages' state once this step's rollouts are taken: what a checkpoint
                # after this step holds (the later steps' rollouts are generated again)
                batch.state = json.loads(json.dumps(self.stages.stage_state()))
                batch.control = dict(batch.control, rollout_started_version=version)
                with self._cv:
                    self._ready[step] = batch
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            with self._cv:
                self._error = e
                self._cv.notify_all()

    # -- the training thread ---------------------------------------------------------------
    def step(self, step: int) -> dict:
        timer = self.run.timer()
        waited = time.perf_counter()
        with self._cv:
            while step not in self._ready and self._error is None:
                self._cv.wait()
            if step not in self._ready:
                raise self._error  # type: ignore[misc]
            batch = self._ready.pop(step)
            depth = len(self._ready)  # batches of later steps already waiting
        timer.phases["wait"] = time.perf_counter() - waited
        for name, seconds in batch.phases.items():  # overlapped with earlier steps
            timer.phases[name] = timer.phases.get(name, 0.0) + seconds
        before = staleness_histogram(batch.kept, step)  # what was rolled out, bound aside
        removed = bound_staleness(self.stages, batch, step, self.max_staleness,
                                  self.stale_policy)
        extra = {f"rolled_{k}": v for k, v in before.items()} | {
            "queue_depth": depth, "stale_groups": removed}
        batch.state = dict(batch.state or {}, version=step + 1)
        record = learn(self.stages, self.run, step, self.num_steps, batch, timer, extra)
        with self._cv:
            self._version = step + 1
            self._cv.notify_all()
        return record

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=600)
