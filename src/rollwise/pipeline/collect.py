"""One step's rollouts, collected: what the drivers' `learn` trains on.

    select -> roll out -> score -> (the allocator asks for another round? again) -> allocate
    -> (rolling out ahead) the staleness bound: groups too old dropped, or rolled out again

`collect` does all of it and returns a finished, frozen `Collected`; nothing changes it
afterwards. The staleness bound is a pure function of the groups, the version the step
trains at and the bound (`split_stale`); regenerating what it removed goes through the
controller (`Stages.regenerate`), which asks for the prompts again and sees their scores.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rollwise.pipeline.stages import Stages
from rollwise.rewards import RewardStats
from rollwise.run.rundir import StepTimer
from rollwise.types import Group, Sample

STALE_POLICIES = ("drop", "regenerate")


@dataclass(frozen=True)
class Staleness:
    """The asynchronous driver's bound on off-policyness (AReaL's): step k trains at
    version k, and a group with a token sampled more than `max_staleness` versions before
    is dropped (`policy` 'drop') or its prompt rolled out again ('regenerate')."""

    max_staleness: int
    policy: str = "drop"

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.policy not in STALE_POLICIES:
            raise ValueError(f"stale_policy must be one of {', '.join(STALE_POLICIES)}, "
                             f"got '{self.policy}'")


@dataclass(frozen=True)
class Collected:
    """One step's rollouts, scored, allocated and bounded: what `learn` trains on."""

    groups: list[Group]  # every group of the step, merged per prompt (and any regenerated)
    kept: list[Group]  # those the step trains on
    reward_stats: RewardStats
    control: dict[str, float]  # the allocator's, the rollout port's and the driver's figures
    requested: int  # trajectories the allocator asked for (every round, regenerated too)
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase
    stale_dropped: int = 0  # trajectories of `groups` over the staleness bound

    def to_plain(self) -> dict[str, Any]:
        """The batch as plain data, for a checkpoint (batches collected ahead): groups as
        `Group.to_plain` writes them (samples by id), a kept group that is one of `groups`
        by its index there."""
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
                   data["requested"], dict(data["phases"]), data["stale_dropped"])

    def flow(self) -> dict[str, int]:
        """Where the requested trajectories went: requested = trained + filtered (by the
        allocator) + stale-dropped (by the staleness bound)."""
        every = sum(len(g.trajectories) for g in self.groups)
        trained = sum(len(g.trajectories) for g in self.kept)
        return {"traj_requested": self.requested, "traj_trained": trained,
                "traj_filtered": every - trained - self.stale_dropped,
                "traj_stale_dropped": self.stale_dropped}


def collect(stages: Stages, timer: StepTimer, *, bound: Staleness | None = None,
            trains_at: int = 0, figures: Mapping[str, float] | None = None) -> Collected:
    """Select, roll out, score and allocate one step's groups (the allocator may ask for
    more rounds; DAPO's dynamic sampling is the 'dynamic' allocator); with `bound`, the
    staleness bound at version `trains_at`, its figures for the record. `figures`: the
    driver's own, added to the record's control figures."""
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
    control = stages.control_metrics() | dict(figures or {})
    stale_dropped = 0
    if bound is not None:
        rolled = staleness_histogram(kept, trains_at)  # what was rolled out, bound aside
        kept, stale = split_stale(kept, trains_at, bound.max_staleness)
        control |= {f"rolled_{k}": v for k, v in rolled.items()} | {"stale_groups": len(stale)}
        stale_dropped = sum(len(g.trajectories) for g in stale)
        if stale and bound.policy == "regenerate":
            with timer("rollout"):
                again, stats, asked = stages.regenerate(stale)
            groups, kept = groups + again, kept + again
            reward_stats, requested = reward_stats + stats, requested + asked
    return Collected(groups, kept, reward_stats, control, requested, dict(timer.phases),
                     stale_dropped)


def staleness(group: Group, version: int) -> int:
    """Versions between the group's oldest token and `version` (0 when it has no tokens)."""
    return max((t.age(version) for t in group.trajectories), default=0)


def split_stale(groups: list[Group], version: int,
                max_staleness: int) -> tuple[list[Group], list[Group]]:
    """(the groups within `max_staleness` versions of `version`, those beyond), in order."""
    fresh = [g for g in groups if staleness(g, version) <= max_staleness]
    return fresh, [g for g in groups if staleness(g, version) > max_staleness]


def staleness_histogram(groups: list[Group], version: int) -> dict[str, int]:
    """Trajectories by how many versions their oldest token lags `version`: 0, 1, 2, 3+."""
    ages = Counter(min(t.age(version), 3) for g in groups for t in g.trajectories)
    return {f"staleness_hist_{k if k < 3 else '3plus'}": ages.get(k, 0) for k in range(4)}
