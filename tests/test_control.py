"""Rollout allocation: the posterior against its closed form, every allocator's budget and
exploration floor against a simulated policy, and the pure allocation formulas."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

import pytest

from rollwise.control import ALLOCATORS, Controller, PosteriorBook, make_allocator, merge_groups
from rollwise.control.allocators import (
    bounded_allocation,
    dars_extra,
    normalised_variance,
)
from rollwise.types import Group, Sample, Trajectory


def test_posterior_update_equals_closed_form_without_decay():
    book = PosteriorBook(prior=(2.0, 3.0), decay_fast=1.0, decay_slow=1.0)
    outcomes = [[1, 0, 1, 1], [0, 0], [1, 1, 1, 0, 0, 1]]
    for step, rewards in enumerate(outcomes):
        book.update("p", rewards, step)
    k = sum(sum(r) for r in outcomes)
    n = sum(len(r) for r in outcomes)
    assert book.counts("p", 10) == pytest.approx((2.0 + k, 3.0 + n - k))
    assert book.mean("p", 10) == pytest.approx((2.0 + k) / (5.0 + n))
    a, b = 2.0 + k, 3.0 + n - k
    assert book.expected_variance("p", 10) == pytest.approx(a * b / ((a + b) * (a + b + 1)))
    assert book.counts("unseen", 0) == (2.0, 3.0)


def test_posterior_decay_equals_stepwise_pull_toward_prior():
    lf, ls, stale = 0.9, 0.5, 3
    book = PosteriorBook(prior=(1.0, 1.0), decay_fast=lf, decay_slow=ls, stale_after=stale)
    book.update("p", [1, 1, 1, 1, 0], step=0)
    # reference: apply the pull one step at a time, slow part only past `stale` steps unseen
    a, b = 5.0, 2.0
    for t in range(1, 9):
        lam = lf * (ls if t > stale else 1.0)
        a, b = 1.0 + lam * (a - 1.0), 1.0 + lam * (b - 1.0)
        assert book.counts("p", t) == pytest.approx((a, b)), t
    # an update after a gap decays first, then adds the new evidence
    book.update("p", [0, 0], step=8)
    assert book.counts("p", 8) == pytest.approx((a, b + 2.0))
    assert book.visits("p") == 2


def test_posterior_rebuild_and_state_round_trip():
    history = [("a", 0, [1.0, 0.0]), ("b", 1, [1.0]), ("a", 3, [0.0, 0.0, 1.0])]
    live = PosteriorBook(decay_fast=0.95)
    for pid, step, rewards in history:
        live.update(pid, rewards, step)
    rebuilt = PosteriorBook(decay_fast=0.95)
    rebuilt.rebuild(history)
    copy = PosteriorBook(decay_fast=0.95)
    copy.load_state_dict(live.state_dict())
    for book in (rebuilt, copy):
        for pid in ("a", "b"):
            assert book.counts(pid, 5) == pytest.approx(live.counts(pid, 5))


def test_fractional_rewards_are_clipped_evidence():
    book = PosteriorBook(prior=(1.0, 1.0), decay_fast=1.0, decay_slow=1.0)
    book.update("p", [0.25, 2.0, -1.0], step=0)
    assert book.counts("p", 0) == pytest.approx((1.0 + 1.25, 1.0 + 1.75))


def test_pure_formulas():
    # DARS worked examples (the DARS paper's equal-treatment schedule without std, N = 8)
    assert dars_extra(1 / 8, 8, 32, "et", use_std=False) == 11
    assert dars_extra(0.0, 8, 32, "et", use_std=False) == 24
    assert dars_extra(0.5, 8, 32) == 0 and dars_extra(0.75, 8, 32) == 0
    assert dars_extra(1 / 8, 8, 32, "hw", use_std=False) > dars_extra(1 / 8, 8, 32, "et",
                                                                      use_std=False)
    # VCRL normalised variance: even G max at k = G/2; odd G max at k = (G ± 1)/2
    assert normalised_variance([1, 1, 0, 0]) == pytest.approx(1.0)
    assert normalised_variance([1, 1, 0]) == pytest.approx(1.0)
    assert normalised_variance([1, 1, 1, 1]) == 0.0
    # bounded allocation: proportional, in bounds, exact total
    for weights, total, lo, hi in (([0.5, 0.0, 0.43, 0.2], 32, 2, 16), ([1, 2, 3], 10, 1, 5),
                                   ([0.1] * 7, 23, 2, 8)):
        n = bounded_allocation(weights, total, lo, hi)
        assert sum(n) == total and all(lo <= x <= hi for x in n)
    assert bounded_allocation([1.0, 3.0], 16, 1, 32) == [4, 12]


# -- allocators against a simulated policy ---------------------------------------------------


@dataclass
class FakePrompt:
    sample: Sample
    ids: list[int]

    def __getitem__(self, i):  # behaves like the (Sample, prompt ids) tuple
        return (self.sample, self.ids)[i]


def simulated(requests, rng: random.Random, rate: dict[str, float]) -> list[Group]:
    """A fake engine + verifier: each rollout succeeds with the prompt's fixed rate."""
    groups = []
    for r in requests:
        s, ids = r.prompt[0], r.prompt[1]
        trajs = [Trajectory(sample=s, prompt_ids=list(ids), response_ids=[5, 2], logprobs=[0.0,
                            0.0], versions=[0, 0], finish_reason="stop",
                            reward=float(rng.random() < rate[s.id])) for _ in range(r.n)]
        groups.append(Group(sample=s, trajectories=trajs))
    return groups


