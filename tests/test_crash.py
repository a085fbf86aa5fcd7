"""Crash safety, proven: a tiny run killed (SIGKILL / SIGINT) at random instants and resumed
ends exactly as an uninterrupted run (tests/crashtest.py; scripts/crash_harness.py runs
longer). The run scores with users' own code by import path too: a verifier and a group
term with an option (crashtest.USER_CODE), whose keys config.toml must read back."""

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
