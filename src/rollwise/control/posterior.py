"""Per-prompt Beta posterior of the success rate, with two-scale decay (VADE; docs/allocation.md).

Each prompt i keeps pseudo-counts (α_i, β_i) over a Beta(α0, β0) prior. A scored group of
n rollouts with rewards r_j adds its successes and failures:

    α_i ← α_i + Σ_j clip(r_j, 0, 1)        β_i ← β_i + Σ_j (1 − clip(r_j, 0, 1))

which is the exact conjugate update for 0/1 rewards (fractional rewards count as fractional
evidence). So that the estimate follows the changing policy, the counts are pulled back to the
prior on two time scales, applied lazily and in closed form over the Δ steps since the prompt
was last touched:

    f(Δ) = λ_fast^Δ · λ_slow^max(0, Δ − stale_after)
    α ← α0 + f(Δ)·(α − α0)                 β ← β0 + f(Δ)·(β − β0)

λ_fast is the per-step pull every prompt feels; λ_slow adds a stronger pull on prompts not seen
for more than `stale_after` steps, so stale estimates revert to the prior. (The exact decay form
of VADE is reconstructed, see docs/allocation.md.) Lazy decay makes a step cost O(prompts touched),
and `decay(λ_f, λ_s)` applied step by step equals the closed form (tested).

`mixed_chance(α, β, n)` is the predictive chance that n rollouts do not all agree, i.e. that
a group of n has a non-zero advantage; allocators skip prompts where it is small.

Simplification: the book lives in memory and travels in the checkpoint (`state_dict`); the
reward history itself stays in the replay store (`TrajectoryStore.group_rewards`), from which
`rebuild` recomputes the same counts (tested).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


def mixed_chance(a: float, b: float, n: int) -> float:
    """The probability that n rollouts of a prompt with success rate p ~ Beta(a, b) do not all
    agree: 1 − E[p^n] − E[(1 − p)^n], with E[p^n] = Π_{i<n} (a + i)/(a + b + i).

    >>> round(mixed_chance(1.0, 1.0, 4), 4), round(mixed_chance(9.0, 1.0, 4), 4)
    (0.6, 0.3063)
    """
    if n < 2:
        return 0.0
    all_pass = all_fail = 1.0
    for i in range(n):
        all_pass *= (a + i) / (a + b + i)
        all_fail *= (b + i) / (a + b + i)
    return max(0.0, 1.0 - all_pass - all_fail)


@dataclass
class BetaState:
    alpha: float  # prior + decayed successes
    beta: float  # prior + decayed failures
    step: int  # the step these counts are decayed to
    visits: int = 0  # groups observed (not decayed)


class PosteriorBook:
    """Beta posteriors of every prompt seen, keyed by sample id.

    >>> book = PosteriorBook(prior=(1.0, 1.0), decay_fast=1.0, decay_slow=1.0)
    >>> book.update("p", [1.0, 0.0, 1.0], step=0)
    >>> book.counts("p", step=0), round(book.mean("p", step=0), 3)
    ((3.0, 2.0), 0.6)
    """

    def __init__(self, prior: tuple[float, float] = (1.0, 1.0), decay_fast: float = 0.99,
                 decay_slow: float = 0.9, stale_after: int = 50):
        if prior[0] <= 0 or prior[1] <= 0:
            raise ValueError(f"control.prior={list(prior)}: both pseudo-counts must be > 0")
        for name, lam in (("decay_fast", decay_fast), ("decay_slow", decay_slow)):
            if not 0.0 < lam <= 1.0:
                raise ValueError(f"control.{name}={lam}: expected a factor in (0, 1]")
        self.alpha0, self.beta0 = float(prior[0]), float(prior[1])
        self.decay_fast, self.decay_slow, self.stale_after = decay_fast, decay_slow, stale_after
        self.states: dict[str, BetaState] = {}

    def factor(self, steps: int) -> float:
        """f(Δ): how much of the evidence survives `steps` steps without an update."""
        return self.decay_fast**steps * self.decay_slow ** max(0, steps - self.stale_after)

    def counts(self, pid: str, step: int) -> tuple[float, float]:
        """(α, β) of prompt `pid` decayed to `step` (the prior for an unseen prompt)."""
        s = self.states.get(pid)
        if s is None:
            return self.alpha0, self.beta0
        f = self.factor(max(0, step - s.step))
        return self.alpha0 + f * (s.alpha - self.alpha0), self.beta0 + f * (s.beta - self.beta0)

    def mean(self, pid: str, step: int) -> float:
        a, b = self.counts(pid, step)
        return a / (a + b)

    def expected_variance(self, pid: str, step: int) -> float:
        """E[p(1 − p)] under Beta(α, β) = αβ / ((α + β)(α + β + 1)): the expected Bernoulli
        variance of one rollout, i.e. how much a group on this prompt is expected to teach."""
        a, b = self.counts(pid, step)
        return a * b / ((a + b) * (a + b + 1))

    def mixed_chance(self, pid: str, step: int, n: int) -> float:
        """The chance that n rollouts of this prompt do not all agree (`mixed_chance`)."""
        return mixed_chance(*self.counts(pid, step), n)

    def evidence(self, pid: str, step: int) -> float:
        """Decayed pseudo-counts beyond the prior (0 for an unseen prompt)."""
        a, b = self.counts(pid, step)
        return a + b - self.alpha0 - self.beta0

    def visits(self, pid: str) -> int:
        s = self.states.get(pid)
        return s.visits if s else 0

    def update(self, pid: str, rewards: Iterable[float], step: int) -> None:
        """Add one scored group's outcomes (rewards clipped to [0, 1]) at `step`."""
        # a reward that failed to compute (NaN) is no evidence either way
        wins = [min(max(float(r), 0.0), 1.0) for r in rewards if math.isfinite(r)]
        a, b = self.counts(pid, step)
        visits = self.visits(pid) + 1
        self.states[pid] = BetaState(a + sum(wins), b + len(wins) - sum(wins), step, visits)

    def rebuild(self, history: Iterable[tuple[str, int, list[float]]]) -> None:
        """Replace the book by replaying (sample id, step, rewards of one group) in step order,
        e.g. from the replay store."""
        self.states = {}
        for pid, step, rewards in history:
            self.update(pid, rewards, step)

    def state_dict(self) -> dict:
        return {pid: [s.alpha, s.beta, s.step, s.visits] for pid, s in self.states.items()}

    def load_state_dict(self, state: dict) -> None:
        self.states = {pid: BetaState(float(a), float(b), int(t), int(v))
                       for pid, (a, b, t, v) in state.items()}
