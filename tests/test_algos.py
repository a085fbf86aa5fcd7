"""Algorithm mathematics (advantages, PPO loss, KL) against slow, obvious loop references."""

from __future__ import annotations

import math

import pytest
import torch

from rollwise.algos import (
    advantage_estimators,
    aggregate,
    kl_estimators,
    lookup,
    policy_losses,
    register,
)
from rollwise.algos.advantages import group_stats, grpo
from rollwise.algos.losses import ppo_clip

AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

# -- GRPO advantages -----------------------------------------------------------------------


def _grpo_reference(rewards: list[float], groups: list[int], eps: float) -> list[float]:
    """Per group: mean, unbiased std (n - 1; 0 for a single member),
    A = (r - mean) / (std + eps)."""
    out = []
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g]
        n = len(members)
        mean = sum(members) / n
        var = sum((x - mean) ** 2 for x in members) / (n - 1) if n > 1 else 0.0
        out.append((r - mean) / (math.sqrt(var) + eps))
    return out


def test_grpo_matches_loop_reference_non_contiguous_and_uneven_groups() -> None:
    gen = torch.Generator().manual_seed(0)
    # groups interleaved, of sizes 5, 3, 1, 7 and 2; ids are not 0..G-1 either
    groups = [7, 3, 7, 11, 3, 7, 42, 11, 11, 7, 3, 11, 11, 11, 7, 11, 5, 5]
    rewards = torch.rand(len(groups), generator=gen, dtype=torch.float64) * 3 - 1
    for eps in (1e-6, 0.1):
        got = grpo(rewards, torch.tensor(groups), eps=eps)
        want = torch.tensor(_grpo_reference(rewards.tolist(), groups, eps), dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert got.dtype == torch.float64
    assert advantage_estimators["grpo"] is grpo


def test_grpo_binary_rewards_known_values_float32() -> None:
    # group 0: rewards 1,0,0,0 -> mean 0.25, unbiased std = sqrt(0.75/3*... ) computed by hand
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], dtype=torch.float32)
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    std0 = math.sqrt((0.75**2 + 3 * 0.25**2) / 3)  # = 0.5
    adv = grpo(rewards, groups)
    assert adv.dtype == torch.float32
    expect = [0.75 / (std0 + 1e-6)] + [-0.25 / (std0 + 1e-6)] * 3 + [0.0, 0.0]
    torch.testing.assert_close(adv, torch.tensor(expect), rtol=1e-6, atol=1e-7)


def test_grpo_zero_variance_and_singleton_groups_are_zero() -> None:
    rewards = torch.tensor([0.3, 0.3, 0.3, 1.0, 5.0, -2.0, -2.0])
    # 0: constant, 1: singleton, 2: singleton, 3: constant
    groups = torch.tensor([0, 0, 0, 1, 2, 3, 3])
    adv = grpo(rewards, groups)
    assert torch.equal(adv, torch.zeros(7))