def run_controller(name: str, steps: int, num_prompts: int = 60, per_step: int = 6,
                   group: int = 8, explore: float = 0.25, **options):
    """Drive an allocator for `steps` steps on prompts that are 1/3 always solved, 1/3 never,
    1/3 at 50%; returns (controller, rollouts per step, steps at which each prompt was rolled
    out, train groups per step)."""
    rng = random.Random(0)
    prompts = [FakePrompt(Sample(id=f"p{i}", prompt=f"{i}", answer="0"), [1, i])
               for i in range(num_prompts)]
    rate = {p.sample.id: (1.0, 0.0, 0.5)[i % 3] for i, p in enumerate(prompts)}
    ctl = Controller(prompts, make_allocator(name, **options), PosteriorBook(decay_fast=0.98),
                     prompts_per_step=per_step, group_size=group, explore=explore, seed=1)
    spent, seen, trained = [], {p.sample.id: [] for p in prompts}, []
    for step in range(steps):
        requests, total = ctl.plan(), 0
        while requests:
            assert all(r.n >= 1 for r in requests)
            total += sum(r.n for r in requests)
            groups = simulated(requests, rng, rate)
            for g in groups:
                seen[g.sample.id].append(step)
            requests = ctl.observe(groups)
        rolled, train = ctl.finish()
        assert {id(g) for g in train} <= {id(g) for g in rolled}
        assert sum(len(g.trajectories) for g in rolled) == total
        spent.append(total)
        trained.append(train)
    return ctl, spent, seen, trained, rate


@pytest.mark.parametrize("name", sorted(ALLOCATORS))
def test_allocator_respects_budget_and_exploration_floor(name):
    per_step, group, n_prompts, explore, steps = 6, 8, 60, 0.25, 60
    ctl, spent, seen, _, _ = run_controller(name, steps, n_prompts, per_step, group, explore)
    budget = per_step * group
    cap = 3 * budget if name == "dynamic" else budget  # DAPO refills are the point
    assert max(spent) <= cap, spent
    if name in ("uniform", "thompson", "gdro", "vcrl"):
        assert all(s == budget for s in spent), spent  # same budget as uniform, every step
    # floor: every prompt is rolled out at least once in every 2·ceil(N / f) steps, f the floor
    # slots per step (the stream reshuffles each epoch: first of one, last of the next)
    window = 2 * math.ceil(n_prompts / ctl.floor_slots(per_step))
    for pid, steps_seen in seen.items():
        marks = [-1, *sorted(set(steps_seen)), steps]
        gaps = [b - a for a, b in itertools.pairwise(marks)]
        assert max(gaps) <= window, (pid, steps_seen)


