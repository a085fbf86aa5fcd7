"""Rollout allocators: which prompts each step rolls out, and how many rollouts each gets.

Every allocator works inside the per-step budget B = prompts_per_step x group_size (what
`uniform` spends), except `dynamic`, whose refills are the point (at most max_rounds x B).
Formulas and options (control.allocator_options, the constructors' parameters):
docs/allocation.md. Summary, with P prompts per step, G group size:

- uniform       P prompts from the uniform stream, G rollouts each (the GRPO baseline).
- dynamic       DAPO: P x G; drop zero-variance groups; refill with fresh prompts until P
                informative groups or max_rounds rounds.
- thompson      VADE: draw p~ ~ Beta(α, β) per candidate prompt, take the top P by p~(1 − p~).
- pilot_commit  pilot pilot_n rollouts on pilot_factor x P prompts from the stream, then the
                rest of B to prompts whose pilot pass rate lies in [band_low, band_high]
                (then by posterior variance); train on committed prompts (pilot + commit).
- dars          round 1 with first_n each; hard prompts (a < 0.5) get Δn more (ET or HW
                schedule), scaled to the rest of B; train on mixed groups. With min_mix > 0,
                round 1 skips prompts whose posterior predicts an all-equal group.
- vcrl          train on groups with normalised variance σ²/σ²_max >= κ; replay such prompts
                from a priority bank for part of each batch.
- gdro          Rollout-GDRO: bin prompts by posterior mean (with hysteresis); n_i ∝ σ_b(i)
                = sqrt(p_b(1 − p_b)) (the square-root rule), within [min_n, max_n].
"""

from __future__ import annotations

import math
from typing import Any

from rollwise.control.controller import Controller, Group, Request, prompt_id
from rollwise.registry import Registry, options_misfit


def _requests(prompts: list, n: int) -> list[Request]:
    return [Request(p, n) for p in prompts]


def skip_settled(ctl: Controller, prompts: list, n: int, min_mix: float, keep: int = 0) -> list:
    """The prompts whose posterior gives n rollouts a chance of at least `min_mix` of not all
    agreeing (PosteriorBook.mixed_chance), after the first `keep`, which always stay; the
    first prompt alone when none would (a step trains on something). A skipped prompt costs
    nothing this step; the posterior's decay toward the prior brings it back later."""
    kept = [p for p in prompts[keep:] if ctl.book.mixed_chance(prompt_id(p), ctl.step, n)
            >= min_mix]
    return prompts[:keep] + kept or prompts[:1]


def _stateless(cls):
    cls.state_dict = lambda self: {}
    cls.load_state_dict = lambda self, state: None
    return cls


@_stateless
class Uniform:
    name = "uniform"

    def plan(self, ctl: Controller) -> list[Request]:
        return _requests(ctl.stream(ctl.prompts_per_step), ctl.group_size)

    def observe(self, ctl: Controller, groups: list[Group]) -> list[Request]:
        return []

    def train_groups(self, ctl: Controller, groups: list[Group]) -> list[Group]:
        return groups

    def max_rollouts(self, ctl: Controller) -> int:
        return ctl.budget


@_stateless
class Dynamic:
    """DAPO dynamic sampling (arXiv 2503.14476): filter zero-variance groups and refill."""

    name = "dynamic"

    def __init__(self, max_rounds: int = 3):
        if max_rounds < 1:
            raise ValueError(f"dynamic: max_rounds={max_rounds}: expected >= 1")
        self.max_rounds = max_rounds
        self._informative = self._round = 0

    def plan(self, ctl: Controller) -> list[Request]:
        self._informative, self._round = 0, 1
        return _requests(ctl.stream(ctl.prompts_per_step), ctl.group_size)

    def observe(self, ctl: Controller, groups: list[Group]) -> list[Request]:
        self._informative += sum(not g.zero_variance for g in groups)
        missing = ctl.prompts_per_step - self._informative
        if missing <= 0 or self._round >= self.max_rounds:
            return []
        self._round += 1
        return _requests(ctl.stream(missing), ctl.group_size)

    def train_groups(self, ctl: Controller, groups: list[Group]) -> list[Group]:
        return [g for g in groups if not g.zero_variance][: ctl.prompts_per_step]

    def max_rollouts(self, ctl: Controller) -> int:
        return self.max_rounds * ctl.budget


