"""Crash safety, proven: a tiny run killed (SIGKILL / SIGINT) at random instants and resumed
ends exactly as an uninterrupted run (tests/crashtest.py; scripts/crash_harness.py runs
longer). The run scores with users' own code by import path too: a verifier and a group
term with an option (crashtest.USER_CODE), whose keys config.toml must read back. With
the learner sharded over two ranks (slow), one rank or the driver is killed instead
(tests/crashranks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from crashtest import USER_CODE, crash_test
from rollwise.compose.config import load_config

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"


def tiny(tmp_path: Path):
    return load_config(CONFIG, [
        f"run.output_dir='{tmp_path}'", "run.num_steps=6", "run.threads=1",
        "run.checkpoint_every=2", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "task.num_eval=8", "eval.every=3", *USER_CODE])


def _check(report, kills: int) -> None:
    assert report.kills >= kills and report.sigkills > 0 and report.sigints > 0
    assert report.rounds >= 2 and report.resumes >= report.kills // 2
    assert report.ok, "\n".join(report.failures)


def test_random_kills_and_resumes_equal_the_uninterrupted_run(tmp_path):
    """Twelve kills in the fast tier (both signals, several rounds); `-m slow` runs 300."""
    report = crash_test(tiny(tmp_path), kills=12, seed=0, workdir=tmp_path / "crash")
    _check(report, 12)


@pytest.mark.slow
def test_many_random_kills(tmp_path):
    report = crash_test(tiny(tmp_path), kills=300, seed=1, workdir=tmp_path / "crash")
    _check(report, 300)


@pytest.mark.slow
def test_random_kills_of_one_rank_or_the_driver_of_a_sharded_learner(tmp_path):
    """learner.shards = 2 (tests/crashranks.py): a rank SIGKILLed at a random instant stops
    the trainer within learner.shard_timeout_s with an error naming it, a killed driver's
    ranks exit, and every resumed run equals the uninterrupted one."""
    from crashranks import rank_test

    cfg = tiny(tmp_path)
    cfg.learner.shards, cfg.learner.shard_timeout_s = 2, 30.0
    report = rank_test(cfg, kills=12, seed=2, workdir=tmp_path / "ranks")
    assert report.ok, "\n".join(report.failures)
    assert report.total >= 12 and report.rounds >= 1 and report.resumes >= 12
    assert sum(n for (victim, _), n in report.kills.items() if victim == "rank") >= 3
    assert report.errors and max(s for s, _ in report.errors) <= 30.0
    assert report.orphans_s and max(report.orphans_s) < 30.0
