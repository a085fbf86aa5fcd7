"""The run directory's records apart from the directory: a step's metrics record from
hand-built groups (run/records.py), the snapshot's JSON form (old state.json files
included), and the stored form of reward issues."""

from __future__ import annotations

import json

import pytest

from rollwise.rewards import RewardStats
from rollwise.run.records import COUNTERS, Snapshot, StepTimes, counted, step_record
from rollwise.types import Group, RewardIssue, Sample, Trajectory


def _traj(reward: float, tokens: int, finish: str = "stop", correct: float = 0.0,
          issues: tuple[RewardIssue, ...] = ()) -> Trajectory:
    return Trajectory(Sample("a/0", "1+1=", "2"), [1, 2], list(range(tokens)), [0.0] * tokens,
                      [0] * tokens, finish, reward=reward, scores={"correct": correct},
                      reward_errors=list(issues))


def test_step_record_from_hand_built_groups() -> None:
    taught = Group(Sample("a/0", "1+1=", "2"), [
        _traj(1.0, 4, correct=1.0),
        _traj(0.0, 6, "length", issues=(RewardIssue("timeout", "correct", "timeout after 5s"),))])
    flat = Group(Sample("a/1", "2+2=", "4"), [
        _traj(0.5, 3, issues=(RewardIssue("note", "correct", "slow"),)), _traj(0.5, 3)])
    rewards = RewardStats(num_scored=4, num_errors=0, num_timeouts=1, seconds=0.1)
    times = StepTimes({"rollout": 2.0, "train": 1.0}, 4.0, {"train": 100.0})
    counters = counted(COUNTERS | {"rollouts": 8, "tokens": 30, "train_seconds": 6.0},
                       [taught, flat], rewards, times.seconds)
    assert counters == {"train_seconds": 10.0, "rollouts": 12, "tokens": 46, "reward_errors": 0,
                        "reward_timeouts": 1, "reward_infra": 0}
    record = step_record(3, 10, [taught, flat], [taught], rewards, {"loss": 0.25}, times,
                         counters, {"zero_adv_frac": 0.5, "publish_seconds": 0.5})
    assert record == {
        "kind": "train", "step": 3, "num_steps": 10, "wall_time": 10.0,
        "reward_mean": 0.5, "accuracy": 0.25, "reward_terms": {"correct": 0.25},
        "reward_term_errors": {"correct": 1},  # the timeout; a note is no failure
        "response_len_p50": 3.5, "response_len_p90": pytest.approx(5.4),
        "response_len_max": 6, "response_len_mean": 4.0,
        "truncated_frac": 0.25, "zero_var_frac": 0.5, "groups": 2, "groups_kept": 1,
        "rollouts": 12, "tokens": 46, "step_rollouts": 4, "step_tokens": 16,
        "rollout_tokens_per_s": 8.0, "train_tokens_per_s": 14.0,  # (2 + 4) + (2 + 6) in 1 s
        "time_rollout": 2.0, "time_train": 1.0, "time_other": 1.0,
        "reward_errors": 0, "reward_timeouts": 1, "reward_infra": 0,
        "loss": 0.25, "zero_adv_frac": 0.5, "publish_seconds": 0.5, "peak_rss_train_mb": 100.0,
        "learner_busy_time_frac": 0.25, "rollout_busy_time_frac": 0.5,
        "rollout_supply_per_s": 2.0, "rollout_demand_per_s": 2.0,
        "weights_dissemination_seconds": 0.5, "queue_depth": 0,
    }


def test_snapshot_json_round_trip_and_an_old_state_file() -> None:
    snap = Snapshot(step=4, counters=dict(COUNTERS, rollouts=32), summary={"eval_before": {}},
                    stages={"cursor": 7, "pool": [[1, 2]]}, health={"bad": 1},
                    rng={"python": 1}, id=9)
    data = json.loads(json.dumps(snap.to_json()))
    assert list(data) == ["step", "counters", "summary", "stages", "health"]  # state.json
    back = Snapshot.from_json(data)
    assert (back.step, back.counters, back.summary, back.stages, back.health) == \
        (4, snap.counters, snap.summary, snap.stages, snap.health)
    # a state.json written before the health state and the infrastructure counter
    old = {"step": 2, "summary": {}, "stages": {"cursor": 3},
           "counters": {"train_seconds": 1.0, "rollouts": 8, "tokens": 80, "reward_errors": 1,
                        "reward_timeouts": 0}}
    read = Snapshot.from_json(old)
    assert read.health == {} and read.counters["reward_infra"] == 0
    assert read.counters["reward_errors"] == 1 and read.stages == {"cursor": 3}
    with pytest.raises(KeyError):
        Snapshot.from_json({"step": 2})


@pytest.mark.parametrize("issue, text", [
    (RewardIssue("error", "boom", "KeyError: 'numbers'"), "boom: KeyError: 'numbers'"),
    (RewardIssue("timeout", "m.r:f", "timeout after 0.2s"), "m.r:f: timeout after 0.2s"),
    (RewardIssue("infra", "correct", "sandbox: could not start"),
     "correct: infra: sandbox: could not start"),
    (RewardIssue("note", "correct", "2 of 5 tests passed"), "correct: note: 2 of 5 tests passed"),
])
def test_reward_issues_store_as_the_text_runs_always_wrote(issue, text) -> None:
    assert issue.to_text() == text and RewardIssue.from_text(text) == issue
    assert issue.failed == (issue.kind != "note")
