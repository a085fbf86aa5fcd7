"""The controller: runs one allocator per step over the per-prompt posterior book.

The driver talks to it in rounds, with no case for any allocator by name:

    requests = ctl.plan()                   # round 1: which prompts, how many rollouts each
    while requests:
        groups = rollout(requests); score(groups)
        requests = ctl.observe(groups)      # posterior update; the allocator may ask for more
    rolled, train = ctl.finish()            # every group of the step (merged per prompt), and
                                            # the groups the allocator trains on

The controller owns what all allocators share: the Beta posterior book, the uniform prompt
stream (a seeded epoch sampler), the exploration floor, the budget check and the metrics.
"""

from __future__ import annotations

import math
import random
import statistics
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rollwise.control.posterior import PosteriorBook
from rollwise.control.sampler import UniformSampler
from rollwise.types import EncodedPrompt, Group  # importable without torch

__all__ = ["Allocator", "Controller", "Group", "Request", "prompt_id"]


@dataclass(frozen=True)
class Request:
    prompt: Any  # (Sample, prompt token ids)
    n: int  # rollouts to sample for it in this round


class Allocator(Protocol):
    """Decides which prompts get rollouts and how many, in one or more rounds per step.

    Contract (tested for every registered allocator): the rollouts a step requests never exceed
    `max_rollouts(ctl)`; every request has n >= 1; prompts come from `ctl.stream` or `ctl.choose`
    (which keep the exploration floor); `train_groups` returns a subset of the groups it gets.
    """

    name: str

    def plan(self, ctl: Controller) -> list[Request]:
        """The first round of a step."""
        ...

    def observe(self, ctl: Controller, groups: list[Group]) -> list[Request]:
        """Scored groups of the last round (posterior already updated); the next round, or []."""
        ...

    def train_groups(self, ctl: Controller, groups: list[Group]) -> list[Group]:
        """The groups to train on, from all groups of the step merged per prompt."""
        ...

    def max_rollouts(self, ctl: Controller) -> int:
        """The most rollouts one step may spend."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def prompt_id(prompt: Any) -> str:
    return prompt[0].id


class Controller:
    """Per-step driver of an `Allocator`; see the module docstring for the round protocol."""

    def __init__(self, prompts: list, allocator: Allocator, book: PosteriorBook, *,
                 prompts_per_step: int, group_size: int, explore: float = 0.125, seed: int = 0,
                 sampler: UniformSampler | None = None):
        if not 0.0 <= explore <= 1.0:
            raise ValueError(f"control.explore={explore}: expected a fraction in [0, 1]")
        self.prompts, self.allocator, self.book = prompts, allocator, book
        self.prompts_per_step, self.group_size = prompts_per_step, group_size
        self.budget = prompts_per_step * group_size  # rollouts per step, as uniform spends
        self.explore, self.seed = explore, seed
        self.sampler = sampler or UniformSampler(prompts, prompts_per_step, seed=seed)
        # the exploration floor's own stream, so the floor never depends on what was chosen
        self.floor_sampler = UniformSampler(prompts, 1, seed=f"{seed}/floor")
        self.step = 0  # steps finished
        self._rounds: list[list[Group]] = []
        self._spent = 0
        self._brier: list[float] = []
        self.last: dict[str, float] = {}
        self.regenerated = 0  # trajectories asked for again by `regenerate`, all steps
        # the asynchronous driver regenerates stale groups in the training thread while
        # the producer thread plans the next step: the posterior book is shared
        self._lock = threading.RLock()

    # -- helpers for allocators ------------------------------------------------------------
    @property
    def rng(self) -> random.Random:
        """A generator seeded by (seed, step, round): resuming replays the same draws."""
        return random.Random(f"{self.seed}/{self.step}/{len(self._rounds)}/control")

    def stream(self, k: int) -> list:
        """The next `k` prompts of the uniform epoch-by-epoch stream."""
        return self.sampler.take(k)

    def extra(self, k: int) -> list:
        """`k` prompts beyond the step's plan, for a rollout strategy that starts more groups
        than it returns (partial rollouts' over-provisioning): those not finished this step
        wait in its pool and come back as groups of a later step, which `observe` then sees
        like any other. From the uniform stream, so no allocator has to plan for them."""
        return self.stream(k)

    def floor_slots(self, k: int) -> int:
        """Of `k` prompt slots, how many the exploration floor fills from the uniform stream."""
        return min(k, math.ceil(self.explore * k))

    def choose(self, k: int, score: Callable[[str], float], candidates: float = 0.0) -> list:
        """`k` prompts: `floor_slots(k)` from a second uniform stream (so every prompt comes
        round at least once per 2·len(prompts)/floor_slots steps), the rest the highest `score`
        (sample id -> float, higher first; ties in random order) among `candidates` x the
        remaining slots drawn from the main stream, or (candidates = 0) among all prompts."""
        floor = self.floor_sampler.take(self.floor_slots(k))
        taken = {prompt_id(p) for p in floor}
        pool = self.prompts if candidates <= 0 else self.stream(
            math.ceil(candidates * (k - len(floor))))
        rng = self.rng
        ranked = sorted((p for p in pool if prompt_id(p) not in taken),
                        key=lambda p: (-score(prompt_id(p)), rng.random()))
        return floor + ranked[: k - len(floor)]

    # -- the round protocol ----------------------------------------------------------------
    def plan(self) -> list[Request]:
        with self._lock:
            self._rounds, self._spent, self._brier = [], 0, []
            return self._checked(self.allocator.plan(self))

    def observe(self, groups: list[Group]) -> list[Request]:
        with self._lock:
            self._update_book(groups)
            self._rounds.append(groups)
            return self._checked(self.allocator.observe(self, groups))

    def _update_book(self, groups: list[Group]) -> None:
        for g in groups:
            pid = g.sample.id
            if self.book.visits(pid):  # calibration: predict this group before seeing it
                rate = statistics.fmean(min(max(r, 0.0), 1.0) for r in g.rewards)
                self._brier.append((self.book.mean(pid, self.step) - rate) ** 2)
            self.book.update(pid, g.rewards, self.step)

    def regenerate(self, stale: list[Group]) -> list[Request]:
        """Requests to roll out the prompts of `stale` groups again (as many rollouts each):
        the asynchronous driver's 'regenerate' policy for groups over the staleness bound.
        Outside the step's budget: they replace rollouts already counted."""
        with self._lock:
            requests = [Request(EncodedPrompt(g.sample, g.trajectories[0].prompt_ids),
                                len(g.trajectories))
                        for g in stale if g.trajectories]
            self.regenerated += sum(r.n for r in requests)
            return requests

    def observe_regenerated(self, groups: list[Group]) -> None:
        """Scored regenerated groups update the posteriors like any other round's (they
        are not a round of the step being planned: no further requests follow)."""
        with self._lock:
            self._update_book(groups)

    def finish(self) -> tuple[list[Group], list[Group]]:
        """(every group of the step, merged per prompt; the groups to train on)."""
        with self._lock:
            rolled = merge_groups([g for r in self._rounds for g in r])
            train = self.allocator.train_groups(self, rolled)
            self.last = self._metrics(rolled, train)
            self.step += 1
            return rolled, train

    def _checked(self, requests: list[Request]) -> list[Request]:
        bad = [r.n for r in requests if r.n < 1]
        if bad:
            raise ValueError(f"allocator {self.allocator.name!r} asked for n={bad[0]} rollouts")
        self._spent += sum(r.n for r in requests)
        cap = self.allocator.max_rollouts(self)
        if self._spent > cap:
            raise RuntimeError(f"allocator {self.allocator.name!r} asked for {self._spent} "
                               f"rollouts this step; its budget is {cap}")
        return requests

    def _metrics(self, rolled: list[Group], train: list[Group]) -> dict[str, float]:
        rollouts = sum(len(g.trajectories) for g in rolled)
        effective = sum(len(g.trajectories) for g in train if not g.zero_variance)
        out = {
            "zero_adv_frac": statistics.fmean(g.zero_variance for g in rolled) if rolled else 0.0,
            "zero_adv_frac_trained": (statistics.fmean(g.zero_variance for g in train)
                                      if train else 0.0),
            "effective_samples": effective,
            "effective_frac": effective / rollouts if rollouts else 0.0,
            "prompts_rolled": len(rolled), "groups_trained": len(train),
            "rounds": len(self._rounds),
        }
        if self._brier:
            out["calib_brier"] = statistics.fmean(self._brier)
            out["calib_groups"] = len(self._brier)
        return out

    # -- resume ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        with self._lock:
            return {"step": self.step, "book": self.book.state_dict(),
                    "allocator": self.allocator.state_dict(),
                    "sampler": self.sampler.state_dict(),
                    "floor": self.floor_sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """`state_dict`'s; one without "sampler" (checkpoints before the controller saved
        its sampler) leaves the sampler to the caller."""
        self.step = int(state["step"])
        if "sampler" in state:
            self.sampler.load_state_dict(state["sampler"])
        self.book.load_state_dict(state["book"])
        self.allocator.load_state_dict(state["allocator"])
        self.floor_sampler.load_state_dict(state["floor"])


def merge_groups(groups: list[Group]) -> list[Group]:
    """One group per prompt, in first-seen order: later rounds' rollouts join the first group
    of the same sample id (pilot + commit, first + second round)."""
    out: dict[str, Group] = {}
    for g in groups:
        first = out.get(g.sample.id)
        if first is None:
            out[g.sample.id] = type(g)(sample=g.sample, trajectories=list(g.trajectories))
        else:
            first.trajectories.extend(g.trajectories)
    return list(out.values())