@_stateless
class Thompson:
    """VADE (arXiv 2511.18902): Thompson sampling on the expected information p~(1 − p~),
    among `candidates` x P prompts from the stream (0: among all prompts)."""

    name = "thompson"

    def __init__(self, candidates: float = 2.0):
        if candidates < 0:
            raise ValueError(f"thompson: candidates={candidates}: expected >= 0")
        self.candidates = candidates

    def plan(self, ctl: Controller) -> list[Request]:
        rng, step = ctl.rng, ctl.step

        def score(pid: str) -> float:
            p = rng.betavariate(*ctl.book.counts(pid, step))
            return p * (1.0 - p)

        return _requests(ctl.choose(ctl.prompts_per_step, score, self.candidates),
                         ctl.group_size)

    def observe(self, ctl: Controller, groups: list[Group]) -> list[Request]:
        return []

    def train_groups(self, ctl: Controller, groups: list[Group]) -> list[Group]:
        return groups

    def max_rollouts(self, ctl: Controller) -> int:
        return ctl.budget


class PilotCommit:
    """Pilot-Commit (arXiv 2605.26606): pilot, then commit inside a pass-rate band, ranked by
    the posterior (which holds the pilot and the prompt's history)."""

    name = "pilot_commit"

    def __init__(self, pilot_n: int = 2, pilot_factor: float = 2.0, commit_n: int = 0,
                 band_low: float = 0.125, band_high: float = 0.75):
        if pilot_n < 1 or pilot_factor <= 0 or commit_n < 0:
            raise ValueError(f"pilot_commit: pilot_n={pilot_n}, pilot_factor={pilot_factor}, "
                             f"commit_n={commit_n}: expected >= 1, > 0 and >= 0")
        if not 0.0 <= band_low <= band_high <= 1.0:
            raise ValueError(f"pilot_commit: band_low={band_low}, band_high={band_high}: "
                             "expected 0 <= band_low <= band_high <= 1")
        self.pilot_n, self.pilot_factor, self.commit_n = pilot_n, pilot_factor, commit_n
        self.band = (band_low, band_high)
        self._committed: set[str] = set()
        self._phase = "pilot"

    def _pilot_prompts(self, ctl: Controller) -> int:
        # never more pilots than half the budget can pay for
        wanted = max(1, round(self.pilot_factor * ctl.prompts_per_step))
        return max(1, min(wanted, ctl.budget // (2 * self.pilot_n)))

    def plan(self, ctl: Controller) -> list[Request]:
        self._phase, self._committed = "pilot", set()
        return _requests(ctl.stream(self._pilot_prompts(ctl)), self.pilot_n)

    def observe(self, ctl: Controller, groups: list[Group]) -> list[Request]:
        if self._phase != "pilot":
            return []
        self._phase = "commit"
        step, (lo, hi) = ctl.step, self.band
        left = ctl.budget - self.pilot_n * len(groups)
        commit_n = self.commit_n or max(1, ctl.group_size - self.pilot_n)

        def rank(g: Group) -> tuple[bool, float]:
            # the paper's band on the pilot pass rate; then the posterior (pilot + history)
            rate = sum(min(max(r, 0.0), 1.0) for r in g.rewards) / len(g.rewards)
            return (not lo <= rate <= hi, -ctl.book.expected_variance(g.sample.id, step))

        chosen = sorted(groups, key=rank)[: max(0, left // commit_n)]
        if not chosen:
            return []
        sizes = [left // len(chosen)] * len(chosen)  # the rest of the budget, spread evenly
        for i in range(left - sum(sizes)):
            sizes[i] += 1
        self._committed = {g.sample.id for g in chosen}
        return [Request(_prompt_of(g), n) for g, n in zip(chosen, sizes)]

    def train_groups(self, ctl: Controller, groups: list[Group]) -> list[Group]:
        return [g for g in groups if g.sample.id in self._committed]

    def max_rollouts(self, ctl: Controller) -> int:
        return ctl.budget

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _prompt_of(group: Group) -> tuple:
    """(Sample, prompt ids) of a group, to ask for more rollouts of the same prompt."""
    return group.sample, group.trajectories[0].prompt_ids


def dars_extra(accuracy: float, n: int, n_max: int, schedule: str = "et",
               use_std: bool = True) -> int:
    """DARS (arXiv 2508.13755) extra rollouts Δn for a prompt with accuracy `accuracy` after
    n rollouts: 0 for a >= 0.5; a = 0 counts as 0.5/n. Cumulative advantage per unit
    S = 2·sqrt(a(1 − a)) with A_peak = n (GRPO with std), or S = 2a(1 − a), A_peak = n/2;
    ET: Δn = ⌈(A_peak − nS)/S⌉, HW: Δn = ⌈(2(1 − a)·A_peak − nS)/S⌉; capped at n_max − n.

    >>> dars_extra(1 / 8, 8, 32, use_std=False), dars_extra(0.0, 8, 32, use_std=False)
    (11, 24)
    """
    if accuracy >= 0.5:
        return 0
    a = accuracy if accuracy > 0 else 0.5 / n
    s, peak = (2 * math.sqrt(a * (1 - a)), n) if use_std else (2 * a * (1 - a), n / 2)
    target = peak if schedule == "et" else 2 * (1 - a) * peak
    return max(0, min(math.ceil((target - n * s) / s - 1e-9), n_max - n))


@_stateless
class Dars:
    """DARS: a second round for hard prompts, sized to equalise cumulative advantage."""

    name = "dars"

    def __init__(self, first_n: int = 0, max_n: int = 32, schedule: str = "et",
                 std: bool = True, min_mix: float = 0.0):
        if schedule not in ("et", "hw"):
            raise ValueError(f"dars: schedule={schedule!r}: expected 'et' or 'hw'")
        if not 0.0 <= min_mix < 1.0:
            raise ValueError(f"dars: min_mix={min_mix}: expected 0 <= min_mix < 1")
        self.first_n, self.max_n = first_n, max_n
        self.schedule, self.use_std, self.min_mix = schedule, std, min_mix
        self._first, self._second_round = 0, False

    def plan(self, ctl: Controller) -> list[Request]:
        self._first = self.first_n or max(1, ctl.group_size // 2)
        self._second_round = False
        prompts = ctl.stream(ctl.prompts_per_step)
        if self.min_mix > 0:  # not the paper's: skip what the posterior calls settled
            prompts = skip_settled(ctl, prompts, self._first, self.min_mix)
        return _requests(prompts, self._first)

    def observe(self, ctl: Controller, groups: list[Group]) -> list[Request]:
        if self._second_round:
            return []
        self._second_round = True
        n, left = self._first, ctl.budget - self._first * len(groups)
        extra = [dars_extra(sum(min(max(r, 0.0), 1.0) for r in g.rewards) / n, n,
                            max(self.max_n, n), self.schedule, self.use_std) for g in groups]
        total = sum(extra)
        if total > left:  # scale down to the budget, largest remainders first
            exact = [e * left / total for e in extra]
            extra = [math.floor(x) for x in exact]
            order = sorted(range(len(exact)), key=lambda i: extra[i] - exact[i])
            for i in order[: left - sum(extra)]:
                extra[i] += 1
        return [Request(_prompt_of(g), e) for g, e in zip(groups, extra) if e > 0]

    def train_groups(self, ctl: Controller, groups: list[Group]) -> list[Group]:
        return [g for g in groups if not g.zero_variance]  # DARS drops a in {0, 1}

    def max_rollouts(self, ctl: Controller) -> int:
        return ctl.budget


def normalised_variance(rewards: list[float]) -> float:
    """VCRL's p = σ²/σ²_max: the unbiased group variance over its maximum for G rollouts in
    [0, 1], σ²_max = G/(4(G − 1)) for even G and (G + 1)/(4G) for odd G; 0 for G < 2.

    >>> normalised_variance([1, 0, 1, 0]), normalised_variance([1, 1, 1, 0])
    (1.0, 0.75)
    """
    g = len(rewards)
    if g < 2:
        return 0.0
    mean = sum(rewards) / g
    var = sum((r - mean) ** 2 for r in rewards) / (g - 1)
    var_max = g / (4 * (g - 1)) if g % 2 == 0 else (g + 1) / (4 * g)
    return min(var / var_max, 1.0)


class Vcrl:
    """VCRL (arXiv 2509.19803): variance-based curriculum with a replay bank."""

    name = "vcrl"

    def __init__(self, kappa: float = 0.3, bank_frac: float = 0.5, momentum: float = 0.9,
                 bank_size: int = 0):
        if not 0 <= kappa <= 1 or not 0 <= bank_frac <= 1:
            raise ValueError(f"vcrl: kappa={kappa}, bank_frac={bank_frac}: expected fractions "
                             "in [0, 1]")
        self.kappa, self.bank_frac, self.momentum = kappa, bank_frac, momentum
        self.bank_size = bank_size
        self.bank: dict[str, float] = {}  # sample id -> momentum-updated priority

    def plan(self, ctl: Controller) -> list[Request]:
        p = ctl.prompts_per_step
        k = min(round(self.bank_frac * p), p - ctl.floor_slots(p), len(self.bank))
        fresh = ctl.stream(p - k)
        taken = {prompt_id(x) for x in fresh}
        rng = ctl.rng
        replay = sorted((x for x in ctl.prompts if x[0].id in self.bank and x[0].id not in taken),
                        key=lambda x: (-self.bank[x[0].id], rng.random()))[:k]
        return _requests(replay + fresh, ctl.group_size)

    def observe(self, ctl: Controller, groups: list[Group]) -> list[Request]:
        for g in groups:
            pid, p = g.sample.id, normalised_variance(g.rewards)
            if p >= self.kappa:
                old = self.bank.get(pid, p)
                self.bank[pid] = self.momentum * old + (1 - self.momentum) * p
            else:
                self.bank.pop(pid, None)
        limit = self.bank_size or 4 * ctl.prompts_per_step
        if len(self.bank) > limit:  # keep the highest priorities
            self.bank = dict(sorted(self.bank.items(), key=lambda kv: -kv[1])[:limit])
        return []

    def train_groups(self, ctl: Controller, groups: list[Group]) -> list[Group]:
        return [g for g in groups if normalised_variance(g.rewards) >= self.kappa]

    def max_rollouts(self, ctl: Controller) -> int:
        return ctl.budget

    def state_dict(self) -> dict:
        return {"bank": dict(self.bank)}

    def load_state_dict(self, state: dict) -> None:
        self.bank = {k: float(v) for k, v in state.get("bank", {}).items()}


def bounded_allocation(weights: list[float], total: int, low: int, high: int) -> list[int]:
    """Integers n_i in [low, high] summing to `total`, proportional to `weights` where the
    bounds allow (water-filling: n_i = clip(c·w_i, low, high), c found by bisection), then
    rounded by largest remainder. `total` is clipped into [len·low, len·high].

    >>> bounded_allocation([1.0, 1.0, 2.0], 16, 2, 32)
    [4, 4, 8]
    >>> bounded_allocation([0.0, 1.0], 10, 2, 6)
    [4, 6]
    """
    k = len(weights)
    total = min(max(total, k * low), k * high)
    if k == 0:
        return []
    if sum(weights) <= 0:
        weights = [1.0] * k

    def filled(c: float) -> list[float]:
        return [min(max(c * w, low), high) for w in weights]

    lo, hi = 0.0, 1.0
    while sum(filled(hi)) < total and hi < 1e12:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(filled(mid)) < total else (lo, mid)
    exact = filled(hi)
    out = [min(max(math.floor(x), low), high) for x in exact]
    order = sorted(range(k), key=lambda i: out[i] - exact[i])
    i = 0
    while sum(out) < total:  # hand out the remainder, largest fractional part first
        j = order[i % k]
        if out[j] < high:
            out[j] += 1
        i += 1
    while sum(out) > total:
        j = max(range(k), key=lambda i: out[i] - exact[i])
        out[j] -= 1
    return out


class Gdro:
    """Rollout-GDRO (arXiv 2601.19280): square-root allocation across difficulty bins."""

    name = "gdro"

    def __init__(self, bins: int = 4, hysteresis: float = 0.05, min_n: int = 2,
                 max_n: int = 32):
        if bins < 1 or min_n < 1 or max_n < min_n:
            raise ValueError(f"gdro: bins={bins}, min_n={min_n}, max_n={max_n}: expected "
                             "bins >= 1, 1 <= min_n <= max_n")
        self.bins, self.hysteresis = bins, hysteresis
        self.min_n, self.max_n = min_n, max_n
        self.assigned: dict[str, int] = {}  # sample id -> difficulty bin

    def bin_of(self, pid: str, mean: float) -> int:
        """Equal-width bins of the posterior mean; a prompt keeps its bin until its mean
        leaves the bin widened by `hysteresis` on both sides."""
        width = 1.0 / self.bins
        old = self.assigned.get(pid)
        if old is not None and old * width - self.hysteresis <= mean <= (old + 1) * width + (
                self.hysteresis):
            return old
        self.assigned[pid] = min(int(mean / width), self.bins - 1)
        return self.assigned[pid]

    def plan(self, ctl: Controller) -> list[Request]:
        prompts = ctl.stream(ctl.prompts_per_step)
        means = [ctl.book.mean(prompt_id(p), ctl.step) for p in prompts]
        bins = [self.bin_of(prompt_id(p), m) for p, m in zip(prompts, means)]
        sigma = {}
        for b in set(bins):
            p_b = sum(m for m, x in zip(means, bins) if x == b) / bins.count(b)
            sigma[b] = math.sqrt(p_b * (1 - p_b))
        # n_b ∝ σ_b·sqrt(w_b/π_b) with w_b = π_b (each prompt weighs the same): n_i ∝ σ_b(i)
        sizes = bounded_allocation([sigma[b] for b in bins], ctl.budget, self.min_n,
                                   min(self.max_n, ctl.budget))
        return [Request(p, n) for p, n in zip(prompts, sizes)]

    def observe(self, ctl: Controller, groups: list[Group]) -> list[Request]:
        return []

    def train_groups(self, ctl: Controller, groups: list[Group]) -> list[Group]:
        return groups

    def max_rollouts(self, ctl: Controller) -> int:
        return max(ctl.budget, ctl.prompts_per_step * self.min_n)

    def state_dict(self) -> dict:
        return {"bins": dict(self.assigned)}

    def load_state_dict(self, state: dict) -> None:
        self.assigned = {k: int(v) for k, v in state.get("bins", {}).items()}


ALLOCATORS: Registry[type] = Registry("allocator", options=True)
for _cls in (Uniform, Dynamic, Thompson, PilotCommit, Dars, Vcrl, Gdro):
    ALLOCATORS.register(_cls.name)(_cls)


def make_allocator(name: str, **options: Any):
    """The allocator registered as `name` (or at "package.module:Class"), its constructor
    given `options` (control.allocator_options); an option it does not take is a ValueError
    naming the closest one it does (a typo would otherwise vanish)."""
    cls = ALLOCATORS.get(name)
    problem = options_misfit(cls, options)
    if problem:
        raise ValueError(f"allocator {name!r}: {problem}")
    return cls(**options)
