"""Verifiers score what they claim; the reward pool weights, records errors and cuts off
overruns."""

from __future__ import annotations

import math
import time

import pytest

from rollwise.rewards import (
    VERIFIERS,
    RewardPool,
    RewardSpec,
    countdown_verifier,
    final_number,
    format_reward,
    get_verifier,
    math_verify_match,
)
from rollwise.rewards.countdown import check_countdown, extract_expression
from rollwise.types import RewardIssue, Sample, Trajectory


def _sample(answer: str = "68", **meta) -> Sample:
    return Sample(id="t/0", prompt="23+45=", answer=answer, meta=meta)


def _traj(text: str, answer: str = "68") -> Trajectory:
    return Trajectory(_sample(answer), [1], [2, 3], [-0.1, -0.2], [0, 0], "stop", text=text)


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("23 + 45 = 68\n#### 68", "68", 1.0),
        ("the answer is 67, no wait 68", "68", 1.0),
        ("68 is it? no, 69", "68", 0.0),
        ("68;78#78", "78", 1.0),
        ("68;78#78", "68", 0.0),
        ("23-45=-22#-22", "-22", 1.0),
        ("45-22", "-22", 0.0),  # binary minus: the last number is 22
        ("#### 1,234", "1234", 1.0),
        ("total: 68.0.", "68", 1.0),
        ("total: 68.5", "68", 0.0),
        ("no number here", "68", 0.0),
        ("", "0", 0.0),
        ("#### 12345678901234567890", "12345678901234567890", 1.0),  # exact, no float rounding
        ("#### 12345678901234567891", "12345678901234567890", 0.0),
    ],
)
def test_final_number(completion: str, answer: str, expected: float) -> None:
    assert final_number(completion, _sample(answer)) == expected


def test_final_number_rejects_sample_without_numeric_answer() -> None:
    with pytest.raises(ValueError, match="answer 'sixty' holds no number"):
        final_number("68", _sample("sixty"))


def test_math_verify_match() -> None:
    half = _sample("\\frac{1}{2}")
    assert math_verify_match("#### 0.5", half) == 1.0
    assert math_verify_match("I think it is 1/2", half) == 1.0
    assert math_verify_match("#### 0.3", half) == 0.0
    assert math_verify_match("0.5 at first, but #### 3", half) == 0.0  # only after ####
    assert math_verify_match("#### 68", _sample("68")) == 1.0
    assert math_verify_match("nothing", _sample("68")) == 0.0


def test_math_verify_works_inside_pool_threads() -> None:
    # math-verify's SIGALRM timeout fails outside the main thread; the verifier disables it.
    with RewardPool([RewardSpec("mv", math_verify_match)], timeout_s=30) as pool:
        trajs = [_traj("#### 0.5", "\\frac{1}{2}"), _traj("#### 2", "\\frac{1}{2}")]
        stats = pool.score(trajs)
    assert stats.num_errors == 0 and [t.reward for t in trajs] == [1.0, 0.0]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [("so\n#### 67", 1.0), ("68;78#78", 1.0), ("68#-3\n", 1.0), ("68", 0.0),
     ("#### ", 0.0), ("68#78 and more", 0.0), ("#### -1,234.5", 1.0)],
)
def test_format_reward(completion: str, expected: float) -> None:
    assert format_reward(completion, _sample()) == expected


def test_countdown_verifier_and_extraction() -> None:
    sample = _sample("24", numbers=[4, 6, 1, 1])
    assert countdown_verifier("#### 4 * 6", sample) == 1.0
    assert countdown_verifier("4 * 6 * 1 * 1", sample) == 1.0
    assert countdown_verifier("(4 * 6) / (1 + 1) * 2", sample) == 0.0  # 2 not given
    assert countdown_verifier("4 * 6 * 1 * 1 * 1", sample) == 0.0  # 1 used three times
    assert countdown_verifier("6 × 4 = 24", sample) == 1.0
    assert countdown_verifier("lambda: 24", sample) == 0.0
    assert countdown_verifier("[4 * 6][0]", sample) == 0.0
    assert check_countdown("6 / 4 * 16", [4, 6, 16], 24) == (True, "ok")  # exact fractions
    assert check_countdown("(4 +", [4], 4)[1].startswith("not an arithmetic expression")
    assert extract_expression("a\n#### 4*6\nextra line") == "4*6"
    assert extract_expression("24 = 4 * 6") == "4 * 6"


def test_registry() -> None:
    assert set(VERIFIERS) == {"final_number", "math_verify", "format", "countdown"}
    assert get_verifier("countdown") is countdown_verifier
    with pytest.raises(ValueError, match="did you mean 'final_number'"):
        get_verifier("final_numbr")


def test_pool_weights_sum_and_records_scores() -> None:
    specs = [RewardSpec("correct", final_number, 1.0), RewardSpec("format", format_reward, 0.25),
             RewardSpec("short", lambda text, s: len(text) < 6, -0.5)]
    trajs = [_traj("68#68"), _traj("67;68#68"), _traj("69#69"), _traj("it is 68")]
    with RewardPool(specs, num_workers=3) as pool:
        stats = pool.score(trajs)
    assert [t.reward for t in trajs] == [1.0 + 0.25 - 0.5, 1.25, 0.25 - 0.5, 1.0]
    assert trajs[2].scores == {"correct": 0.0, "format": 1.0, "short": 1.0}
    assert trajs[2].reward_errors == [] and not trajs[2].correct
    assert (stats.num_scored, stats.num_errors, stats.num_timeouts) == (4, 0, 0)
    assert all(0.0 <= t.timings["reward"] < 1.0 for t in trajs)


