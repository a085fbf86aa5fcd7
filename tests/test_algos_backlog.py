"""PVPO, ACE, XRPO's sharpening and uniqueness-aware reweighting (algos/reweighting.py) on
small batches whose advantages are worked out by hand in the comments, and the inputs they
take as prepare_batch fills them."""

from __future__ import annotations

import math

import torch

from rollwise.algos import AdvantageInputs, advantage_estimators, call_estimator
from rollwise.learner.prepare import prepare_batch
from rollwise.types import Group, Sample, Trajectory

TOL = {"rtol": 0, "atol": 2e-5}

# One group of four, rewards 1 0 0 1: mean 0.5, deviations ±0.5, unbiased variance
# 4 × 0.25 / 3 = 1/3, std 0.577350, so GRPO gives ±0.5 / 0.577350 = ±0.866025.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
GROUP = torch.tensor([0, 0, 0, 0])
A = 0.866025
# Behaviour log-probs, T = 3; row 1 has two response tokens, row 3 one.
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float64)
LOGPROBS = torch.tensor([[-2.0, -2.0, -2.0], [-0.5, -0.5, 0.0],
                         [-1.0, -0.5, -1.5], [-0.5, 0.0, 0.0]], dtype=torch.float64)
# mean log-prob per row l = [-2, -0.5, -1, -0.5]; group mean -4/4 = -1


def test_pvpo_anchor_replaces_the_group_mean() -> None:
    pvpo = advantage_estimators["pvpo"]
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    g = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    # group 0 anchored at 0.25: r - 0.25; group 1 has no anchor (NaN): r - mean = 0;
    # group 2 is all correct, anchored at 0.5: +0.5 each (GRPO would give 0)
    ref = torch.tensor([0.25] * 4 + [math.nan] * 2 + [0.5] * 2, dtype=torch.float64)
    torch.testing.assert_close(pvpo(r, g, ref_values=ref), torch.tensor(
        [0.75, -0.25, 0.75, 0.75, 0.0, 0.0, 0.5, 0.5], dtype=torch.float64), **TOL)
    # no anchor at all: Dr. GRPO, group 0 mean 0.75 -> 0.25, -0.75, 0.25, 0.25
    torch.testing.assert_close(pvpo(r[:4], g[:4]), torch.tensor(
        [0.25, -0.75, 0.25, 0.25], dtype=torch.float64), **TOL)


def test_ace_amplifies_confident_errors_only() -> None:
    ace = advantage_estimators["ace"]
    # c = l - (-1) = [-1, 0.5, 0, 0.5]; errors are rows 1 and 2 (A = -0.866025)
    # row 1: softplus(0.5) = ln(1 + e^0.5) = ln 2.648721 = 0.974077
    #        -0.866025 × (1 + 0.974077) = -1.709601
    # row 2: softplus(0) = ln 2 = 0.693147;  -0.866025 × 1.693147 = -1.466308
    # rows 0 and 3 are correct: unchanged +0.866025
    got = ace(REWARDS, GROUP, logprobs=LOGPROBS, mask=MASK)
    torch.testing.assert_close(got, torch.tensor([A, -1.709601, -1.466308, A],
                                                 dtype=torch.float64), **TOL)
    # alpha = 0 is GRPO
    torch.testing.assert_close(ace(REWARDS, GROUP, logprobs=LOGPROBS, mask=MASK, alpha=0.0),
                               advantage_estimators["grpo"](REWARDS, GROUP))


def test_xrpo_sharpens_unlikely_correct_rollouts() -> None:
    xrpo = advantage_estimators["xrpo"]
    # correct rows 0 (l = -2) and 3 (l = -0.5); group mean l = -1
    # row 0: bonus max(0, -1 - (-2)) = 1 -> 0.866025 + 1 = 1.866025
    # row 3: bonus max(0, -1 - (-0.5)) = 0 -> 0.866025; errors unchanged
    got = xrpo(REWARDS, GROUP, logprobs=LOGPROBS, mask=MASK)
    torch.testing.assert_close(got, torch.tensor([1.866025, -A, -A, A], dtype=torch.float64),
                               **TOL)
    # an all-correct group (GRPO: 0, 0) with l = [-1, -3], mean -2, lam 0.5:
    # row 1 gets 0.5 × (-2 - (-3)) = 0.5, row 0 nothing
    both = xrpo(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), lam=0.5,
                logprobs=torch.tensor([[-1.0], [-3.0]]), mask=torch.ones(2, 1))
    torch.testing.assert_close(both, torch.tensor([0.0, 0.5]), **TOL)


