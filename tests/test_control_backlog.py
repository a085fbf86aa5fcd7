"""AERO, XRPO's allocator and HIVE (control/adaptive.py): their formulas on values worked out
by hand in the comments, and their behaviour against the simulated policy of
tests/test_control.py (the budget and floor contract, and for aero the share of informative
groups trained on, run there)."""

from __future__ import annotations

import random

import pytest

from rollwise.control import Controller, PosteriorBook, make_allocator
from rollwise.control.adaptive import (
    Hive,
    half_width,
    incomplete_beta,
    response_entropy,
    t_quantile,
    xrpo_allocation,
)
from rollwise.control.posterior import mixed_chance
from rollwise.types import Group, Sample, Trajectory
from test_control import FakePrompt, run_controller, simulated


def test_probability_helpers_by_hand() -> None:
    # I_x(1, b) = 1 - (1 - x)^b:  I_0.05(1, 11) = 1 - 0.95^11 = 1 - 0.568800 = 0.431200
    assert incomplete_beta(0.05, 1.0, 11.0) == pytest.approx(0.431200, abs=1e-6)
    # I_x(a, 1) = x^a:  I_0.5(3, 1) = 0.125
    assert incomplete_beta(0.5, 3.0, 1.0) == pytest.approx(0.125, abs=1e-9)
    # t tables: t_{0.975, 10} = 2.228, t_{0.95, 4} = 2.132
    assert t_quantile(0.975, 10) == pytest.approx(2.228, abs=1e-3)
    assert t_quantile(0.95, 4) == pytest.approx(2.132, abs=1e-3)
    # h(4) with s = 0.5, alpha 0.05: t_{0.975, 3} 0.5 / 2 = 3.182 × 0.25 = 0.7955
    assert half_width(4, 0.5, 0.05) == pytest.approx(0.7955, abs=1e-3)


def _controller(allocator, group_size: int) -> Controller:
    """A controller over one prompt, for the allocator's posterior-based formulas."""
    prompt = FakePrompt(Sample(id="p", prompt="p", answer="0"), [1])
    return Controller([prompt], allocator, PosteriorBook(decay_fast=1.0), prompts_per_step=1,
                      group_size=group_size)


def test_aero_rescue_size_and_live_mass_by_hand() -> None:
    aero = make_allocator("aero", rescue_prob=0.5)
    # q = 1/6: 1 - (5/6)^3 = 0.4213 < 0.5, 1 - (5/6)^4 = 0.5177 >= 0.5 -> 4 more rollouts
    assert aero.rescue_size(1 / 6, cap=12) == 4
    # q = 1/4: 1 - 0.75^2 = 0.4375, 1 - 0.75^3 = 0.5781 -> 3; with room for 2 only: dead zone
    assert aero.rescue_size(0.25, cap=12) == 3 and aero.rescue_size(0.25, cap=2) == 0
    ctl = _controller(aero, group_size=8)
    # the prior Beta(1, 1): P(0.05 <= p <= 0.95) = 0.9
    assert aero.live_mass(ctl, "new") == pytest.approx(0.9, abs=1e-9)
    # ten failures, Beta(1, 11): 0.95^11 - 0.05^11 = 0.568800
    ctl.book.update("failed", [0.0] * 10, step=0)
    assert aero.live_mass(ctl, "failed") == pytest.approx(0.568800, abs=1e-6)


def test_aero_rescues_all_equal_groups_with_the_posterior_size() -> None:
    """Three fresh prompts, G = 8 (budget 24; n0 = G/2 = 4): round 1 asks 4 each; a prompt
    that failed 4 times has posterior Beta(1, 5), mean 1/6, so it is rescued with 4 more
    (1 - (5/6)^4 = 0.518 >= 0.5); a mixed group is not; the budget left (24 - 12 = 12) pays
    for both all-fail prompts."""
    prompts = [FakePrompt(Sample(id=f"p{i}", prompt=str(i), answer="0"), [1, i])
               for i in range(3)]
    ctl = Controller(prompts, make_allocator("aero", candidates=1.0),
                     PosteriorBook(decay_fast=1.0), prompts_per_step=3, group_size=8,
                     explore=0.0)
    first = ctl.plan()
    assert [r.n for r in first] == [4, 4, 4]
    rate = {r.prompt[0].id: 0.0 for r in first}
    rate[first[0].prompt[0].id] = 0.5
    groups = simulated(first, random.Random(3), rate)
    groups[0].trajectories[0].reward, groups[0].trajectories[1].reward = 1.0, 0.0  # mixed
    second = ctl.observe(groups)
    assert sorted((r.prompt[0].id, r.n) for r in second) == sorted(
        (g.sample.id, 4) for g in groups[1:])
    assert ctl.observe(simulated(second, random.Random(3), rate)) == []
    _, train = ctl.finish()
    assert [g.sample.id for g in train] == [groups[0].sample.id]  # still-dead groups dropped


