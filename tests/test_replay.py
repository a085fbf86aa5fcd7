"""Trajectory store: exact round-trips, resume semantics, per-prompt history."""

from __future__ import annotations

import math
import random
import sqlite3
import struct

import pytest

from rollwise.replay import TrajectoryStore
from rollwise.types import Group, RewardIssue, Sample, Trajectory


def _bits(xs: list[float]) -> bytes:
    return struct.pack(f"<{len(xs)}d", *xs)


def make_groups(step: int, n_groups: int = 2, group_size: int = 3, seed: int = 0) -> list[Group]:
    """Groups with awkward floats (subnormals, -inf, long mantissas) and nested info."""
    rng = random.Random(seed + 1000 * step)
    groups = []
    for g in range(n_groups):
        sample = Sample(
            id=f"arith/train/{g}",
            prompt=[{"role": "user", "content": f"What is {g} + 2? ünïcode"}],
            answer=str(g + 2),
            reference=None if g else "It is 2.",
            meta={"terms": 2, "tags": ["easy"]},
        )
        trajs = []
        for t in range(group_size):
            n = rng.randint(1, 12)
            logprobs = [math.log(rng.random()) for _ in range(n)]
            logprobs[0] = [5e-324, -math.inf, -0.1 - 1e-17][t % 3]
            trajs.append(
                Trajectory(
                    sample=sample,
                    prompt_ids=[rng.randrange(50_000) for _ in range(5)],
                    response_ids=[rng.randrange(50_000) for _ in range(n)],
                    logprobs=logprobs,
                    versions=[step - (i % 2) for i in range(n)],
                    finish_reason=["stop", "length", "abort"][t % 3],
                    text=f"answer {t}",
                    reward=rng.random(),
                    scores={"exact": float(t % 2)},
                    reward_errors=([RewardIssue("error", "format", f"bad {t}")]
                                   if t % 3 == 0 else []),
                    timings={"rollout": rng.random(), "reward": 0.001},
                )
            )
        groups.append(Group(sample=sample, trajectories=trajs))
    return groups


def test_round_trip_is_exact(tmp_path):
    store = TrajectoryStore(tmp_path / "t.sqlite")
    groups = make_groups(step=1)
    store.add_groups(1, groups)
    loaded = store.load_step(1)
    original = [t for g in groups for t in g.trajectories]
    assert loaded == original  # dataclass equality: ids, versions, reward, info, sample
    for a, b in zip(loaded, original):
        assert _bits(a.logprobs) == _bits(b.logprobs)
        assert struct.pack("<d", a.reward) == struct.pack("<d", b.reward)
    assert loaded[0].sample.prompt[0]["content"].endswith("ünïcode")
    assert [len(g.trajectories) for g in store.load_groups(1)] == [3, 3]
    assert store.load_groups(1)[1].sample == groups[1].sample
    store.close()


def test_counts_steps_lengths_and_history(tmp_path):
    store = TrajectoryStore(tmp_path / "t.sqlite")
    per_step = {s: make_groups(step=s) for s in (1, 2, 3)}
    for s, groups in per_step.items():
        store.add_groups(s, groups)
    assert store.count() == 18
    assert store.steps() == [1, 2, 3]
    expected = [t.num_tokens for g in per_step[2] for t in g.trajectories]
    assert store.response_lengths(2) == expected
    assert len(store.response_lengths()) == 18
    history = store.prompt_history("arith/train/1")
    want = [(s, t.reward) for s in (1, 2, 3) for t in per_step[s][1].trajectories]
    assert history == want
    assert store.prompt_history("nope") == []
    store.close()


def test_delete_after_removes_exactly_later_steps(tmp_path):
    store = TrajectoryStore(tmp_path / "t.sqlite")
    for s in range(1, 6):
        store.add_groups(s, make_groups(step=s, n_groups=1, group_size=2))
    assert store.delete_after(3) == 4
    assert store.steps() == [1, 2, 3]
    assert store.count() == 6
    assert store.delete_after(3) == 0
    assert store.load_step(4) == []
    store.close()