def test_grpo_invariant_to_reward_shift_and_scales_away() -> None:
    gen = torch.Generator().manual_seed(1)
    rewards = torch.rand(12, generator=gen, dtype=torch.float64)
    groups = torch.tensor([0, 1, 2] * 4)
    base = grpo(rewards, groups, eps=0.0)
    torch.testing.assert_close(grpo(rewards + 17.5, groups, eps=0.0), base, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(grpo(rewards * 4.0, groups, eps=0.0), base, rtol=1e-9, atol=1e-9)
    # each group's advantages have mean 0 and unbiased std 1 (eps = 0)
    for g in range(3):
        a = base[groups == g]
        assert abs(float(a.mean())) < 1e-12
        assert abs(float(a.std(unbiased=True)) - 1.0) < 1e-12


def test_group_stats_per_row_values() -> None:
    values = torch.tensor([1.0, 4.0, 2.0, 10.0, 7.0])
    groups = torch.tensor([5, 9, 5, 9, 5])  # group 5: 1,2,7; group 9: 4,10
    mean, std = group_stats(values, groups)
    torch.testing.assert_close(mean, torch.tensor([10 / 3, 7.0, 10 / 3, 7.0, 10 / 3],
                                                  dtype=torch.float64))
    s5 = math.sqrt(((1 - 10 / 3) ** 2 + (2 - 10 / 3) ** 2 + (7 - 10 / 3) ** 2) / 2)
    s9 = math.sqrt((9 + 9) / 1)
    torch.testing.assert_close(std, torch.tensor([s5, s9, s5, s9, s5], dtype=torch.float64))


# -- PPO clipped loss ------------------------------------------------------------------------


def _ppo_inputs(seed: int = 0, n: int = 6, t: int = 9):
    """float64 inputs with ratios spread over [e^-0.6, e^0.6] (clipped on both sides),
    advantages of both signs, and ragged masks (one row fully masked except one token)."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=gen, dtype=torch.float64) * 3
    logp = old + (torch.rand(n, t, generator=gen, dtype=torch.float64) * 1.2 - 0.6)
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    adv[0], adv[1] = 1.3, -0.8  # both signs for sure
    mask = torch.zeros(n, t, dtype=torch.float64)
    lengths = [9, 4, 7, 1, 6, 8][:n]
    starts = [0, 2, 1, 5, 3, 0][:n]
    for i, (s, length) in enumerate(zip(starts, lengths)):
        mask[i, s: s + length] = 1
    # every branch for sure: A > 0 with rho 1.25 (inside [0.8, 1.28] but outside a symmetric
    # 0.2 clip), 1.35 (clip binds), 0.5 (below the range, unclipped term is the minimum);
    # A < 0 with rho 0.75 (clip binds) and 1.5 (above the range, unclipped is the minimum)
    for (i, j), rho in {(0, 0): 1.25, (0, 1): 1.35, (0, 2): 0.5, (1, 2): 0.75,
                        (1, 3): 1.5}.items():
        logp[i, j] = old[i, j] + math.log(rho)
    return logp, old, adv, mask


def _ppo_reference(logp, old, adv, mask, clip_low, clip_high, mode, num_tokens=None,
                   num_seqs=None, max_tokens=None):
    """(loss, d loss / d logp) with explicit loops over rows and tokens, from the formula.

    l_t = -min(rho A, clip(rho, 1-cl, 1+ch) A); the gradient of l_t w.r.t. logp_t is
    -A rho where the unclipped term is the minimum, and 0 where the clip binds
    (A > 0 and rho > 1+ch, or A < 0 and rho < 1-cl).
    """
    n, t = logp.shape
    total_tokens = num_tokens if num_tokens is not None else sum(
        float(mask[i, j]) for i in range(n) for j in range(t))
    seqs = num_seqs if num_seqs is not None else n
    width = max_tokens if max_tokens is not None else t
    loss = 0.0
    grad = torch.zeros(n, t, dtype=torch.float64)
    for i in range(n):
        a = float(adv[i])
        length = sum(float(mask[i, j]) for j in range(t))
        for j in range(t):
            if mask[i, j] == 0:
                continue
            rho = math.exp(float(logp[i, j]) - float(old[i, j]))
            clipped_rho = min(max(rho, 1 - clip_low), 1 + clip_high)
            token_loss = -min(rho * a, clipped_rho * a)
            binds = (a > 0 and rho > 1 + clip_high) or (a < 0 and rho < 1 - clip_low)
            token_grad = 0.0 if binds else -a * rho
            if mode == "token-mean":
                weight = 1.0 / total_tokens
            elif mode == "seq-mean-token-mean":
                weight = 1.0 / (seqs * length)
            else:
                weight = 1.0 / (seqs * width)
            loss += weight * token_loss
            grad[i, j] = weight * token_grad
    return loss, grad


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_ppo_loss_value_and_gradient_match_reference(mode: str) -> None:
    logp, old, adv, mask = _ppo_inputs()
    opts = {"clip_low": 0.2, "clip_high": 0.28, "aggregation": mode}
    rho = torch.exp(logp - old)[mask.bool()]
    # the inputs exercise every branch: clipped below, above, and inside the range
    assert (rho < 0.8).any() and (rho > 1.28).any() and ((rho > 0.8) & (rho < 1.28)).any()

    x = logp.clone().requires_grad_(True)
    loss, _ = ppo_clip(x, old, adv, mask, **opts)
    (grad,) = torch.autograd.grad(loss, x)
    want_loss, want_grad = _ppo_reference(logp, old, adv, mask, 0.2, 0.28, mode)
    assert loss.dtype == torch.float64
    assert abs(float(loss.detach()) - want_loss) < 1e-12
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-13)
    # the clip actually binds somewhere (zero gradient on a response token)
    assert ((grad == 0) & mask.bool()).any()
    assert policy_losses["ppo"] is ppo_clip


def test_ppo_loss_per_token_advantages_and_explicit_max_tokens() -> None:
    logp, old, adv, mask = _ppo_inputs(seed=3)
    adv_tok = adv[:, None].expand_as(logp).clone()
    a, _ = ppo_clip(logp, old, adv, mask, aggregation="seq-mean-token-sum-norm", max_tokens=20)
    b, _ = ppo_clip(logp, old, adv_tok, mask, aggregation="seq-mean-token-sum-norm", max_tokens=20)
    want, _ = _ppo_reference(logp, old, adv, mask, 0.2, 0.2, "seq-mean-token-sum-norm",
                             max_tokens=20)
    assert abs(float(a) - want) < 1e-12 and abs(float(b) - want) < 1e-12


def test_ppo_on_policy_loss_is_minus_mean_advantage_and_grad_is_minus_advantage() -> None:
    # rho = 1 everywhere: loss = -sum_t A m / tokens, grad = -A / tokens on response tokens
    _, old, adv, mask = _ppo_inputs(seed=2)
    x = old.clone().requires_grad_(True)
    loss, metrics = ppo_clip(x, old, adv, mask)
    (grad,) = torch.autograd.grad(loss, x)
    tokens = mask.sum()
    assert abs(float(loss.detach()) - float(-(adv[:, None] * mask).sum() / tokens)) < 1e-12
    torch.testing.assert_close(grad, -adv[:, None] * mask / tokens)
    assert metrics["clip_frac"] == 0.0 and metrics["ratio_mean"] == 1.0


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_ppo_micro_batch_losses_add_up_to_full_batch(mode: str) -> None:
    logp, old, adv, mask = _ppo_inputs(seed=4)
    opts = {"clip_low": 0.2, "clip_high": 0.28, "aggregation": mode}
    full, _ = ppo_clip(logp, old, adv, mask, **opts, max_tokens=9)
    totals = {"num_tokens": float(mask.sum()), "num_seqs": logp.shape[0], "max_tokens": 9}
    for split in ([[0, 1, 2], [3, 4, 5]], [[5], [0, 3], [1, 2, 4]]):
        parts = 0.0
        for rows in split:
            idx = torch.tensor(rows)
            part, _ = ppo_clip(logp[idx], old[idx], adv[idx], mask[idx], **opts, **totals)
            parts += float(part)
        assert abs(parts - float(full)) < 1e-12, (mode, split)


def test_ppo_clip_frac_and_ratio_metrics_by_hand() -> None:
    logp, old, adv, mask = _ppo_inputs(seed=5)
    _, metrics = ppo_clip(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    outside = masked = 0
    ratios = []
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            if mask[i, j] == 0:
                continue
            masked += 1
            rho = math.exp(float(logp[i, j] - old[i, j]))
            ratios.append(rho)
            # the convention of OpenAI baselines: the ratio left the clip range
            outside += int(rho < 0.8 or rho > 1.28)
    assert 0 < outside < masked
    assert metrics["clip_frac"] == pytest.approx(outside / masked, abs=1e-12)
    assert metrics["ratio_mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-12)
    assert metrics["ratio_max"] == pytest.approx(max(ratios), rel=1e-12)


def test_aggregate_known_values_and_unknown_mode() -> None:
    per_token = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]])
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1]])
    assert float(aggregate(per_token, mask, "token-mean")) == pytest.approx((3 + 90) / 5)
    assert float(aggregate(per_token, mask, "seq-mean-token-mean")) == pytest.approx(
        (1.5 + 30.0) / 2)
    assert float(aggregate(per_token, mask, "seq-mean-token-sum-norm")) == pytest.approx(
        93 / (2 * 4))
    assert float(aggregate(per_token, mask, "seq-mean-token-sum-norm", max_tokens=10)) == \
        pytest.approx(93 / 20)
    with pytest.raises(ValueError, match="unknown aggregation 'sum'.*token-mean"):
        aggregate(per_token, mask, "sum")


# -- KL estimators -----------------------------------------------------------------------------


def test_kl_estimators_match_formulas() -> None:
    gen = torch.Generator().manual_seed(6)
    logp = -torch.rand(4, 5, generator=gen, dtype=torch.float64) * 4
    ref = -torch.rand(4, 5, generator=gen, dtype=torch.float64) * 4
    got = {name: kl_estimators[name](logp, ref) for name in ("k1", "k2", "k3")}
    for i in range(4):
        for j in range(5):
            lp, lr = float(logp[i, j]), float(ref[i, j])
            assert float(got["k1"][i, j]) == pytest.approx(lp - lr, abs=1e-14)
            assert float(got["k2"][i, j]) == pytest.approx(0.5 * (lp - lr) ** 2, abs=1e-14)
            q_over_p = math.exp(lr) / math.exp(lp)
            assert float(got["k3"][i, j]) == pytest.approx(
                q_over_p - math.log(q_over_p) - 1, rel=1e-12, abs=1e-14)
    assert (got["k3"] >= 0).all()
    assert torch.equal(kl_estimators["k3"](logp, logp), torch.zeros_like(logp))
    assert torch.equal(kl_estimators["k1"](logp, logp), torch.zeros_like(logp))


def test_k1_and_k3_expectations_equal_exact_kl() -> None:
    # E_{x~p}[k1] = E_{x~p}[k3] = KL(p || q) exactly, summing over a full categorical support
    gen = torch.Generator().manual_seed(7)
    logp = torch.log_softmax(torch.randn(30, generator=gen, dtype=torch.float64), -1)
    logq = torch.log_softmax(torch.randn(30, generator=gen, dtype=torch.float64), -1)
    p = logp.exp()
    kl = sum(float(p[x]) * (float(logp[x]) - float(logq[x])) for x in range(30))
    assert kl > 0.05
    for name in ("k1", "k3"):
        est = float((p * kl_estimators[name](logp, logq)).sum())
        assert est == pytest.approx(kl, rel=1e-10), name


# -- registries --------------------------------------------------------------------------------


def test_lookup_unknown_name_lists_registered_names() -> None:
    with pytest.raises(ValueError) as err:
        lookup(kl_estimators, "k4", "KL estimator")
    msg = str(err.value)
    assert "KL estimator" in msg and "'k4'" in msg and "k1, k2, k3" in msg
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo2' \(did you mean 'ppo'\?\)"):
        lookup(policy_losses, "ppo2", "policy loss")
    assert lookup(advantage_estimators, "grpo", "advantage estimator") is grpo


def test_register_adds_and_refuses_duplicates() -> None:
    from rollwise.registry import Registry

    registry: Registry = Registry("thing")

    @register(registry, "double")
    def double(x):
        return 2 * x

    assert registry == {"double": double} and lookup(registry, "double", "thing")(4) == 8
    with pytest.raises(ValueError, match="'double' is already registered"):
        register(registry, "double")(lambda x: x)