def test_aero_min_mix_skips_prompts_the_posterior_calls_settled() -> None:
    """mixed_chance(a, b, n) = 1 - E[p^n] - E[(1-p)^n] by hand: the prior Beta(1, 1) gives
    1 - 1/5 - 1/5 = 0.6 for n = 4; twenty passes, Beta(21, 1): E[p^4] = 21/25 = 0.84 and
    E[(1-p)^4] = 4!/(22*23*24*25) = 7.9e-5, so 0.15992. With min_mix = 0.3 and no floor the
    settled prompt is not rolled out, by aero or by dars; at min_mix = 0 (the default) it is."""
    assert mixed_chance(1.0, 1.0, 4) == pytest.approx(0.6)
    assert mixed_chance(21.0, 1.0, 4) == pytest.approx(1 - 0.84 - 24 / (22 * 23 * 24 * 25))
    assert mixed_chance(3.0, 2.0, 1) == 0.0
    prompts = [FakePrompt(Sample(id=f"p{i}", prompt=str(i), answer="0"), [1, i])
               for i in range(3)]

    def planned(min_mix: float, name: str = "aero", **options) -> dict[str, int]:
        ctl = Controller(prompts, make_allocator(name, min_mix=min_mix, **options),
                         PosteriorBook(decay_fast=1.0), prompts_per_step=3, group_size=8,
                         explore=0.0)
        ctl.book.update("p1", [1.0] * 20, step=0)
        return {r.prompt[0].id: r.n for r in ctl.plan()}

    assert planned(0.3, candidates=1.0) == {"p0": 4, "p2": 4}
    assert planned(0.0, candidates=1.0) == {"p0": 4, "p1": 4, "p2": 4}
    assert len(planned(0.9, candidates=1.0)) == 1  # all settled: the best-ranked still runs
    # dars's first round (first_n = G/2 = 4) skips the same prompt
    assert planned(0.3, "dars") == {"p0": 4, "p2": 4}
    assert planned(0.0, "dars") == {"p0": 4, "p1": 4, "p2": 4}


def test_xrpo_allocation_by_hand() -> None:
    # no bonus: only the uncertain prompt (s = 0.5) shrinks its interval; both chunks to it
    assert xrpo_allocation([0.5, 0.0], base=4, extra=4, delta=2, alpha=0.05,
                           bonus=0.0) == [4, 0]
    # both certain, bonus 1: a tie goes to the first (+2: counts 6, 4); then the bonus
    # sqrt(ln 10 / 4) > sqrt(ln 10 / 6) sends the second chunk to the other
    assert xrpo_allocation([0.0, 0.0], base=4, extra=4, delta=2, alpha=0.05,
                           bonus=1.0) == [2, 2]
    # the last chunk is what is left: 5 = 2 + 2 + 1
    assert sum(xrpo_allocation([0.5, 0.4], base=4, extra=5, delta=2, alpha=0.05,
                               bonus=0.0)) == 5


def _group(pid: str, logprobs: list[list[float]], rewards: list[float]) -> Group:
    s = Sample(id=pid, prompt=pid, answer="0")
    return Group(s, [Trajectory(sample=s, prompt_ids=[1], response_ids=[5] * len(lp),
                                logprobs=lp, versions=[0] * len(lp), finish_reason="stop",
                                reward=r) for lp, r in zip(logprobs, rewards, strict=True)])


def test_hive_scores_by_hand() -> None:
    # surprisal per row: (1 + 3)/2 = 2 and 0.5; mean over rows 1.25
    assert response_entropy(_group("e", [[-1.0, -3.0], [-0.5]], [1.0, 0.0])) == 1.25
    hive = Hive(trend=1.0, entropy_floor=0.5)
    ctl = _controller(hive, group_size=2)
    hive.mean_entropy = 2.0
    # last accuracy 0.5, previous 0.25: trend +0.25 -> predicted 0.75, utility
    # 0.75 × 0.25 = 0.1875, times entropy 1.0 / 2.0 = 0.5 -> 0.09375
    hive.history = {"edge": [0.5, 0.25, 1.0], "solved": [1.0, 0.5, 2.0],
                    "confident": [0.5, 0.5, 0.8]}
    assert hive.score(ctl, "edge") == pytest.approx(0.09375)
    assert hive.score(ctl, "solved") == -1.0  # stage 1: predicted accuracy 1
    assert hive.score(ctl, "confident") == -1.0  # stage 2: entropy 0.8 / 2 = 0.4 < 0.5
    # never seen: E[p(1 - p)] under the prior Beta(1, 1) = 1 / (2 × 3)
    assert hive.score(ctl, "new") == pytest.approx(1 / 6)


def test_hive_rolls_out_learning_edge_prompts_more_often() -> None:
    """Prompts that always or never succeed are pruned once seen; the 50% ones are not
    (among 4 candidates per free slot: 260 group visits against 115 and 105 on this seed)."""
    _, _, seen, _, rate = run_controller("hive", 80, candidates=4.0)
    visits = {r: sum(len(v) for k, v in seen.items() if rate[k] == r) for r in (0.0, 0.5, 1.0)}
    assert visits[0.5] > 1.5 * max(visits[0.0], visits[1.0]), visits


def test_xrpo_spends_the_extra_rollouts_on_uncertain_prompts() -> None:
    _, spent, _, trained, rate = run_controller("xrpo", 30)
    assert all(s == 48 for s in spent)  # 6 prompts × G = 8, every step
    sizes = {0.5: [], 0.0: [], 1.0: []}
    for step in trained:
        for g in step:
            sizes[rate[g.sample.id]].append(len(g.trajectories))
    mid = sum(sizes[0.5]) / len(sizes[0.5])
    sure = sum(sizes[0.0] + sizes[1.0]) / len(sizes[0.0] + sizes[1.0])
    assert mid > sure + 2, (mid, sure)