@pytest.mark.parametrize("name", ["thompson", "pilot_commit", "vcrl", "dynamic", "dars",
                                  "aero"])
def test_adaptive_allocators_train_on_more_informative_groups_than_uniform(name):
    def informative(trained):
        groups = [g for step in trained[20:] for g in step]
        return sum(not g.zero_variance for g in groups) / max(1, len(groups))

    base = informative(run_controller("uniform", 80)[3])
    got = informative(run_controller(name, 80)[3])
    assert base < 0.5 and got > base + 0.15, (base, got)


def test_thompson_prefers_uncertain_prompts():
    _, _, seen, _, rate = run_controller("thompson", 80)
    mid = [len(v) for k, v in seen.items() if rate[k] == 0.5]
    solved = [len(v) for k, v in seen.items() if rate[k] == 1.0]
    assert sum(mid) > 2 * sum(solved)


def test_gdro_gives_uncertain_bins_more_rollouts():
    ctl, *_ = run_controller("gdro", 30)
    requests = ctl.plan()
    by_rate = {}
    for r in requests:
        by_rate.setdefault(round(ctl.book.mean(r.prompt[0].id, ctl.step), 1), []).append(r.n)
    lows = [n for m, ns in by_rate.items() for n in ns if m <= 0.1 or m >= 0.9]
    mids = [n for m, ns in by_rate.items() for n in ns if 0.3 <= m <= 0.7]
    assert sum(r.n for r in requests) == ctl.budget
    if lows and mids:
        assert min(mids) > max(lows)


def test_pilot_commit_commits_inside_the_band():
    _, _, _, trained, rate = run_controller("pilot_commit", 40)
    late = [g for step in trained[20:] for g in step]
    assert late and sum(rate[g.sample.id] == 0.5 for g in late) / len(late) > 0.8
    assert all(len(g.trajectories) >= 8 for g in late)  # pilot + commit rollouts, merged


def test_controller_state_round_trip_replays_the_same_plan():
    ctl, *_ = run_controller("vcrl", 10)
    copy, *_ = run_controller("vcrl", 0)
    copy.load_state_dict(ctl.state_dict())
    copy.sampler.load_state_dict(ctl.sampler.state_dict())
    assert [(r.prompt[0].id, r.n) for r in copy.plan()] == [(r.prompt[0].id, r.n)
                                                            for r in ctl.plan()]


def test_merge_groups_joins_rounds_per_prompt():
    s1, s2 = Sample(id="a", prompt="1", answer="1"), Sample(id="b", prompt="2", answer="2")

    def t(s, r):
        return Trajectory(sample=s, prompt_ids=[1], response_ids=[2], logprobs=[0.0],
                          versions=[0], finish_reason="stop", reward=r)

    merged = merge_groups([Group(s1, [t(s1, 1.0)]), Group(s2, [t(s2, 0.0)]),
                           Group(s1, [t(s1, 0.0), t(s1, 1.0)])])
    assert [g.sample.id for g in merged] == ["a", "b"]
    assert merged[0].rewards == [1.0, 0.0, 1.0]


def test_unknown_allocator_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown allocator 'thomson' \(did you mean "
                       r"'thompson'\?\); accepted: .*dynamic.*uniform"):
        make_allocator("thomson")


def test_allocator_option_it_does_not_take_is_an_error():
    """An allocator's options are its own (control.allocator_options): one it does not take,
    a typo or another allocator's, is an error instead of vanishing."""
    assert make_allocator("dars", max_n=16).max_n == 16
    with pytest.raises(ValueError, match=r"allocator 'dynamic': no option 'max_round' \(did "
                       r"you mean 'max_rounds'\?\)"):
        make_allocator("dynamic", max_round=5)
    with pytest.raises(ValueError, match=r"allocator 'uniform': no option 'max_rounds'"):
        make_allocator("uniform", max_rounds=5)
