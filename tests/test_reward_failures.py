"""Rewards that fail never stop training: a verifier that raises, hangs or returns NaN scores
0, is counted in the step line, metrics and summary (and the report's headline); a code task
trains end to end through the sandbox with its isolation recorded."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import rollwise
from rollwise.replay import TrajectoryStore
from rollwise.types import Sample

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"
SMALL = ["run.num_steps=2", "run.threads=1", "rollout.prompts_per_step=2", "task.num_eval=4",
         "eval.every=0", "eval.before=false", "rollout.group_size=4", "rollout.max_tokens=8"]


def raises(completion: str, sample: Sample) -> float:
    raise RuntimeError("verifier bug")


def nan(completion: str, sample: Sample) -> float:
    return math.nan


def hangs(completion: str, sample: Sample) -> float:
    time.sleep(30)
    return 1.0


def test_raising_nan_and_hanging_rewards_score_zero_and_are_counted(tmp_path) -> None:
    lines: list[str] = []
    summary = rollwise.train(
        CONFIG, rewards=[raises, nan, hangs], echo=lines.append,
        overrides=[f"run.output_dir='{tmp_path}'", "task.reward_timeout_s=0.5", *SMALL])
    assert summary["steps"] == 2  # training went on
    records = [json.loads(x) for x in (tmp_path / "tiny_arith" / "metrics.jsonl")
               .read_text().splitlines() if '"train"' in x]
    per_step = 2 * 4  # prompts x group size
    for r in records:
        assert r["reward_errors"] == 2 * per_step  # raises + nan, every rollout
        assert r["reward_timeouts"] == per_step  # every call of the hanging verifier
    assert summary["reward_errors"] == 2 * 2 * per_step
    assert summary["reward_timeouts"] == 2 * per_step
    step_lines = [x for x in lines if x.startswith("step ")]
    assert len(step_lines) == 2
    assert all(f"reward failures: {2 * per_step} raised/NaN, {per_step} timed out" in x
               for x in step_lines)
    store = TrajectoryStore(tmp_path / "tiny_arith" / "trajectories.sqlite")
    for t in store.load_step(1):
        assert t.scores["raises"] == 0.0 and t.scores["nan"] == 0.0
        assert any("returned non-finite nan" in e.message for e in t.reward_errors)
        assert any("RuntimeError: verifier bug" in e.message for e in t.reward_errors)
    report = (tmp_path / "tiny_arith" / "report.html").read_text()
    assert "reward calls failed" in report


def test_code_task_trains_through_the_sandbox(tmp_path) -> None:
    summary = rollwise.train(CONFIG, echo=None, overrides=[
        f"run.output_dir='{tmp_path}'", "task.name='pycode'", "task.options={}",
        "task.num_train=8", *SMALL, "rollout.max_tokens=24", "model.tiny.sft_steps=0"])
    assert summary["steps"] == 2
    box = summary["sandbox"]
    assert box["isolation"] in ("bwrap", "unshare", "rlimits")
    assert box["security_boundary"] == (box["isolation"] != "rlimits")
    store = TrajectoryStore(tmp_path / "tiny_arith" / "trajectories.sqlite")
    trajs = store.load_step(1)
    # the random (not warm-started) tiny model writes no function: each rollout scores 0
    # with the reason noted
    assert all(t.scores["correct"] == 0.0 for t in trajs)
    assert all(any(e.kind == "note" and "sandbox load_error" in e.message
                   for e in t.reward_errors) for t in trajs)
    assert summary["reward_errors"] == 0 and summary["reward_infra"] == 0
