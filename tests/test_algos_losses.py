"""GSPO, CISPO, PPO dual clip and token weights, and the TIS/MIS corrections, against slow
references written from the formulas (value and gradient with respect to the log-probs)."""

from __future__ import annotations

import math

import pytest
import torch

from rollwise.algos import corrections, policy_losses

AGGREGATIONS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
TOL = {"rtol": 1e-5, "atol": 1e-7}


def _inputs(seed: int = 0, n: int = 6, t: int = 8, spread: float = 0.6):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=gen, dtype=torch.float64) * 3
    logp = old + (torch.rand(n, t, generator=gen, dtype=torch.float64) * 2 - 1) * spread
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    adv[0], adv[1] = 1.1, -0.9
    mask = torch.zeros(n, t, dtype=torch.float64)
    for i, (s, length) in enumerate(zip([0, 2, 1, 5, 3, 0], [8, 4, 7, 1, 5, 3])):
        mask[i, s: s + length] = 1
    weights = torch.rand(n, t, generator=gen, dtype=torch.float64) * 2
    return logp, old, adv, mask, weights


def _weight(mode: str, mask, i: int, num_seqs: int, width: int) -> float:
    if mode == "token-mean":
        return 1.0 / float(mask.sum())
    if mode == "seq-mean-token-mean":
        return 1.0 / (num_seqs * float(mask[i].sum()))
    return 1.0 / (num_seqs * width)


def _ref_loss(token_fn, logp, mask, mode, weights=None):
    """sum over response tokens of agg_weight * w_t * token_fn(i, j, logp_ij) as a torch scalar."""
    n, t = logp.shape
    total = torch.zeros((), dtype=torch.float64)
    for i in range(n):
        for j in range(t):
            if mask[i, j] == 0:
                continue
            w = 1.0 if weights is None else float(weights[i, j])
            total = total + _weight(mode, mask, i, n, t) * w * token_fn(i, j, logp[i, j])
    return total


def _compare(fn, ref, logp) -> torch.Tensor:
    x, y = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    loss, metrics = fn(x)
    want = ref(y)
    assert abs(float(loss.detach()) - float(want.detach())) < 1e-9
    (g1,) = torch.autograd.grad(loss, x)
    (g2,) = torch.autograd.grad(want, y)
    torch.testing.assert_close(g1, g2, **TOL)
    return metrics


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_ppo_dual_clip_and_weights_match_reference(mode: str) -> None:
    logp, old, adv, mask, weights = _inputs(seed=1, spread=1.5)  # ratios up to e^1.5 > 3
    c = 2.0

    def token(i, j, lp):
        rho = torch.exp(lp - old[i, j])
        a = float(adv[i])
        o = torch.minimum(rho * a, rho.clamp(0.8, 1.28) * a)
        if a < 0:
            o = torch.maximum(o, torch.tensor(c * a, dtype=torch.float64))
        return -o

    metrics = _compare(lambda x: policy_losses["ppo"](
        x, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=c, aggregation=mode,
        weights=weights), lambda y: _ref_loss(token, y, mask, mode, weights), logp)
    assert metrics["dual_clip_frac"] > 0  # the dual clip binds somewhere
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_losses["ppo"](logp, old, adv, mask, dual_clip=0.5)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_gspo_token_form_matches_reference(mode: str) -> None:
    logp, old, adv, mask, weights = _inputs(seed=2, spread=0.05)
    logp[0] += 0.05  # row 0 (A > 0) above the clip range, row 1 (A < 0) below it
    logp[1] -= 0.05
    cl, ch = 0.01, 0.02

    def seq_ratio(i, lp_row):  # exp(mean log ratio over the row's response tokens)
        toks = [lp_row[j] - old[i, j] for j in range(lp_row.shape[0]) if mask[i, j] == 1]
        return torch.exp(sum(toks) / len(toks))

    def token(i, j, lp):
        # GSPO-token: value s_i, gradient s_i d logp_t (the other tokens' dependence detached)
        s = seq_ratio(i, logp[i]).detach() * torch.exp(lp - lp.detach())
        a = float(adv[i])
        return -torch.minimum(s * a, s.clamp(1 - cl, 1 + ch) * a)

    metrics = _compare(lambda x: policy_losses["gspo"](
        x, old, adv, mask, clip_low=cl, clip_high=ch, aggregation=mode, weights=weights),
        lambda y: _ref_loss(token, y, mask, mode, weights), logp)
    assert 0 < metrics["clip_frac"] < 1


def test_gspo_with_seq_mean_equals_the_sequence_objective_value_and_gradient() -> None:
    logp, old, adv, mask, _ = _inputs(seed=3, spread=0.05)
    cl, ch = 0.01, 0.02

    def sequence_objective(y):  # 1/G sum_i -min(s_i A_i, clip(s_i) A_i), s_i a full function
        total = torch.zeros((), dtype=torch.float64)
        for i in range(y.shape[0]):
            toks = [y[i, j] - old[i, j] for j in range(y.shape[1]) if mask[i, j] == 1]
            s = torch.exp(sum(toks) / len(toks))
            a = float(adv[i])
            total = total - torch.minimum(s * a, s.clamp(1 - cl, 1 + ch) * a)
        return total / y.shape[0]

    _compare(lambda x: policy_losses["gspo"](x, old, adv, mask, clip_low=cl, clip_high=ch,
                                             aggregation="seq-mean-token-mean"),
             sequence_objective, logp)


