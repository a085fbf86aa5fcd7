"""The rollout scheduler's figures of one round, as a record that adds.

A step may run several rounds (the allocator's extra rounds); their figures add like
`RewardStats` (`sum(rounds, RolloutFigures())`), so the step's record, benchmarks and tests
read one shape. Ratios are kept as their numerator and denominator and derived on read,
so adding rounds weights them correctly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollwise.types import Group


@dataclass
class RolloutFigures:
    makespan_s: float = 0.0  # wall time of the round's decoding
    tail_time_s: float = 0.0  # makespan minus the time 90% of the samples had finished
    generated_tokens: int = 0  # tokens the engine sampled (drafts accepted included)
    forward_passes: int = 0
    row_forwards: int = 0  # forward passes x rows in them
    trained_tokens: int = 0  # response tokens of the returned groups
    offpolicy_tokens: int = 0  # of those, sampled by an older policy version
    staleness_sum: int = 0  # over returned samples: versions behind the current one (oldest)
    staleness_count: int = 0  # returned samples with at least one token
    staleness_max: int = 0
    spec_verifies: int = 0  # draft verification passes per row
    spec_accepted: int = 0  # draft tokens accepted
    stale_dropped: int = 0  # pooled samples started over (older than max_staleness)
    stale_dropped_tokens: int = 0
    pool_groups: int = 0  # groups left in the partial pool after the (latest) round
    tree_groups: int = 0  # groups grown as trees (tree.mode; rollout/trees.py)
    tree_forks: int = 0  # branches they started from another
    tree_prunes: int = 0  # LATR branches pruned at a lookahead point
    lengths: list[int] = field(default_factory=list)  # [S] response lengths returned

    def __add__(self, other: RolloutFigures) -> RolloutFigures:
        """Counts add, the maximum is the larger, the pool is the later round's."""
        def total(name: str):
            return getattr(self, name) + getattr(other, name)

        summed = {n: total(n) for n in self.__dataclass_fields__
                  if n not in ("staleness_max", "pool_groups")}
        return RolloutFigures(**summed, staleness_max=max(self.staleness_max,
                                                          other.staleness_max),
                              pool_groups=other.pool_groups)

    @classmethod
    def of_returned(cls, groups: list[Group], version: int, makespan: float,
                    done_times: list[float], **counts) -> RolloutFigures:
        """The figures of the groups a round returned, trained at policy `version`: their
        tokens, staleness and lengths, and the tail (the makespan minus the time 90% of
        the samples had finished, `done_times` in seconds from the round's start);
        `counts`: the generator's own (generated tokens, forward passes, ...)."""
        trajs = [t for g in groups for t in g.trajectories]
        ages = [t.age(version) for t in trajs if t.versions]
        times = sorted(done_times)
        p90 = times[min(len(times) - 1, int(0.9 * len(times)))] if times else makespan
        return cls(makespan_s=makespan, tail_time_s=makespan - p90,
                   trained_tokens=sum(len(t.response_ids) for t in trajs),
                   offpolicy_tokens=sum(v < version for t in trajs for v in t.versions),
                   staleness_sum=sum(ages), staleness_count=len(ages),
                   staleness_max=max(ages or [0]),
                   lengths=[len(t.response_ids) for t in trajs], **counts)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / max(self.makespan_s, 1e-9)

    @property
    def offpolicy_token_frac(self) -> float:
        return self.offpolicy_tokens / max(self.trained_tokens, 1)

    @property
    def staleness_mean(self) -> float:
        return self.staleness_sum / max(self.staleness_count, 1)

    def metrics(self) -> dict[str, float]:
        """The step record's rollout figures (docs/metrics.md)."""
        out = {
            "rollout_makespan_s": self.makespan_s, "rollout_tail_s": self.tail_time_s,
            "rollout_forward_passes": self.forward_passes,
            "rollout_generated_tokens": self.generated_tokens,
            "offpolicy_token_frac": self.offpolicy_token_frac,
            "staleness_mean": self.staleness_mean, "staleness_max": self.staleness_max,
            "stale_dropped": self.stale_dropped, "pool_groups": self.pool_groups,
        }
        if self.spec_verifies:
            out["spec_accepted_len"] = 1.0 + self.spec_accepted / self.spec_verifies
        if self.tree_groups:
            out.update(tree_groups=self.tree_groups, tree_forks=self.tree_forks,
                       tree_prunes=self.tree_prunes)
        return out
