"""Advantage estimators against slow references written from each formula with scalar loops
(value and gradient with respect to the rewards, on random inputs)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rollwise.algos import (
    AdvantageInputs,
    advantage_estimators,
    call_estimator,
    inputs_of,
    register,
    uses,
)

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _members(groups: list[int], i: int) -> list[int]:
    return [j for j, g in enumerate(groups) if g == groups[i]]


def _random(seed: int, groups: list[int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(len(groups), generator=gen, dtype=torch.float64) * 2 - 0.5


def _check_value_and_grad(fn, ref, rewards: torch.Tensor, **kw) -> None:
    """fn(rewards) and ref(rewards) agree in value and in the gradient of <cotangent, out>."""
    x = rewards.clone().requires_grad_(True)
    y = rewards.clone().requires_grad_(True)
    got, want = fn(x, **kw), ref(y, **kw)
    torch.testing.assert_close(got, want, **TOL)
    cot = torch.randn(got.shape, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
    (g1,) = torch.autograd.grad((got * cot).sum(), x)
    (g2,) = torch.autograd.grad((want * cot).sum(), y)
    torch.testing.assert_close(g1, g2, **TOL)
    assert g1.abs().sum() > 0  # the gradient is not trivially zero


GROUPS = [4, 1, 4, 9, 1, 4, 9, 9, 1, 4, 2, 2]  # interleaved groups of sizes 4, 3, 3, 2


def _ref_group_mean_std(r, groups, i):
    idx = _members(groups, i)
    n = len(idx)
    mean = sum(r[j] for j in idx) / n
    var = sum((r[j] - mean) ** 2 for j in idx) / max(n - 1, 1)
    return mean, var, n


def _ref_stack(values) -> torch.Tensor:
    return torch.stack([v if torch.is_tensor(v) else torch.tensor(float(v), dtype=torch.float64)
                        for v in values])


def test_grpo_dr_grpo_rloo_match_references() -> None:
    groups = torch.tensor(GROUPS)
    rewards = _random(0, GROUPS)

    def ref_grpo(r):
        out = []
        for i in range(len(r)):
            mean, var, _ = _ref_group_mean_std(r, GROUPS, i)
            out.append((r[i] - mean) / (torch.sqrt(var) + 1e-6))
        return _ref_stack(out)

    def ref_dr(r):
        return _ref_stack([r[i] - _ref_group_mean_std(r, GROUPS, i)[0] for i in range(len(r))])

    def ref_rloo(r):
        out = []
        for i in range(len(r)):
            others = [r[j] for j in _members(GROUPS, i) if j != i]
            out.append(r[i] - sum(others) / len(others))
        return _ref_stack(out)

    for name, ref in (("grpo", ref_grpo), ("dr_grpo", ref_dr), ("rloo", ref_rloo)):
        _check_value_and_grad(lambda r, n=name: advantage_estimators[n](r, groups), ref, rewards)


def test_rloo_is_scaled_dr_grpo_and_singletons_are_zero() -> None:
    groups = torch.tensor([0, 0, 0, 1, 2, 2])
    r = torch.tensor([1.0, 0.0, 0.5, 3.0, 2.0, 1.0], dtype=torch.float64)
    rl, dr = advantage_estimators["rloo"](r, groups), advantage_estimators["dr_grpo"](r, groups)
    torch.testing.assert_close(rl[:3], dr[:3] * 3 / 2)
    torch.testing.assert_close(rl[4:], dr[4:] * 2)
    assert float(rl[3]) == 0.0 and float(dr[3]) == 0.0


def _token_inputs(seed: int = 1, n: int = len(GROUPS), t: int = 7):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(n, t, dtype=torch.float64)
    for i in range(n):
        start = int(torch.randint(0, 3, (1,), generator=gen))
        length = int(torch.randint(1, t - start + 1, (1,), generator=gen))
        mask[i, start: start + length] = 1
    token_rewards = -torch.rand(n, t, generator=gen, dtype=torch.float64) * 0.3
    return mask, token_rewards


def _ref_whiten(values: list, eps: float = 1e-6) -> list:
    mean = sum(values) / len(values)
    std = torch.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return [(v - mean) / (std + eps) for v in values]


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_token_level_matches_reference(gamma: float) -> None:
    groups = torch.tensor(GROUPS)
    mask, token_rewards = _token_inputs()
    n, t = mask.shape

    def ref(r):
        returns, where = [], []
        for i in range(n):
            valid = [j for j in range(t) if mask[i, j] == 1]
            for j in valid:
                g = sum(gamma ** (s - j) * (float(token_rewards[i, s]) + (r[i] if s == valid[-1]
                                                                          else 0.0))
                        for s in valid if s >= j)
                returns.append(g)
                where.append((i, j))
        white = _ref_whiten(returns)
        out = [[torch.zeros((), dtype=torch.float64)] * t for _ in range(n)]
        for (i, j), v in zip(where, white):
            out[i][j] = v
        return torch.stack([torch.stack(row) for row in out])

    fn = advantage_estimators["reinforce_pp"]
    _check_value_and_grad(lambda r: fn(r, groups, mask=mask, token_rewards=token_rewards,
                                       gamma=gamma), ref, _random(2, GROUPS))


def test_reinforce_pp_outcome_level_and_baseline_match_references() -> None:
    groups = torch.tensor(GROUPS)
    mask, token_rewards = _token_inputs(seed=3)
    n, t = mask.shape

    def ref_outcome(r):
        return torch.stack(_ref_whiten([r[i] for i in range(n)]))

    def ref_baseline(r):
        vals, where = [], []
        for i in range(n):
            centred = r[i] - _ref_group_mean_std(r, GROUPS, i)[0]
            for j in range(t):
                if mask[i, j] == 1:
                    vals.append(centred + float(token_rewards[i, j]))
                    where.append((i, j))
        white = _ref_whiten(vals)
        out = [[torch.zeros((), dtype=torch.float64)] * t for _ in range(n)]
        for (i, j), v in zip(where, white):
            out[i][j] = v
        return torch.stack([torch.stack(row) for row in out])

    def ref_baseline_rows(r):
        return torch.stack(_ref_whiten([r[i] - _ref_group_mean_std(r, GROUPS, i)[0]
                                        for i in range(n)]))

    est = advantage_estimators
    _check_value_and_grad(lambda r: est["reinforce_pp"](r, groups), ref_outcome, _random(4, GROUPS))
    _check_value_and_grad(lambda r: est["reinforce_pp_baseline"](
        r, groups, mask=mask, token_rewards=token_rewards), ref_baseline, _random(5, GROUPS))
    _check_value_and_grad(lambda r: est["reinforce_pp_baseline"](r, groups), ref_baseline_rows,
                          _random(6, GROUPS))


def _ref_lower_median(values: list, indices: list[int]) -> tuple:
    """(value, position in `indices`) of the lower median: stable sort by value."""
    order = sorted(range(len(values)), key=lambda k: (float(values[k].detach()), k))
    pos = order[(len(values) - 1) // 2]
    return values[pos], indices[pos]


@pytest.mark.parametrize("scale", ["mad", "std", "none"])
def test_mc_grpo_matches_reference_and_excludes_one_pivot_per_group(scale: str) -> None:
    groups_list = [0, 1, 0, 1, 0, 2, 1, 2, 0, 2, 1, 0, 2, 2, 3, 3, 3]  # sizes 5, 4, 5, 3
    groups = torch.tensor(groups_list)
    rewards = _random(7, groups_list)

    def ref(r):
        out, pivots = [None] * len(r), []
        for g in sorted(set(groups_list)):
            idx = [j for j, h in enumerate(groups_list) if h == g]
            vals = [r[j] for j in idx]
            median, pivot = _ref_lower_median(vals, idx)
            pivots.append(pivot)
            n = len(idx)
            mean = sum(vals) / n
            std = torch.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
            if scale == "mad":
                s, _ = _ref_lower_median([(v - median).abs() for v in vals], idx)
                s = std if float(s.detach()) == 0 else s
            else:
                s = std if scale == "std" else 1.0
            for j, v in zip(idx, vals):
                out[j] = (v - median) / (s + 1e-6)
        ref.pivots = pivots
        return _ref_stack(out)

    fn = advantage_estimators["mc_grpo"]
    _check_value_and_grad(lambda r: fn(r, groups, scale=scale)[0], ref, rewards)
    _, keep = fn(rewards, groups, scale=scale)
    assert sorted(torch.nonzero(~keep)[:, 0].tolist()) == sorted(ref.pivots)
    assert int((~keep).sum()) == 4  # exactly one pivot per group


def test_mc_grpo_binary_rewards_fall_back_to_std_not_a_thousand() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0])  # odd group: median 0, MAD 0
    adv, keep = advantage_estimators["mc_grpo"](r, torch.zeros(5, dtype=torch.long))
    std = math.sqrt((2 * 0.6**2 + 3 * 0.4**2) / 4)
    torch.testing.assert_close(adv, torch.tensor([1 / std, 0, 0, 1 / std, 0]), **TOL)
    assert keep.tolist() == [True, True, True, True, False]  # stable sort 1,2,4,0,3: middle 4


def test_drpo_matches_reference_and_keeps_correct_rollouts_positive() -> None:
    groups_list = [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    groups = torch.tensor(groups_list)
    gen = torch.Generator().manual_seed(8)
    correct = [1, 1, 0, 1, 0, 1, 1, 0, 0, 0, 1, 1, 1]
    rewards = torch.tensor(correct, dtype=torch.float64) + torch.rand(13, generator=gen,
                                                                       dtype=torch.float64) * 0.2
    lengths = torch.tensor([30, 5, 12, 18, 40, 9, 22, 7, 8, 9, 11, 11, 25])
    lam = 0.7

    def ref(r):
        base = []
        for i in range(len(r)):
            mean, var, _ = _ref_group_mean_std(r, groups_list, i)
            base.append((r[i] - mean) / (torch.sqrt(var) + 1e-6))
        out = list(base)
        for g in set(groups_list):
            pos = [j for j in range(len(r)) if groups_list[j] == g and float(r[j].detach()) >= 0.5]
            if len(pos) < 2:
                continue
            ls = [float(lengths[j]) for j in pos]
            mu = sum(ls) / len(ls)
            sd = math.sqrt(sum((x - mu) ** 2 for x in ls) / len(ls))
            e = [math.exp(-((x - mu) / (sd + 1e-6)) / lam) for x in ls]
            for j, ej in zip(pos, e):
                if float(base[j].detach()) > 0:
                    out[j] = base[j] * len(pos) * ej / sum(e)
        return _ref_stack(out)

    fn = advantage_estimators["drpo"]
    _check_value_and_grad(lambda r: fn(r, groups, lengths=lengths, lam=lam), ref, rewards)
    adv = fn(rewards, groups, lengths=lengths, lam=lam)
    assert (adv[torch.tensor(correct) == 1][:4] > 0).all()  # group 0's correct stay positive
    assert float(adv[1]) > float(adv[0])  # shorter correct (5 tokens) above longer (30)
    assert inputs_of(fn) == ("lengths",) and inputs_of(advantage_estimators["grpo"]) == ()


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_pass_at_k_matches_subset_enumeration(k: int) -> None:
    groups_list = [0] * 6 + [1] * 5 + [2] * 4 + [3] * 3
    correct = [1, 0, 0, 1, 0, 0] + [0, 0, 0, 0, 1] + [1, 1, 1, 1] + [0, 0, 0]
    rewards = torch.tensor(correct, dtype=torch.float64)
    got = advantage_estimators["pass_at_k"](rewards, torch.tensor(groups_list), k=k)
    for g in range(4):
        idx = [j for j, h in enumerate(groups_list) if h == g]
        kk = min(k, len(idx))
        subsets = list(itertools.combinations(idx, kk))
        value = {s: max(correct[j] for j in s) for s in subsets}
        mean = sum(value.values()) / len(subsets)
        std = math.sqrt(sum((v - mean) ** 2 for v in value.values()) / len(subsets))
        for j in idx:  # a rollout's advantage: the mean over the subsets that contain it
            mine = [value[s] - mean for s in subsets if j in s]
            assert float(got[j]) == pytest.approx(sum(mine) / len(mine) / (std + 1e-6), abs=1e-5)
    if k == 1:  # GRPO with the population std
        n, c = 6, 2
        p = c / n
        assert float(got[0]) == pytest.approx((1 - p) / (math.sqrt(p * (1 - p)) + 1e-6))


def test_call_estimator_passes_only_named_inputs_and_splits_keep() -> None:
    seen = {}

    @uses("lengths")
    def needs_lengths(rewards, group_ids, *, lengths, scale=1.0):
        seen.update(lengths=lengths, scale=scale)
        return rewards * scale

    r, g = torch.tensor([1.0, 2.0]), torch.tensor([0, 0])
    inputs = AdvantageInputs(lengths=torch.tensor([3, 4]), mask=torch.ones(2, 3))
    adv, keep = call_estimator(needs_lengths, r, g, inputs, {"scale": 2.0})
    assert adv.tolist() == [2.0, 4.0] and keep is None and seen["lengths"].tolist() == [3, 4]
    adv, keep = call_estimator(advantage_estimators["mc_grpo"], r, g, inputs)
    assert keep is not None and keep.tolist() == [False, True]


def _lengths_estimator(rewards, group_ids, *, lengths, scale=1.0):
    return rewards * scale / lengths


def _fresh():
    """A new function object each call (`uses` marks the function it decorates)."""
    return lambda rewards, group_ids, *, lengths, scale=1.0: rewards * scale / lengths


def test_an_input_typo_fails_at_registration_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"advantage estimator 'typo': uses input 'lenghts' "
                                         r"\(did you mean 'lengths'\?\), which is no field of "
                                         r"AdvantageInputs; inputs: mask, lengths, "):
        register(advantage_estimators, "typo")(uses("lenghts")(_fresh()))
    with pytest.raises(ValueError, match=r"'undeclared': keyword 'lengths' is an input: declare "
                                         r"it with @rollwise.algos.uses\('lengths'\)"):
        register(advantage_estimators, "undeclared")(_fresh())
    with pytest.raises(ValueError, match="uses input 'mask' but has no keyword parameter"):
        register(advantage_estimators, "no_param")(uses("lengths", "mask")(_fresh()))
    assert not {"typo", "undeclared", "no_param"} & set(advantage_estimators)
    # the same check for an estimator loaded by import path
    with pytest.raises(ValueError, match="keyword 'lengths' is an input"):
        advantage_estimators.get(f"{__name__}:_lengths_estimator")


def test_every_estimator_is_documented_with_a_formula_and_a_paper() -> None:
    for name, fn in advantage_estimators.items():
        doc = fn.__doc__ or ""
        assert "arXiv" in doc and "=" in doc, name
