"""Three more rollout allocators, registered in `ALLOCATORS` (formulas: docs/allocation.md):

- aero  AERO (arXiv 2602.14338): staged rollouts. Round 1 gives n0 rollouts to P prompts
        ranked by the posterior mass outside the dead zones p < ε and p > 1 − ε; a group
        whose outcomes all agree is "rescued" with m more rollouts, m the fewest for which
        the posterior's minority outcome shows up with probability ≥ ρ; groups still
        all-equal are rejected (not trained on). Unspent budget is not spent. With
        `min_mix` > 0, a chosen prompt (outside the exploration floor) whose posterior
        predicts a mixed first-round group with probability below min_mix is skipped: it
        costs nothing this step and is re-checked when the floor or the decay brings it back.
- xrpo  XRPO's allocator (arXiv 2510.06672): base_n rollouts per prompt, then the rest of
        the budget in chunks of `delta` to the prompt whose Student-t confidence half-width
        h(n) = t_{1−α/2, n−1}·s/√n shrinks most, plus a UCB bonus c·√(ln T / n).
- hive  HIVE (arXiv 2603.25184): prompt selection before rollout from each prompt's history
        (last accuracy and its trend: coarse prefilter) and its response entropy relative
        to the run's (online check: pruned when the policy has become confident on it).

The probability helpers (regularised incomplete beta, Student-t quantile) are written here
rather than taken from scipy, which rollwise does not depend on.
"""

from __future__ import annotations

import functools
import math

from rollwise.control.allocators import (
    ALLOCATORS,
    _prompt_of,
    _requests,
    _stateless,
    skip_settled,
)
from rollwise.control.controller import Controller, Group, Request


def incomplete_beta(x: float, a: float, b: float) -> float:
    """The regularised incomplete beta function I_x(a, b) = P(X ≤ x), X ~ Beta(a, b), by
    its continued fraction (modified Lentz), on the side where it converges fast.

    >>> round(incomplete_beta(0.5, 2.0, 2.0), 6), round(incomplete_beta(0.2, 1.0, 3.0), 6)
    (0.5, 0.488)
    """
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - incomplete_beta(1.0 - x, b, a)
    log_front = (a * math.log(x) + b * math.log1p(-x)
                 - math.log(a) - math.lgamma(a) - math.lgamma(b) + math.lgamma(a + b))
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    frac = d
    for m in range(1, 300):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            frac *= c * d
        if abs(c * d - 1.0) < 1e-14:
            break
    return math.exp(log_front) * frac


@functools.cache
def t_quantile(prob: float, df: int) -> float:
    """The Student-t quantile t_{prob, df} for prob in (0.5, 1), by bisection on the CDF
    P(T ≤ t) = 1 − I_{df/(df + t²)}(df/2, 1/2)/2.

    >>> round(t_quantile(0.975, 1), 3), round(t_quantile(0.975, 3), 3)
    (12.706, 3.182)
    """
    lo, hi = 0.0, 1.0
    while 1.0 - 0.5 * incomplete_beta(df / (df + hi * hi), df / 2, 0.5) < prob:
        hi *= 2.0
    for _ in range(80):
        mid = (lo + hi) / 2
        below = 1.0 - 0.5 * incomplete_beta(df / (df + mid * mid), df / 2, 0.5) < prob
        lo, hi = (mid, hi) if below else (lo, mid)
    return (lo + hi) / 2


def _rate(group: Group) -> float:
    """The group's pass rate, rewards clipped to [0, 1]."""
    return sum(min(max(r, 0.0), 1.0) for r in group.rewards) / len(group.rewards)