def _uniqueness_batch(second: list[int]):
    """Rows: prompt [1, 2] then a 4-token response; rewards 1 1 1 0."""
    responses = [[5, 6, 7, 8], second, [9, 10, 11, 12], [5, 6, 7, 8]]
    ids = torch.tensor([[1, 2, *r] for r in responses])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]] * 4)
    return torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([0, 0, 0, 0]), ids, mask


def test_uniqueness_moves_positive_mass_to_rare_solutions() -> None:
    unique = advantage_estimators["uniqueness"]
    # GRPO of 1 1 1 0: mean 0.75, squares 3 × 0.0625 + 0.5625 = 0.75, variance 0.25,
    # std 0.5 -> A = [0.5, 0.5, 0.5, -1.5]
    r, g, ids, mask = _uniqueness_batch([5, 6, 7, 8])
    # rows 0 and 1 are the same solution (cluster of 2), row 2 alone; alpha 1:
    # |C|^-1 = [1/2, 1/2, 1], mean 2/3 -> w = [0.75, 0.75, 1.5]
    # A' = [0.375, 0.375, 0.75, -1.5]: the positive mass 1.5 is kept
    got = unique(r, g, input_ids=ids, mask=mask)
    torch.testing.assert_close(got, torch.tensor([0.375, 0.375, 0.75, -1.5]), **TOL)
    # row 1 = 5 6 7 9: its 3-grams {567, 679} share one of three with row 0's {567, 678},
    # Jaccard 1/3: apart at similarity 0.5 (all clusters of 1: GRPO), together at 0.3
    r, g, ids, mask = _uniqueness_batch([5, 6, 7, 9])
    torch.testing.assert_close(unique(r, g, input_ids=ids, mask=mask),
                               torch.tensor([0.5, 0.5, 0.5, -1.5]), **TOL)
    torch.testing.assert_close(unique(r, g, input_ids=ids, mask=mask, similarity=0.3),
                               torch.tensor([0.375, 0.375, 0.75, -1.5]), **TOL)


def _traj(sample: Sample, response: list[int], logprobs: list[float], reward: float):
    return Trajectory(sample=sample, prompt_ids=[1, 2], response_ids=response,
                      logprobs=logprobs, versions=[0] * len(response), finish_reason="stop",
                      reward=reward)


def test_prepare_batch_fills_the_new_inputs() -> None:
    """prepare_batch hands `logprobs`, `input_ids` and `ref_values` (from the sample's
    meta) to the estimators that declare them; PVPO then uses the anchor."""
    anchored = Sample(id="a", prompt="x", answer="1", meta={"ref_value": 0.25})
    plain = Sample(id="b", prompt="y", answer="1")
    groups = [Group(anchored, [_traj(anchored, [5, 6], [-1.0, -2.0], 1.0),
                               _traj(anchored, [7], [-0.5], 1.0)]),
              Group(plain, [_traj(plain, [5], [-1.0], 1.0), _traj(plain, [8], [-1.0], 0.0)])]
    batch = prepare_batch(groups, advantage_estimators["pvpo"], pad_id=0)
    # anchored group, both correct: 1 - 0.25 = 0.75; plain group: mean 0.5 -> ±0.5
    torch.testing.assert_close(batch.advantages, torch.tensor([0.75, 0.75, 0.5, -0.5]))
    seen = {}

    def spy(rewards, group_ids, **inputs):
        seen.update(inputs)
        return rewards

    spy.advantage_inputs = ("logprobs", "input_ids", "ref_values")
    prepare_batch(groups, spy, pad_id=0)
    assert seen["input_ids"][0].tolist() == [1, 2, 5, 6]
    assert seen["logprobs"][0, 2:].tolist() == [-1.0, -2.0]
    assert seen["ref_values"][:2].tolist() == [0.25, 0.25]
    assert all(math.isnan(v) for v in seen["ref_values"][2:].tolist())


def test_pvpo_through_call_estimator_without_any_anchor_is_dr_grpo() -> None:
    r, g = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    adv, keep = call_estimator(advantage_estimators["pvpo"], r, g, AdvantageInputs())
    assert adv.tolist() == [0.5, -0.5] and keep is None
