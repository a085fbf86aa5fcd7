"""The asynchronous driver: the rollouts of the next steps are generated while a step trains.

Built from the synchronous driver's two halves (`loop.collect`, `loop.learn`), nothing else:

    producer thread                        the caller's thread (trains)
    for step k:                            for step k:
      wait until version >= k - S            take step k's batch (wait while none is ready)
      collect(k)   (select, roll out,        learn(k)   (advantages, update, publish k+1)
                    score, allocate)
      drop (or roll out again) the groups
        whose oldest token is more than S
        versions behind k (step k trains
        at version k)
      queue it

`S = schedule.max_staleness` is AReaL's bound on off-policyness: the rollouts of step k start
once the learner has published version k - S, so at most S updates happen between a
token's sampling and its training. `S = 0` is synchronous training exactly: the rollouts
of step k start after the update of step k-1, with the same prompts, seeds and weights.

The stage objects must allow one rollout while another thread trains. With the Ray
backend or inference servers the engines are separate processes with their own copy of the
weights. In one process the native engine keeps a copy of its own (`own_weights`, built so
when S >= 1): the trainer's thread takes it right after an update (the rollout port's
`stage`, while the tensors hold still) and the producer installs it between two steps'
rollouts (`activate`).
The evaluator then has an engine of its own too, reading the trainer's tensors on the
trainer's thread. The HF engine reads the model in place, so it runs only `S = 0`
(build.check_run_config says so).

With `S >= 1` the driver calls the publication's phases (pipeline/ports.py) itself: the
learner's step ends once the trainer has published and the rollout side staged it
(`Stages.publish(v, activate=False)`), and the producer activates the latest staged version
(a server loading the weights folder, Ray workers taking the reference, the engine
installing its copy) just before it starts the next step's rollouts, while the learner
trains on (`Stages.activate`). The rollouts start with the weights
they started with before, and never see new weights arrive in the middle of a step.
"""

from __future__ import annotations

import json
import threading
import time

from rollwise.pipeline.loop import Collected, collect, learn, staleness_histogram, take_kept
from rollwise.pipeline.stages import Stages
from rollwise.run.rundir import Run, StepTimer
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
    with `functools.partial(AsyncSteps, max_staleness=S, stale_policy=...)`).

    A checkpoint of step k holds the batches already collected for the steps after k, as
    they are (`checkpoint_state`); resumed from it, the learner trains those first, and
    the producer goes on after the last of them."""

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
        self._ready: dict[int, Collected] = dict(enumerate(take_kept(stages), start))
        # the version a snapshot records, and the stages' state once the batch last
        # trained was collected (what a snapshot holds while no later batch is ready)
        self._trained, self._after = start, json.loads(json.dumps(stages.stage_state()))
        self._error: BaseException | None = None
        self._stop = False
        # S = 0 stays synchronous training exactly: the rollout side activates at once
        self._handover = max_staleness > 0
        run.hold_stage_state(self.checkpoint_state)
        self._thread = threading.Thread(target=self._produce, args=(start + len(self._ready),),
                                        daemon=True, name="rollwise-producer")
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
                applied = self.stages.activate()  # the latest version the learner staged
                timer = StepTimer()
                batch = collect(self.stages, timer)
                bounded = self._bound(batch, step, timer)
                batch.phases = dict(timer.phases)
                # the stages' state once this step's rollouts are taken (and any regenerated):
                # a checkpoint that keeps this batch (the last one ready) holds it
                batch.state = json.loads(json.dumps(self.stages.stage_state()))
                batch.control = dict(batch.control, rollout_started_version=version,
                                     weights_handoff_seconds=applied, **bounded)
                with self._cv:
                    self._ready[step] = batch
                    self._cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _bound(self, batch: Collected, step: int, timer: StepTimer) -> dict[str, int]:
        """The staleness bound, applied on this thread: step k trains at version k whenever
        it trains, so the bound is known here. What 'regenerate' asks for is rolled out and
        seen by the controller before the stages' state is taken (a checkpoint then holds
        it), and never beside this thread's own rollouts. Its figures for the record."""
        before = staleness_histogram(batch.kept, step)  # what was rolled out, bound aside
        with timer("rollout"):
            removed = bound_staleness(self.stages, batch, step, self.max_staleness,
                                      self.stale_policy)
        return {f"rolled_{k}": v for k, v in before.items()} | {"stale_groups": removed}

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
        self._trained, self._after = step + 1, batch.state
        batch.state = None  # the snapshot's state is checkpoint_state's, at that instant
        record = learn(self.stages, self.run, step, self.num_steps, batch, timer,
                       {"queue_depth": depth}, activate=not self._handover)
        with self._cv:
            self._version = step + 1
            self._cv.notify_all()
        return record

    def checkpoint_state(self) -> dict:
        """The stages' state a snapshot of the last trained step holds: the batches already
        collected for the later steps (`ahead`, `Collected.to_plain`, in step order) and the
        stages' state as of the last of them (sampler cursor, controller, rollout pools),
        else as of the batch last trained. A collection in progress is not kept: a resumed
        run asks for its groups again from that state (the same group numbers and seeds)."""
        with self._cv:
            ready = [self._ready[s] for s in sorted(self._ready)]
        state = dict(ready[-1].state if ready else self._after, version=self._trained)
        if ready:
            state["ahead"] = [b.to_plain() for b in ready]
        return state

    def close(self) -> None:
        self.run.hold_stage_state(None)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=600)
        self.stages.activate()  # the last publication reaches the rollout side