def test_pool_raising_and_bad_values_score_zero() -> None:
    def boom(text: str, sample: Sample) -> float:
        raise KeyError("numbers")

    specs = [RewardSpec("correct", final_number), RewardSpec("boom", boom, 5.0),
             RewardSpec("nan", lambda text, s: math.nan), RewardSpec("str", lambda text, s: "x")]
    trajs = [_traj("#### 68"), _traj("#### 1")]
    with RewardPool(specs) as pool:
        stats = pool.score(trajs)
    assert [t.reward for t in trajs] == [1.0, 0.0]
    assert stats.num_errors == 6 and stats.num_timeouts == 0
    assert {e.kind for e in trajs[0].reward_errors} == {"error"}
    errors = [e.to_text() for e in trajs[0].reward_errors]
    assert "boom: KeyError: 'numbers'" in errors
    assert "nan: returned non-finite nan" in errors
    assert any(e.startswith("str: returned str 'x'") for e in errors)
    assert trajs[0].scores["boom"] == 0.0


def test_pool_cuts_off_sleeping_and_spinning_verifiers() -> None:
    def sleepy(text: str, sample: Sample) -> float:
        time.sleep(30)
        return 1.0

    def spin(text: str, sample: Sample) -> float:
        count = 0
        while True:
            try:
                count += 1
            except Exception:  # noqa: BLE001 - a verifier that swallows errors must still stop
                count = 0

    specs = [RewardSpec("correct", final_number), RewardSpec("sleepy", sleepy, 2.0),
             RewardSpec("spin", spin, 3.0)]
    pool = RewardPool(specs, timeout_s=0.2, num_workers=2)
    trajs = [_traj("#### 68"), _traj("#### 68")]
    start = time.perf_counter()
    stats = pool.score(trajs)
    elapsed = time.perf_counter() - start
    assert elapsed < 3.0  # 4 overruns on 2 workers: ~2 x 0.2 s, never the 30 s sleep
    assert (stats.num_timeouts, stats.num_errors) == (4, 0)
    assert [t.reward for t in trajs] == [1.0, 1.0]
    assert set(trajs[0].reward_errors) == {RewardIssue("timeout", "sleepy", "timeout after 0.2s"),
                                           RewardIssue("timeout", "spin", "timeout after 0.2s")}
    assert trajs[0].timings["reward"] >= 0.4
    # The pool replaced its killed workers and still scores promptly.
    pool.specs = [RewardSpec("correct", final_number)]
    again = [_traj("#### 68") for _ in range(16)]
    assert pool.score(again).seconds < 1.0 and all(t.reward == 1.0 for t in again)
    assert all(w.proc.is_alive() for w in pool._workers) and len(pool._workers) == 2
    pool.close()
    with pytest.raises(RuntimeError, match="after close"):
        pool.score(again)


def test_pool_kills_a_verifier_stuck_in_c_holding_the_gil() -> None:
    """Regression: a catastrophic regex blocks in C with the GIL held; a thread-based pool
    could not stop it (58 s against a 1 s limit). The worker process is killed instead,
    and nothing is left running: processes started = 2 + 1 replacement, 2 alive."""
    import re

    def regex_bomb(text: str, sample: Sample) -> float:
        return float(bool(re.match(r"(a+)+$", "a" * 40 + "!")))

    pool = RewardPool([RewardSpec("correct", final_number), RewardSpec("bomb", regex_bomb)],
                      timeout_s=0.5, num_workers=2)
    trajs = [_traj("#### 68")]
    start = time.perf_counter()
    stats = pool.score(trajs)
    assert time.perf_counter() - start < 3.0
    assert stats.num_timeouts == 1 and trajs[0].scores["bomb"] == 0.0
    assert trajs[0].reward == 1.0
    assert pool.workers_started == 3
    assert sum(w.proc.is_alive() for w in pool._workers) == 2
    pool.close()


def test_pool_survives_a_verifier_that_kills_its_process() -> None:
    import os

    def exits(text: str, sample: Sample) -> float:
        os._exit(3)

    with RewardPool([RewardSpec("correct", final_number), RewardSpec("x", exits)]) as pool:
        trajs = [_traj("#### 68"), _traj("#### 67")]
        stats = pool.score(trajs)
    assert stats.num_errors == 2 and [t.reward for t in trajs] == [1.0, 0.0]
    assert trajs[0].reward_errors == [RewardIssue("error", "x", "worker process died")]


def test_pool_validates_specs() -> None:
    with pytest.raises(ValueError, match="unique names"):
        RewardPool([RewardSpec("a", final_number), RewardSpec("a", format_reward)])
    with pytest.raises(ValueError, match="errors"):
        RewardPool([RewardSpec("errors", final_number)])
    with pytest.raises(ValueError, match="timeout_s"):
        RewardPool([RewardSpec("a", final_number)], timeout_s=0)
    with RewardPool([RewardSpec("a", final_number)]) as pool:
        assert pool.score([]).num_scored == 0
