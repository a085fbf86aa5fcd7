"""Evaluation as the field reports it: pass@1 (greedy), mean@k and unbiased pass@k, per task
when eval.tasks adds tasks, each scored by its own verifier."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from rollwise.compose.config import load_config
from rollwise.observe.metrics import task_table
from rollwise.pipeline.build import build
from rollwise.pipeline.evaluate import pass_at_k

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"


@pytest.mark.parametrize("n, c, k", [(5, 2, 2), (6, 0, 3), (6, 6, 1), (8, 3, 4), (4, 1, 4)])
def test_pass_at_k_is_the_subset_probability(n, c, k) -> None:
    """The estimator equals the share of k-subsets of the n samples holding a correct one."""
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(outcomes, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_eval_tasks_are_scored_by_their_own_verifiers_and_reported_apart(tmp_path) -> None:
    cfg = load_config(CONFIG, [
        "run.threads=1", "task.num_eval=6", "eval.pass_k=2", "eval.pass_samples=4",
        "rollout.max_tokens=12",
        ("eval.tasks=[{name = 'countdown', num_eval = 5, label = 'cd'}, "
        "{name = 'arith', num_eval = 3, label = 'arith3', options = {terms = 3}}]")])
    stages = build(cfg)
    result = stages.evaluate()
    rows = {row["task"]: row for row in task_table(result)}
    assert set(rows) == {"arith", "cd", "arith3"}
    assert [rows[t]["n"] for t in ("arith", "cd", "arith3")] == [6.0, 5.0, 3.0]
    assert result["num_prompts"] == 14.0
    # the overall figures are the per-task ones weighted by their sizes
    total = sum(row["n"] * row["pass@1"] for row in rows.values())
    assert result["accuracy"] == pytest.approx(total / 14)
    for row in rows.values():
        # binary rewards: mean@n is the sampled pass@1 estimate, never above pass@k (k >= 1)
        assert 0.0 <= row["mean@4"] <= row["pass@2"] + 1e-12 <= 1.0 + 1e-12
    # each sample goes to its own task's verifier (countdown's checks the expression)
    from rollwise.rewards import countdown_verifier

    verify = stages.evaluator.rollouts.pool.specs[0].fn
    by_task = {}
    for sample, _ in stages.evaluator.prompts:
        by_task.setdefault(sample.meta["eval_task"], sample)
    cd, ar = by_task["cd"], by_task["arith"]
    assert verify(cd.reference, cd) == countdown_verifier(cd.reference, cd) == 1.0
    assert verify(ar.reference, ar) == 1.0 and verify("0#0", ar) == 0.0


def test_bad_eval_tasks_are_clear(tmp_path) -> None:
    cfg = load_config(CONFIG, ["eval.tasks=[{num_eval = 2}]"])
    with pytest.raises(ValueError, match=r"eval.tasks\[0\]: expected a table with name"):
        build(cfg)
    cfg = load_config(CONFIG, ["eval.tasks=[{name = 'arith'}]"])
    with pytest.raises(ValueError, match="label 'arith' is taken"):
        build(cfg)
