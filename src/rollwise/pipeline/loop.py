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

import json
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rollwise.pipeline.stages import Stages
from rollwise.rewards import RewardStats
from rollwise.run.rundir import Run, StepTimer, defer_interrupt
from rollwise.types import Group, Sample


class SyncSteps:
    """The synchronous step: roll out, then train (`train_step`). The asynchronous driver
    (`asyncloop.AsyncSteps`) has the same shape: built for a run from its first step,
    `step(k)` trains step k, `close()` stops whatever runs ahead.

    Resumed from an asynchronous run's checkpoint, the batches it had collected ahead are
    trained first, as they are, and later checkpoints keep those not yet trained."""

    def __init__(self, stages: Stages, run: Run, start: int, num_steps: int):
        self.stages, self.run, self.num_steps = stages, run, num_steps
        self.kept = take_kept(stages)
        if self.kept:
            run.hold_stage_state(self._state)

    def _state(self) -> dict:
        """Nothing is rolled out while kept batches remain: the stages' state is as of the
        last one's collection, and the rest are kept again."""
        return self.stages.stage_state() | {"ahead": [b.to_plain() for b in self.kept]}

    def step(self, step: int) -> dict:
        if not self.kept:
            return train_step(self.stages, self.run, step, self.num_steps)
        batch = self.kept.pop(0)
        batch.state = None  # the snapshot's state is `_state`'s
        record = learn(self.stages, self.run, step, self.num_steps, batch, self.run.timer())
        if not self.kept:
            self.run.hold_stage_state(None)
        return record

    def close(self) -> None:
        self.run.hold_stage_state(None)


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


@dataclass
class Collected:
    """One step's rollouts, scored and allocated: what `learn` trains on."""

    groups: list[Group]  # every group of the step, merged per prompt
    kept: list[Group]  # those the allocator trains on
    reward_stats: RewardStats
    control: dict[str, float]  # the allocator's and the rollout scheduler's figures
    requested: int  # trajectories the allocator asked for (every round)
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase
    state: dict | None = None  # async: the stages' state once this batch was collected
    stale_dropped: int = 0  # trajectories of `groups` over the staleness bound (async)

    def to_plain(self) -> dict[str, Any]:
        """The batch as plain data, for a checkpoint (the asynchronous driver's batches
        collected ahead): groups as `Group.to_plain` writes them (samples by id), a kept
        group that is one of `groups` by its index there. `state` is not part of it."""
        where = {id(g): i for i, g in enumerate(self.groups)}
        return {"groups": [g.to_plain() for g in self.groups],
                "kept": [where[id(g)] if id(g) in where else g.to_plain()
                         for g in self.kept],
                "reward_stats": asdict(self.reward_stats), "control": dict(self.control),
                "requested": self.requested, "phases": dict(self.phases),
                "stale_dropped": self.stale_dropped}

    @classmethod
    def from_plain(cls, data: Mapping[str, Any], samples: Mapping[str, Sample]) -> Collected:
        """The batch `to_plain` wrote (a kept group by index is that very group object,
        as it was); `samples`: the task's prompts by id."""
        groups = [Group.from_plain(g, samples) for g in data["groups"]]
        kept = [groups[k] if isinstance(k, int) else Group.from_plain(k, samples)
                for k in data["kept"]]
        return cls(groups, kept, RewardStats(**data["reward_stats"]), dict(data["control"]),
                   data["requested"], dict(data["phases"]),
                   stale_dropped=data["stale_dropped"])

    def flow(self) -> dict[str, int]:
        """Where the requested trajectories went: requested = trained + filtered (by the
        allocator) + stale-dropped (by the asynchronous driver's staleness bound)."""
        every = sum(len(g.trajectories) for g in self.groups)
        trained = sum(len(g.trajectories) for g in self.kept)
        return {"traj_requested": self.requested, "traj_trained": trained,
                "traj_filtered": every - trained - self.stale_dropped,
                "traj_stale_dropped": self.stale_dropped}


def staleness_histogram(groups: list[Group], version: int) -> dict[str, int]:
    """Trajectories by how many versions their oldest token lags `version`: 0, 1, 2, 3+."""
    ages = Counter(min(t.age(version), 3) for g in groups for t in g.trajectories)
    return {f"staleness_hist_{k if k < 3 else '3plus'}": ages.get(k, 0) for k in range(4)}


def collect(stages: Stages, timer: StepTimer) -> Collected:
    """Select, roll out, score and allocate one step's groups (the allocator may ask for
    more rounds; DAPO's dynamic sampling is the 'dynamic' allocator)."""
    requests = stages.select()
    requested = sum(r.n for r in requests)
    with timer("rollout"):
        groups = stages.rollout(requests)
    with timer("reward"):
        reward_stats = stages.score(groups)
    while requests := stages.observe(groups):  # the allocator may ask for more
        requested += sum(r.n for r in requests)
        with timer("rollout"):
            groups = stages.rollout(requests)
        with timer("reward"):
            reward_stats = reward_stats + stages.score(groups)
    groups, kept = stages.allocation()  # all groups of the step; those to train on
    return Collected(groups, kept, reward_stats, stages.control_metrics(), requested)


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
        run.snapshot(stages, batch.state)
        return record


def train_step(stages: Stages, run: Run, step: int, num_steps: int) -> dict:
    """One training step (`step` counts from 0); its metrics record. Benchmarks drive it."""
    timer = run.timer()
    return learn(stages, run, step, num_steps, collect(stages, timer), timer)


def take_kept(stages: Stages) -> list[Collected]:
    """The batches the resumed checkpoint kept (collected for the steps after its own, in
    step order), taken from `stages`, which hold them from `load_state_dict` until now;
    the last one carries the stages' state, which is as of its collection."""
    plain, stages.ahead = stages.ahead, []
    if not plain:
        return []
    samples = stages.samples_by_id()
    kept = [Collected.from_plain(b, samples) for b in plain]
    kept[-1].state = json.loads(json.dumps(stages.stage_state()))
    return kept
