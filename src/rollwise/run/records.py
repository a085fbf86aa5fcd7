"""The records a run directory holds, computed apart from the directory:

- the figures of one training step (`step_record`): pure functions from groups, reward
  counts, the update's figures and the phase times to the metrics record (docs/metrics.md);
  `rundir.Run` adds the health check's verdict and writes what they return;
- `Snapshot`: the run's state after a step, as a checkpoint's state.json holds it.

Imports `types`, `rewards` (`RewardStats`) and `observe` (length summary) only.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rollwise.observe import summarize_lengths
from rollwise.rewards import RewardStats
from rollwise.types import CORRECT, Group, Trajectory


@dataclass(frozen=True)
class StepTimes:
    """Where one step's wall time went: seconds per named phase, the step's total, and the
    peak resident set (MiB) per phase."""

    phases: dict[str, float]
    seconds: float
    peaks: dict[str, float] = field(default_factory=dict)


# The run's running totals (summary.json; a checkpoint's counters)
COUNTERS = {"train_seconds": 0.0, "rollouts": 0, "tokens": 0, "reward_errors": 0,
            "reward_timeouts": 0, "reward_infra": 0}


@dataclass(frozen=True)
class Snapshot:
    """Everything that changes between steps and is not the weights or the optimizer, as
    of the end of step `step` (rundir's module docstring says why). `stages` is the stages'
    own state (`Stages.stage_state`), kept as an opaque JSON object; `rng` (written to
    rng.json beside state.json) and `id` (which snapshot this is, in this process) are not
    part of the JSON form."""

    step: int
    counters: dict[str, Any]
    summary: dict[str, Any]
    stages: dict[str, Any]
    health: dict[str, Any] = field(default_factory=dict)
    rng: dict[str, Any] | None = None
    id: int = 0

    def to_json(self) -> dict[str, Any]:
        """The checkpoint's state.json object."""
        return {"step": self.step, "counters": self.counters, "summary": self.summary,
                "stages": self.stages, "health": self.health}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Snapshot:
        """The snapshot a state.json object holds (KeyError when it lacks one); older
        files without a health state or with fewer counters read with their defaults."""
        return cls(step=data["step"], counters=COUNTERS | data["counters"],
                   summary=data["summary"], stages=data["stages"],
                   health=data.get("health", {}))


def capacity(record: dict, phases: dict[str, float], seconds: float,
             trained: int) -> dict[str, float]:
    """ECHO-2's capacity view of one step (docs/metrics.md): how busy the learner and the
    rollout were, trajectories supplied per second of rollout against those the learner
    consumes per second of training, how long new weights took to reach the engines, the
    batches waiting (asynchronous driver) and the staleness histogram (0 when absent)."""
    wall = max(seconds, 1e-9)
    rollout, train = phases.get("rollout", 0.0), phases.get("train", 0.0)
    return {
        "learner_busy_time_frac": train / wall, "rollout_busy_time_frac": rollout / wall,
        "rollout_supply_per_s": record["step_rollouts"] / max(rollout, 1e-9) if rollout else 0.0,
        "rollout_demand_per_s": trained / max(train, 1e-9) if train else 0.0,
        "weights_dissemination_seconds": record.get("publish_seconds", 0.0)
        + record.get("weights_load_seconds", 0.0),
        "queue_depth": record.get("queue_depth", 0),
    }


def reward_terms(trajs: list[Trajectory]) -> dict[str, Any]:
    """Each reward term apart (docs/metrics.md): `reward_terms` {term: mean score over the
    trajectories it scored, before its weight}, `reward_term_errors` {term: calls that
    failed: raised, returned a non-number, timed out, or whose infrastructure failed; a
    verifier's notes are not failures}, and `accuracy`, the share whose `correct` term
    scored 1, only when the rewards have that term (else no accuracy is recorded)."""
    scores: dict[str, list[float]] = {}
    for t in trajs:
        for name, value in t.scores.items():
            scores.setdefault(name, []).append(value)
    errors = dict.fromkeys(scores, 0)
    for t in trajs:
        for issue in t.reward_errors:
            if issue.term in t.scores and issue.failed:
                errors[issue.term] += 1
    out: dict[str, Any] = {}
    if CORRECT in scores:
        out["accuracy"] = statistics.fmean(t.correct for t in trajs if CORRECT in t.scores)
    return out | {"reward_terms": {n: statistics.fmean(v) for n, v in scores.items()},
                  "reward_term_errors": errors}


def counted(counters: Mapping[str, Any], groups: list[Group], rewards: RewardStats,
            seconds: float) -> dict[str, Any]:
    """The run's running totals after a step of `seconds` that rolled out `groups`
    (`counters`: the totals before it)."""
    trajs = [t for g in groups for t in g.trajectories]
    c = dict(counters)
    c["train_seconds"] += seconds
    c["rollouts"] += len(trajs)
    c["tokens"] += sum(t.num_tokens for t in trajs)
    c["reward_errors"] += rewards.num_errors
    c["reward_timeouts"] += rewards.num_timeouts
    c["reward_infra"] += rewards.num_infra
    return c


def step_record(step: int, num_steps: int, groups: list[Group], kept: list[Group],
                rewards: RewardStats, update: Mapping[str, Any], times: StepTimes,
                counters: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> dict:
    """One metrics line (kind "train"): `groups` are all groups rolled out this step, `kept`
    those trained on, `update` the learner's figures, `counters` the run's totals after
    this step (`counted`), `extra` the allocator's and the driver's figures and the
    device's memory, merged last."""
    trajs = [t for g in groups for t in g.trajectories]
    lengths = [t.num_tokens for t in trajs]
    phases = times.phases
    trained = [t for g in kept for t in g.trajectories]
    record = {
        "kind": "train", "step": step, "num_steps": num_steps,
        "wall_time": counters["train_seconds"],
        "reward_mean": statistics.fmean(t.reward for t in trajs),
        **reward_terms(trajs),
        **{f"response_len_{k}": v for k, v in summarize_lengths(lengths).items()},
        "truncated_frac": statistics.fmean(t.finish_reason == "length" for t in trajs),
        "zero_var_frac": statistics.fmean(g.zero_variance for g in groups),
        "groups": len(groups), "groups_kept": len(kept),
        "rollouts": counters["rollouts"], "tokens": counters["tokens"],
        "step_rollouts": len(trajs), "step_tokens": sum(lengths),
        "rollout_tokens_per_s": sum(lengths) / max(phases.get("rollout", 0.0), 1e-9),
        "train_tokens_per_s": sum(len(t.prompt_ids) + t.num_tokens for t in trained)
        / max(phases.get("train", 1e-9), 1e-9),
        **{f"time_{k}": v for k, v in phases.items()},
        "time_other": max(times.seconds - sum(phases.values()), 0.0),
        "reward_errors": rewards.num_errors, "reward_timeouts": rewards.num_timeouts,
        "reward_infra": rewards.num_infra,
        **update, **(extra or {}),
        **{f"peak_rss_{k}_mb": v for k, v in times.peaks.items()},
    }
    return record | capacity(record, phases, times.seconds, len(trained))