@_stateless
class Aero:
    """AERO: staged rollouts, posterior-sized rescue of all-equal groups, dead-zone rejection."""

    name = "aero"

    def __init__(self, n0: int = 0, max_n: int = 16, rescue_prob: float = 0.5,
                 dead_eps: float = 0.05, candidates: float = 2.0, min_mix: float = 0.0):
        if n0 < 0 or max_n < 2 or not 0.0 < rescue_prob < 1.0 or not 0.0 < dead_eps < 0.5:
            raise ValueError(f"aero: n0={n0}, max_n={max_n}, rescue_prob={rescue_prob}, "
                             f"dead_eps={dead_eps}: expected n0 >= 0, max_n >= 2, "
                             "0 < rescue_prob < 1, 0 < dead_eps < 0.5")
        if not 0.0 <= min_mix < 1.0:
            raise ValueError(f"aero: min_mix={min_mix}: expected 0 <= min_mix < 1")
        self.n0, self.max_n, self.rescue_prob = n0, max_n, rescue_prob
        self.dead_eps, self.candidates, self.min_mix = dead_eps, candidates, min_mix
        self._first, self._rescued = 0, False

    def live_mass(self, ctl: Controller, pid: str) -> float:
        """Posterior mass outside both dead zones: P(ε ≤ p ≤ 1 − ε) under Beta(α, β)."""
        a, b = ctl.book.counts(pid, ctl.step)
        return (incomplete_beta(1.0 - self.dead_eps, a, b)
                - incomplete_beta(self.dead_eps, a, b))

    def rescue_size(self, q: float, cap: int) -> int:
        """Fewest more rollouts m with 1 − (1 − q)^m ≥ rescue_prob, q the probability of the
        minority outcome per rollout; 0 when more than `cap` would be needed (a dead zone)."""
        if q <= 0.0:
            return 0
        m = 1 if q >= 1.0 else math.ceil(math.log1p(-self.rescue_prob) / math.log1p(-q) - 1e-9)
        return m if m <= cap else 0

    def plan(self, ctl: Controller) -> list[Request]:
        self._first = min(self.n0 or max(2, ctl.group_size // 2), ctl.group_size)
        self._rescued = False
        chosen = ctl.choose(ctl.prompts_per_step, lambda pid: self.live_mass(ctl, pid),
                            self.candidates)
        if self.min_mix > 0:
            # the floor's prompts are always rolled out: they are how a skipped prompt's
            # posterior gets fresh evidence besides the decay
            chosen = skip_settled(ctl, chosen, self._first, self.min_mix,
                                  ctl.floor_slots(ctl.prompts_per_step))
        return _requests(chosen, self._first)

    def observe(self, ctl: Controller, groups: list[Group]) -> list[Request]:
        if self._rescued:
            return []
        self._rescued = True
        left = ctl.budget - self._first * len(groups)
        wanted = []
        for g in groups:
            if not g.zero_variance:
                continue
            mean = ctl.book.mean(g.sample.id, ctl.step)  # already holds this group
            q = mean if _rate(g) < 0.5 else 1.0 - mean  # the outcome not yet seen
            m = self.rescue_size(q, max(0, self.max_n - len(g.trajectories)))
            if m:
                wanted.append((m, g))
        out = []
        for m, g in sorted(wanted, key=lambda x: x[0]):  # cheapest rescues first
            if m <= left:
                out.append(Request(_prompt_of(g), m))
                left -= m
        return out

    def train_groups(self, ctl: Controller, groups: list[Group]) -> list[Group]:
        return [g for g in groups if not g.zero_variance]  # selective rejection

    def max_rollouts(self, ctl: Controller) -> int:
        return ctl.budget


def half_width(n: int, s: float, alpha: float) -> float:
    """h(n) = t_{1−α/2, n−1}·s/√n, the Student-t confidence half-width of a mean of n
    rewards with sample std s (infinite for n < 2)."""
    return math.inf if n < 2 else t_quantile(1.0 - alpha / 2, n - 1) * s / math.sqrt(n)


def sample_std(values: list[float]) -> float:
    """Unbiased sample standard deviation (0 for fewer than two values)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def xrpo_allocation(stds: list[float], base: int, extra: int, delta: int, alpha: float,
                    bonus: float) -> list[int]:
    """Extra rollouts per prompt: `extra` handed out in chunks of `delta` (the last chunk
    may be smaller), each to the prompt of highest priority
    h(n) − h(n + Δ) + bonus·√(ln T / n), n its rollouts so far, T all rollouts so far.

    >>> xrpo_allocation([0.5, 0.0], 4, 4, 2, 0.05, 0.0)
    [4, 0]
    """
    counts = [base] * len(stds)
    out = [0] * len(stds)
    while extra > 0 and stds:
        step, total = min(delta, extra), sum(counts)
        priority = [half_width(n, s, alpha) - half_width(n + step, s, alpha)
                    + bonus * math.sqrt(math.log(total) / n) for n, s in zip(counts, stds)]
        best = max(range(len(stds)), key=lambda i: (priority[i], -i))
        counts[best] += step
        out[best] += step
        extra -= step
    return out


@_stateless
class Xrpo:
    """XRPO's hierarchical allocator: base rollouts, then uncertainty-reduction rounds."""

    name = "xrpo"

    def __init__(self, base_n: int = 0, delta: int = 2, alpha: float = 0.05,
                 bonus: float = 0.05):
        if base_n == 1 or base_n < 0 or delta < 1 or not 0.0 < alpha < 1.0 or bonus < 0:
            raise ValueError(f"xrpo: base_n={base_n}, delta={delta}, alpha={alpha}, "
                             f"bonus={bonus}: expected base_n 0 or >= 2, delta >= 1, "
                             "0 < alpha < 1, bonus >= 0")
        self.base_n, self.delta, self.alpha, self.bonus = base_n, delta, alpha, bonus
        self._base, self._second = 0, False

    def plan(self, ctl: Controller) -> list[Request]:
        self._base = min(self.base_n or max(2, ctl.group_size // 2), ctl.group_size)
        self._second = False
        return _requests(ctl.stream(ctl.prompts_per_step), self._base)

    def observe(self, ctl: Controller, groups: list[Group]) -> list[Request]:
        if self._second:
            return []
        self._second = True
        left = ctl.budget - self._base * len(groups)
        stds = [sample_std(g.rewards) for g in groups]
        extra = xrpo_allocation(stds, self._base, left, self.delta, self.alpha, self.bonus)
        return [Request(_prompt_of(g), e) for g, e in zip(groups, extra) if e > 0]

    def train_groups(self, ctl: Controller, groups: list[Group]) -> list[Group]:
        return groups

    def max_rollouts(self, ctl: Controller) -> int:
        return ctl.budget


def response_entropy(group: Group) -> float:
    """Mean over the group's rollouts of the mean surprisal −log π(token) of the tokens the
    policy sampled (a one-sample estimate of the per-token response entropy)."""
    per_row = []
    for t in group.trajectories:
        picked = [-lp for lp, m in zip(t.logprobs, t.sampled_mask) if m]
        if picked:
            per_row.append(sum(picked) / len(picked))
    return sum(per_row) / len(per_row) if per_row else 0.0


class Hive:
    """HIVE: history-informed prefilter, then an entropy check, before any rollout."""

    name = "hive"

    def __init__(self, candidates: float = 2.0, low: float = 0.05, high: float = 0.95,
                 trend: float = 1.0, entropy_floor: float = 0.5, momentum: float = 0.9):
        if not 0.0 <= low < high <= 1.0 or candidates < 0 or not 0.0 <= momentum < 1.0:
            raise ValueError(f"hive: low={low}, high={high}, candidates={candidates}, "
                             f"momentum={momentum}: expected 0 <= low < high <= 1, "
                             "candidates >= 0, 0 <= momentum < 1")
        self.candidates, self.low, self.high = candidates, low, high
        self.trend, self.entropy_floor, self.momentum = trend, entropy_floor, momentum
        self.history: dict[str, list[float]] = {}  # id -> [last acc, previous acc, entropy]
        self.mean_entropy = 0.0  # momentum average over observed groups

    def score(self, ctl: Controller, pid: str) -> float:
        """The learning-edge utility â(1 − â)·e/ē of a prompt; −1 when pruned. â is the last
        accuracy plus `trend` times its last change, clipped to [0, 1]; e/ē its last response
        entropy over the run's average. An unseen prompt scores the prior's E[p(1 − p)]."""
        past = self.history.get(pid)
        if past is None:
            return ctl.book.expected_variance(pid, ctl.step)
        last, prev, entropy = past
        acc = min(max(last + self.trend * (last - prev), 0.0), 1.0)
        if not self.low < acc < self.high:  # stage 1: history says solved or hopeless
            return -1.0
        rel = entropy / self.mean_entropy if self.mean_entropy > 0 else 1.0
        if rel < self.entropy_floor:  # stage 2: confident now, its utility is stale
            return -1.0
        return acc * (1.0 - acc) * rel

    def plan(self, ctl: Controller) -> list[Request]:
        chosen = ctl.choose(ctl.prompts_per_step, lambda pid: self.score(ctl, pid),
                            self.candidates)
        return _requests(chosen, ctl.group_size)

    def observe(self, ctl: Controller, groups: list[Group]) -> list[Request]:
        for g in groups:
            rate, entropy = _rate(g), response_entropy(g)
            last = self.history.get(g.sample.id, [rate, rate, entropy])[0]
            self.history[g.sample.id] = [rate, last, entropy]
            self.mean_entropy = (entropy if self.mean_entropy == 0.0 else
                                 self.momentum * self.mean_entropy
                                 + (1 - self.momentum) * entropy)
        return []

    def train_groups(self, ctl: Controller, groups: list[Group]) -> list[Group]:
        return groups

    def max_rollouts(self, ctl: Controller) -> int:
        return ctl.budget

    def state_dict(self) -> dict:
        return {"history": {k: list(v) for k, v in self.history.items()},
                "mean_entropy": self.mean_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.history = {k: [float(x) for x in v] for k, v in state.get("history", {}).items()}
        self.mean_entropy = float(state.get("mean_entropy", 0.0))


for _cls in (Aero, Xrpo, Hive):
    ALLOCATORS.register(_cls.name)(_cls)
