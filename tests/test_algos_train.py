"""End-to-end: every advantage estimator and every policy loss, and the options around them,
train the tiny model for two steps through the real driver, chosen by config name only."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rollwise.algos import advantage_estimators, policy_losses
from rollwise.compose.config import load_config
from rollwise.pipeline.build import build
from rollwise.pipeline.loop import train
from rollwise.run.rundir import Run

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"
LOSSES = sorted(policy_losses)


def _run(tmp_path: Path, name: str, *extra: str) -> tuple[list[dict], dict, dict]:
    cfg = load_config(CONFIG, [f"run.output_dir='{tmp_path}'", f"run.name='{name}'",
                               "run.num_steps=2", "rollout.prompts_per_step=3",
                               "rollout.group_size=4", "task.num_eval=4", "eval.every=0",
                               "learner.lr=1e-3", *extra])
    stages = build(cfg)
    before = {n: p.detach().clone() for n, p in stages.model.named_parameters()}
    train(stages, Run(tmp_path / name, resume=False, echo=lambda s: None), 2, eval_before=False)
    after = dict(stages.model.named_parameters())
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    return records, before, after


def _moved(before: dict, after: dict) -> int:
    return sum(not torch.equal(before[n], after[n].detach()) for n in before)


@pytest.mark.parametrize("estimator", sorted(advantage_estimators))
def test_every_estimator_and_loss_trains_by_name(tmp_path, estimator):
    loss = LOSSES[sorted(advantage_estimators).index(estimator) % len(LOSSES)]
    extra = {"mc_grpo": ["rollout.group_size=5"],  # G + 1 for the median pivot
             "pass_at_k": ["algorithm.advantage_options={ k = 2 }"],  # k = G: all A = 0
             }.get(estimator, [])
    records, before, after = _run(tmp_path, estimator, f"algorithm.advantage='{estimator}'",
                                  f"algorithm.loss='{loss}'", *extra)
    assert len(records) == 2
    for r in records:
        assert r["skipped_nonfinite"] == 0.0 and math.isfinite(r["loss"])
    assert _moved(before, after) > 0, f"{estimator} + {loss}: no parameter moved"


def test_dapo_refill_truncation_overlong_kl_in_reward_entropy_and_tis(tmp_path):
    records, before, after = _run(
        tmp_path, "options", "control.allocator='dynamic'",
        "control.allocator_options={max_rounds=4}", "algorithm.mask_truncated=true",
        "algorithm.overlong_buffer=4", "algorithm.kl_coef=0.05", "algorithm.kl_in_reward=true",
        "algorithm.entropy_coef=0.01", "algorithm.correction='tis'", "algorithm.dual_clip=3.0",
        "algorithm.clip_high=0.28", "rollout.max_tokens=10")
    assert _moved(before, after) > 0
    for r in records:
        # dynamic sampling: more prompts were drawn while fewer than 3 groups had reward
        # variance (at most 4 rounds); those with variance are trained on, at most 3
        informative = r["groups"] - round(r["zero_var_frac"] * r["groups"])
        assert 3 <= r["groups"] <= 12 and r["groups_kept"] == min(3, informative)
        # on-policy float32: the engine's log-probs equal the learner's, TIS weights are 1
        assert r["correction_weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert r["correction_ess"] == pytest.approx(1.0, abs=1e-4)
        assert r["entropy"] > 0 and "kl" not in r  # the KL went into the reward, not the loss


def test_test_time_rl_with_dare_needs_no_labels(tmp_path):
    records, before, after = _run(
        tmp_path, "ttrl", "task.rewards={ dare = 1.0, correct = 0.0 }",
        "task.reward_options={ dare = { alpha = 0.5, tau = 0.05 } }")
    assert _moved(before, after) > 0
    for r in records:  # DARE rewards lie in [0, 1 + alpha]; correct (weight 0) is only logged
        assert 0.0 <= r["reward_mean"] <= 1.5 and 0.0 <= r["accuracy"] <= 1.0


def test_unknown_names_are_config_errors_listing_the_registry(tmp_path):
    with pytest.raises(ValueError, match="unknown advantage estimator 'grop'.*grpo"):
        build(load_config(CONFIG, [f"run.output_dir='{tmp_path}'", "algorithm.advantage='grop'"]))
