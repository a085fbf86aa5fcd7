"""B3 (`rollwise bench e2e`) on a small tiny-model config: the step split adds up, the
variants differ as configured (the baseline trains every row, the best skips zero-advantage
rows), and the time-to-accuracy part counts rollouts and draws its curves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"
QUICKSTART = Path(__file__).parents[1] / "configs" / "quickstart.toml"
SMALL = ["task.num_train=48", "task.num_eval=20", "rollout.prompts_per_step=4",
         "rollout.group_size=4", "run.threads=1"]


@pytest.mark.slow  # `make test` stays within 8 minutes on 2 cores
def test_bench_e2e_command_splits_steps_and_times_accuracy(tmp_path):
    from typer.testing import CliRunner

    from rollwise.cli import app

    out = tmp_path / "b3.json"
    args = ["bench", "e2e", str(CONFIG), "--steps", "2", "--warmup", "0", "--accuracy-steps",
            "2", "--eval-every", "1", "--target", "0.0", "--json", str(out)]
    result = CliRunner().invoke(app, args + [x for s in SMALL for x in ("--set", s)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    split = data["step_split"][0]
    rows = {r["variant"]: r for r in split["variants"]}
    assert list(rows) == ["baseline", "best"]
    for name, steps in split["per_step"].items():
        assert len(steps) == 2
        for s in steps:  # the phases cover the step: rollout + reward + train + other
            parts = sum(s[f"time_{p}"] for p in ("rollout", "reward", "train", "other"))
            assert parts == pytest.approx(s["time_step"], rel=1e-9), name
            if name == "baseline":  # every row through the learner
                assert s["rows_trained"] == 16 and s["rows_skipped_zero_adv"] == 0
            else:  # zero-advantage rows skipped, none lost
                assert s["rows_trained"] + s["rows_skipped_zero_adv"] == 16
    ratios = split["ratios"]["baseline_over_best"]
    assert ratios["step"]["n"] == 2 and ratios["step"]["min"] <= ratios["step"]["median"]
    acc = {r["variant"]: r for r in data["time_to_accuracy"][0]["variants"]}
    for r in acc.values():  # 2 steps x 4 prompts x 4 rollouts; target 0 is met before training
        assert r["total_rollouts"] == 32 and r["rollouts_to_target"] == 0
        assert 0.0 <= r["final_accuracy"] <= 1.0 and r["train_seconds"] > 0
    curve = data["curves"]["tiny_arith: held-out accuracy vs rollouts"]["series"]
    assert [p[0] for p in curve["best"]] == [0, 16, 32]  # evaluations before, at 1, at 2
    assert data["machine"]["cores"] >= 1
    page = out.with_suffix(".html").read_text()
    assert "held-out accuracy vs training wall time" in page and "baseline" in page


def test_bench_e2e_rejects_unknown_options(tmp_path):
    from typer.testing import CliRunner

    from rollwise.cli import app

    bad = CliRunner().invoke(app, ["bench", "e2e", str(CONFIG), "--vs", "verl"])
    assert bad.exit_code != 0 and "only 'trl'" in bad.output
    bad = CliRunner().invoke(app, ["bench", "e2e", str(CONFIG), "--part", "speed"])
    assert bad.exit_code != 0 and "steps or accuracy" in bad.output


@pytest.mark.slow
def test_vs_trl_runs_trl_and_rollwise_alternately(tmp_path):
    """Needs TRL (optional extra) and the SmolLM2 weights: a minute or two on a CPU."""
    pytest.importorskip("trl")
    from rollwise.bench.e2e_trl import run_vs_trl

    data = run_vs_trl(QUICKSTART, {"best": ()}, steps=1, warmup=0, out=tmp_path,
                      extra=["run.threads=0"], progress=lambda s: None)
    rows = {r["variant"]: r for r in data["variants"]}
    assert list(rows) == ["trl", "best"]
    trl = data["per_step"]["trl"][0]
    assert trl["time_rollout"] > 0 and trl["time_train"] > 0 and trl["step_tokens"] > 0
    assert data["ratios"]["trl_over_best"]["step"]["n"] == 1
    assert data["trl"]["gradient_checkpointing"] is False
