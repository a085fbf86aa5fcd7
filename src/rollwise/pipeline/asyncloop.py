"""The asynchronous driver: the rollouts of the next steps are generated while a step trains.

Built from the synchronous driver's two halves (`collect.collect`, `loop.learn`), nothing
else:

    producer thread                        the caller's thread (trains)
    for step k:                            for step k:
      wait until version >= k - S            take step k's batch (wait while none is ready)
      activate the latest staged version     learn(k)   (advantages, update, publish and
      collect(k)   (select, roll out,                    stage k+1)
                    score, allocate, drop
                    or roll out again the groups
                    whose oldest token is more
                    than S versions behind k:
                    step k trains at version k)
      queue it (Stages.inflight)

`S = schedule.max_staleness` is AReaL's bound on off-policyness: the rollouts of step k start
once the learner has published version k - S, so at most S updates happen between a
token's sampling and its training. `S = 0` is synchronous training exactly: the rollouts
of step k start after the update of step k-1, with the same prompts, seeds and weights.

The stage objects must allow one rollout while another thread trains. With the Ray
backend or inference servers the engines are separate processes with their own copy of the
weights. In one process the native engine keeps a copy of its own (`own_weights`, built so
when S >= 1): the trainer's thread takes it right after an update (the rollout port's
`stage`, while the tensors hold still) and the producer installs it between two steps'
rollouts (`activate`). The evaluator then has an engine of its own too, reading the
trainer's tensors on the trainer's thread. The HF engine reads the model in place, so it
runs only `S = 0` (compose/preflight.py says so).

With `S >= 1` the driver calls the publication's phases (pipeline/ports.py) itself: the
learner's step ends once the trainer has published and the rollout side staged it
(`Stages.publish(v, activate=False)`), and the producer activates the latest staged version
(a server loading the weights folder, Ray workers taking the reference, the engine
installing its copy) just before it starts the next step's rollouts, while the learner
trains on (`Stages.activate`). The rollouts start with the weights they started with
before, and never see new weights arrive in the middle of a step.
"""

from __future__ import annotations

import threading
import time

from rollwise.pipeline.collect import Staleness, collect
from rollwise.pipeline.loop import learn, restore
from rollwise.pipeline.stages import Stages
from rollwise.run.rundir import Run, StepTimer


class AsyncSteps:
    """The asynchronous step, in the shape of `loop.SyncSteps` (pass it to `loop.train`
    with `functools.partial(AsyncSteps, max_staleness=S, stale_policy=...)`, both from
    the run's config: `build.run_steps`).

    The batches collected ahead live in `stages.inflight`, which a checkpoint of step k
    keeps (those collected for the steps after k, as they are); resumed from it, the
    learner trains those first, and the producer goes on after the last of them."""

    def __init__(self, stages: Stages, run: Run, start: int, num_steps: int, *,
                 max_staleness: int, stale_policy: str):
        self.bound = Staleness(max_staleness, stale_policy)
        self.stages, self.run, self.num_steps = stages, run, num_steps
        self._cv = threading.Condition()
        self._version = start  # the policy version the learner has published
        self._stop = False
        ready = restore(stages, start)
        self._thread = threading.Thread(target=self._produce, args=(start + ready,),
                                        daemon=True, name="rollwise-producer")
        self._thread.start()

    # -- the producer thread ---------------------------------------------------------------
    def _produce(self, start: int) -> None:
        try:
            for step in range(start, self.num_steps):
                with self._cv:
                    while not self._stop and self._version < step - self.bound.max_staleness:
                        self._cv.wait()
                    if self._stop:
                        return
                    version = self._version
                activated = self.stages.activate()  # the latest version the learner staged
                # the staleness bound is applied here: step k trains at version k whenever it
                # trains, and what 'regenerate' rolls out never runs beside these rollouts
                batch = collect(self.stages, StepTimer(), bound=self.bound, trains_at=step,
                                figures={"rollout_started_version": version,
                                         "weights_handoff_seconds": activated})
                # with the stages' state once its rollouts are taken (and any regenerated)
                self.stages.inflight.put(step, batch, self.stages.own_state())
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            self.stages.inflight.fail(e)

    # -- the training thread ---------------------------------------------------------------
    def step(self, step: int) -> dict:
        timer = self.run.timer()
        waited = time.perf_counter()
        batch, depth = self.stages.inflight.take(step)  # depth: later batches waiting
        timer.phases["wait"] = time.perf_counter() - waited
        for name, seconds in batch.phases.items():  # overlapped with earlier steps
            timer.phases[name] = timer.phases.get(name, 0.0) + seconds
        # S = 0 stays synchronous training exactly: the rollout side activates at once
        record = learn(self.stages, self.run, step, self.num_steps, batch, timer,
                       {"queue_depth": depth}, activate=self.bound.max_staleness == 0)
        with self._cv:
            self._version = step + 1
            self._cv.notify_all()
        return record

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=600)
        try:
            self.stages.activate()  # the last publication reaches the rollout side
        finally:
            self.stages.inflight.close()