def test_reopen_keeps_data_and_uses_wal(tmp_path):
    path = tmp_path / "run" / "t.sqlite"
    store = TrajectoryStore(path)
    store.add_groups(1, make_groups(step=1))
    store.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store = TrajectoryStore(path)  # resume
    assert store.count() == 6
    store.add_groups(2, make_groups(step=2))
    assert store.steps() == [1, 2]
    assert store.load_step(1) == [t for g in make_groups(step=1) for t in g.trajectories]
    store.close()


def test_same_step_appends_groups(tmp_path):
    store = TrajectoryStore(tmp_path / "t.sqlite")
    a, b = make_groups(step=1, seed=1), make_groups(step=1, seed=2)
    store.add_groups(1, a)
    store.add_groups(1, b)
    assert len(store.load_groups(1)) == 4
    assert store.load_step(1) == [t for g in a + b for t in g.trajectories]
    store.close()


def test_nan_reward_and_mismatched_lengths(tmp_path):
    store = TrajectoryStore(tmp_path / "t.sqlite")
    groups = make_groups(step=1, n_groups=1, group_size=1)
    groups[0].trajectories[0].reward = float("nan")
    store.add_groups(1, groups)
    assert math.isnan(store.load_step(1)[0].reward)
    assert math.isnan(store.prompt_history("arith/train/0")[0][1])
    bad = make_groups(step=2, n_groups=1, group_size=1)
    bad[0].trajectories[0].logprobs.append(-1.0)
    with pytest.raises(ValueError, match="same length"):
        store.add_groups(2, bad)
    assert store.steps() == [1]  # nothing of the failed call was written
    store.close()


def test_stored_reward_info_splits_into_scores_and_errors():
    """The store keeps one JSON object per row ({term: score, ..., "errors": [...]}); rows
    written before scores and errors were separate fields read back the same way."""
    scores, errors = Trajectory.split_reward_info({"correct": 1.0, "errors": ["x: boom"]})
    assert scores == {"correct": 1.0} and errors == [RewardIssue("error", "x", "boom")]
    assert Trajectory.split_reward_info({"correct": 0.0}) == ({"correct": 0.0}, [])
    t = Trajectory(sample=Sample("a", "1+1=", "2"), prompt_ids=[1], response_ids=[2],
                   logprobs=[0.0], versions=[0], finish_reason="stop", scores=scores,
                   reward_errors=errors)
    assert t.correct and t.reward_info == {"correct": 1.0, "errors": ["x: boom"]}


def test_advantages_are_kept_and_a_version_1_store_gains_the_column(tmp_path):
    """The advantage each trajectory was trained with round-trips (None: not trained); a
    store written before advantages were kept opens, reads them as None, and takes new
    ones; the report's completions view shows them."""
    from rollwise.observe.completions import completions_section

    path = tmp_path / "t.sqlite"
    store = TrajectoryStore(path)
    store.add_groups(1, make_groups(step=1))
    store.close()
    with sqlite3.connect(path) as conn:  # as version 1 wrote it
        conn.execute("ALTER TABLE trajectories DROP COLUMN advantage")
        conn.execute("PRAGMA user_version=1")
    conn.close()
    assert "advantage" in completions_section(path)  # read-only, the column absent
    store = TrajectoryStore(path)
    assert all(t.advantage is None for t in store.load_step(1))
    groups = make_groups(step=2)
    for i, t in enumerate(groups[0].trajectories):
        t.advantage = 0.25 * i - 1.0 / 3
    store.add_groups(2, groups)
    assert [t.advantage for t in store.load_step(2)] == [
        t.advantage for g in groups for t in g.trajectories]
    store.close()
    assert "-0.333" in completions_section(path) and "not trained" in completions_section(path)