def test_gspo_equals_ppo_for_length_one_responses() -> None:
    logp, old, adv, _, _ = _inputs(seed=4)
    mask = torch.zeros_like(logp)
    mask[:, 3] = 1
    a, _ = policy_losses["gspo"](logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    b, _ = policy_losses["ppo"](logp, old, adv, mask, aggregation="seq-mean-token-mean")
    assert abs(float(a) - float(b)) < 1e-12


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_cispo_matches_reference(mode: str) -> None:
    logp, old, adv, mask, weights = _inputs(seed=5)

    def token(i, j, lp):
        rho = math.exp(float(lp.detach()) - float(old[i, j]))
        return -min(max(rho, 0.0), 1.28) * float(adv[i]) * lp  # clip_low = 1: floor at 0

    metrics = _compare(lambda x: policy_losses["cispo"](
        x, old, adv, mask, clip_high=0.28, aggregation=mode, weights=weights),
        lambda y: _ref_loss(token, y, mask, mode, weights), logp)
    assert 0 < metrics["clip_frac"] < 1


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo"])
def test_losses_accept_per_token_advantages_and_weights_scale(name: str) -> None:
    logp, old, adv, mask, _ = _inputs(seed=6)
    fn = policy_losses[name]
    a, _ = fn(logp, old, adv, mask)
    b, _ = fn(logp, old, adv[:, None].expand_as(logp), mask)
    c, _ = fn(logp, old, adv, mask, weights=torch.full_like(logp, 0.5))
    assert abs(float(a) - float(b)) < 1e-12 and abs(float(c) - 0.5 * float(a)) < 1e-12


# -- corrections ---------------------------------------------------------------------------


def _ref_correction(name, old, beh, mask, cap, low):
    """(weights, clipped count, units) with loops, from the formulas in docs/precision.md."""
    n, t = old.shape
    lo = 1 / cap if low is None else low
    w = torch.zeros(n, t, dtype=torch.float64)
    changed = units = 0
    for i in range(n):
        valid = [j for j in range(t) if mask[i, j] == 1]
        if name in ("tis", "mis"):
            for j in valid:
                r = math.exp(min(max(float(old[i, j] - beh[i, j]), -20), 20))
                units += 1
                if name == "tis":
                    w[i, j] = min(r, cap)
                    changed += r > cap
                else:
                    w[i, j] = float(lo <= r <= cap)
                    changed += not lo <= r <= cap
        elif valid:
            r = math.exp(min(max(sum(float(old[i, j] - beh[i, j]) for j in valid), -20), 20))
            units += 1
            keep = lo <= r <= cap
            value = min(r, cap) if name == "tis_seq" else float(keep)
            changed += (r > cap) if name == "tis_seq" else (not keep)
            for j in valid:
                w[i, j] = value
    return w, changed, units


@pytest.mark.parametrize("name", ["tis", "mis", "tis_seq", "mis_seq"])
@pytest.mark.parametrize("cap,low", [(2.0, None), (1.5, 0.8)])
def test_corrections_match_reference_and_carry_no_gradient(name, cap, low) -> None:
    logp, old, _, mask, _ = _inputs(seed=7, spread=1.0)
    beh = old.clone()
    old = logp.clone().requires_grad_(True)  # the learner's log-probs vs the engine's
    w, metrics = corrections[name](old, beh, mask, cap=cap, low=low)
    want, changed, units = _ref_correction(name, logp, beh, mask, cap, low)
    torch.testing.assert_close(w, want, rtol=1e-10, atol=1e-12)
    assert not w.requires_grad
    assert metrics["clipped_frac"] == pytest.approx(changed / units)
    assert 0 < metrics["clipped_frac"] < 1
    assert metrics["weight_max"] <= cap + 1e-12
    lr = [float(logp[i, j] - beh[i, j]) for i in range(6) for j in range(8) if mask[i, j]]
    assert metrics["kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in lr) / len(lr))
    assert metrics["kl_k1"] == pytest.approx(-sum(lr) / len(lr))
    seq = name.endswith("_seq")
    unit_w = [float(want[i][mask[i].bool()][0]) for i in range(6)] if seq else \
        [float(want[i, j]) for i in range(6) for j in range(8) if mask[i, j]]
    mean = sum(unit_w) / len(unit_w)
    assert metrics["weight_mean"] == pytest.approx(mean)
    assert metrics["ess"] == pytest.approx(1 / (sum((x / mean) ** 2 for x in unit_w) / len(unit_w)))


@pytest.mark.parametrize("name", ["tis", "mis", "tis_seq", "mis_seq"])
def test_identical_policies_give_unit_weights(name: str) -> None:
    logp, _, _, mask, _ = _inputs(seed=8)
    w, metrics = corrections[name](logp, logp.clone(), mask, cap=2.0)
    assert torch.equal(w, mask)
    assert metrics["weight_mean"] == 1.0 and metrics["ess"] == pytest.approx(1.0)
    assert metrics["clipped_frac"] == 0.0 and metrics["kl"] == 0.0
