"""The synchronous GRPO driver. Each line names a stage; the stages come from `stages.py`.

    for each step:
        select prompts -> roll out groups -> score -> filter -> advantages -> update -> publish
        (the allocator sees each round's scores and may ask for another round, and picks
        the groups to train on: DAPO's dynamic sampling is the 'dynamic' allocator;
        docs/allocation.md)
    a new run with [sft] first learns its demonstrations (checkpointed as step 0);
    evaluate before and after (and every N steps); checkpoint every N steps or minutes, at
    the end, and on Ctrl-C (always the state after the last completed step).
"""

from __future__ import annotations

from collections.abc import Callable

from rollwise.pipeline.collect import Collected, collect, staleness_histogram
from rollwise.pipeline.stages import Stages
from rollwise.run.rundir import Run, StepTimer, defer_interrupt


class SyncSteps:
    """The synchronous step: collect, then learn. The asynchronous driver
    (`asyncloop.AsyncSteps`) has the same shape: built for a run from its first step,
    `step(k)` trains step k, `close()` stops whatever runs ahead. Both go through the
    stages' in-flight batches (pipeline/inflight.py): resumed from an asynchronous run's
    checkpoint, the batches it had collected ahead are trained first, as they are."""

    def __init__(self, stages: Stages, run: Run, start: int, num_steps: int):
        self.stages, self.run, self.num_steps = stages, run, num_steps
        restore(stages, start)

    def step(self, step: int) -> dict:
        timer = self.run.timer()
        if not self.stages.inflight.has(step):  # none kept: collected now, nothing ahead
            self.stages.inflight.put(step, collect(self.stages, timer))
        batch, _ = self.stages.inflight.take(step)
        return learn(self.stages, self.run, step, self.num_steps, batch, timer)

    def close(self) -> None:
        self.stages.inflight.close()


def train(stages: Stages, run: Run, num_steps: int, *, eval_every: int = 0,
          eval_before: bool = True, checkpoint_every: int = 0,
          checkpoint_seconds: float = 0.0, steps: Callable[..., SyncSteps] = SyncSteps) -> dict:
    """Train to `num_steps`, resuming where `run` stopped. Checkpoints every
    `checkpoint_every` steps or `checkpoint_seconds`, whichever comes first, and always
    after the final evaluation; each is of the last completed step (see rundir.py).
    `steps`: how a step runs (`SyncSteps`, or the asynchronous driver's)."""
    try:
        start = run.resume(stages)  # 0 for a new run, else the step of the last checkpoint
        if start == 0 and stages.sft is not None and "sft" not in run.summary:
            warm_start(stages, run)
        with run.progress(start, num_steps):
            if start == 0 and eval_before:
                evaluate(stages, run, 0, before=True)
            elif eval_every and start % eval_every == 0 and 0 < start < num_steps:
                evaluate(stages, run, start)  # interrupted during this evaluation
            stepper = steps(stages, run, start, num_steps)
            try:
                for step in range(start, num_steps):
                    stepper.step(step)
                    run.raise_if_unhealthy(stages)
                    if eval_every and (step + 1) % eval_every == 0 and step + 1 < num_steps:
                        evaluate(stages, run, step + 1)
                    if step + 1 < num_steps:  # the last one comes after the final evaluation
                        run.maybe_checkpoint(step + 1, stages, checkpoint_every,
                                             checkpoint_seconds)
            finally:
                stepper.close()
            evaluate(stages, run, num_steps, after=True)
            run.checkpoint(num_steps, stages)
    except KeyboardInterrupt:
        run.interrupted(stages)
        raise
    except BaseException:
        run.close()
        raise
    return run.finish()


def warm_start(stages: Stages, run: Run) -> None:
    """The supervised warm start ([sft]) of a new run, checkpointed as step 0 once done;
    interrupted, nothing of it is kept."""
    figures = None
    try:
        figures = stages.warm_start(run.record_sft)
    finally:
        run.warm_started(stages, figures)


def evaluate(stages: Stages, run: Run, step: int, before: bool = False,
             after: bool = False) -> None:
    """Evaluate at `step` unless the run already holds that evaluation (a resumed run)."""
    if run.has_eval(step):
        return
    result = stages.evaluate()
    with defer_interrupt():  # the record and the snapshot that follows it go together
        run.record_eval(step, result, before=before, after=after)
        run.snapshot(stages)


def learn(stages: Stages, run: Run, step: int, num_steps: int, batch: Collected,
          timer: StepTimer, extra: dict | None = None, activate: bool = True) -> dict:
    """Advantages, update and publication of one step's groups; its metrics record.
    `extra`: figures a driver adds to the record (the asynchronous driver's); `activate`:
    False when the driver activates the publication itself, at a later step boundary."""
    with defer_interrupt():  # Ctrl-C waits until the update is recorded
        with timer("train"):
            update = stages.update(stages.advantages(batch.kept)) if batch.kept else {}
        published = stages.publish(step + 1, activate)  # its figures (publish_seconds)
        record = run.record_step(step + 1, num_steps, batch.groups, batch.kept,
                                 batch.reward_stats, update | published, timer,
                                 control=batch.control | batch.flow()
                                 | staleness_histogram(batch.kept, step) | (extra or {}))
        run.snapshot(stages)
        return record


def train_step(stages: Stages, run: Run, step: int, num_steps: int) -> dict:
    """One training step (`step` counts from 0); its metrics record. Benchmarks drive it."""
    timer = run.timer()
    return learn(stages, run, step, num_steps, collect(stages, timer), timer)


def restore(stages: Stages, start: int) -> int:
    """The batches a resumed checkpoint kept, for the steps from `start` on, made ready
    in the stages' in-flight batches (from plain data: the task's prompts by id); how many."""
    samples = stages.samples_by_id()
    return stages.inflight.restore(start, lambda data: Collected.from_plain(data, samples),
                                   stages.own_state())
