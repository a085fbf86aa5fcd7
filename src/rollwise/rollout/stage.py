"""The rollout stage as one object: encoded prompts in, groups out, scoring overlapped.

Two paths behind one call: the rollout scheduler (native engine: every strategy of
docs/rollout.md, groups handed over as soon as they are complete) or plain batched
generation (engines with only `generate`, e.g. HF). On the scheduler path each complete
group starts scoring in a background thread while the engine decodes the rest; `score`
collects those results and scores whatever was not started.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from rollwise.engine.base import Engine, SamplingParams
from rollwise.rewards.pool import RewardStats
from rollwise.rollout.episodes import EpisodeFigures, EpisodeRunner
from rollwise.rollout.figures import RolloutFigures
from rollwise.rollout.scheduler import RolloutScheduler
from rollwise.rollout.scoring import ScoreAhead, Scorer
from rollwise.types import EncodedPrompt, Group, Published, Trajectory, WeightSlots

PLACEMENT = "in-process rollout"  # how publication errors name this placement


def generate_groups(engine: Engine, prompts: list[EncodedPrompt], params: SamplingParams,
                    decode: Callable[[list[int]], str]) -> list[Group]:
    """`params.n` trajectories per prompt from one `generate` call, in prompt order."""
    start = time.perf_counter()
    completions = engine.generate([p.ids for p in prompts], params)
    timings = {"rollout": time.perf_counter() - start}
    groups = [Group(sample=p.sample, trajectories=[]) for p in prompts]
    for c in completions:
        groups[c.prompt_index].trajectories.append(Trajectory.from_completion(
            prompts[c.prompt_index], c, decode, engine.version, dict(timings)))
    return groups


class RolloutStage:
    """Both rollout paths and the scoring overlap. `fetch(k)`: k more prompts for partial
    rollouts' over-provisioning (scheduler path only). `episodes`: tasks with an
    environment roll out multi-turn episodes through it instead (rollout/episodes.py; the
    environment scores them, so `scorer` is then `keep_env_rewards`)."""

    def __init__(self, engine: Engine, sampling: SamplingParams,
                 decode: Callable[[list[int]], str], scorer: Scorer, *,
                 scheduler: RolloutScheduler | None = None,
                 fetch: Callable[[int], list[EncodedPrompt]] | None = None,
                 episodes: EpisodeRunner | None = None):
        self.engine, self.sampling, self.decode = engine, sampling, decode
        self.scheduler, self.fetch = scheduler, fetch
        self.episodes = episodes
        self._figures: list[RolloutFigures] = []  # this step's rounds
        self._episode_figures: list[EpisodeFigures] = []
        self._ahead = ScoreAhead(scorer)
        self.slots = WeightSlots(PLACEMENT, engine.version)  # the publication protocol

    @property
    def scorer(self) -> Scorer:
        """Scores trajectories in place (the reward pool's, or the reward actor's)."""
        return self._ahead.scorer

    @scorer.setter
    def scorer(self, scorer: Scorer) -> None:
        self._ahead.scorer = scorer

    def run(self, prompts: list[EncodedPrompt], sizes: list[int]) -> list[Group]:
        """Groups for `prompts` (`sizes[i]` samples for prompt i). The scheduler's strategy
        decides which come back (partial: possibly pooled groups of earlier steps in place
        of some asked for); plain generation makes one call per distinct size, in order."""
        if self.episodes is not None:
            groups, figures, counts = self.episodes.run(prompts, sizes)
            self._figures.append(figures)
            self._episode_figures.append(counts)
            return groups
        if self.scheduler is not None:
            report = self.scheduler.run(prompts, self.fetch, sizes=sizes,
                                        on_group=self._ahead.start)
            self._figures.append(report.figures)
            return report.groups
        by_n: dict[int, list[int]] = {}
        for i, n in enumerate(sizes):
            by_n.setdefault(n, []).append(i)
        groups: list[Group] = [None] * len(prompts)  # type: ignore[list-item]
        for n, rows in by_n.items():
            out = generate_groups(self.engine, [prompts[i] for i in rows],
                                  replace(self.sampling, n=n), self.decode)
            for i, g in zip(rows, out):
                groups[i] = g
        return groups

    def score(self, groups: list[Group]) -> RewardStats:
        """Every trajectory of `groups` scored: started ones collected (torch releases the
        GIL while the engine decodes, so they scored meanwhile), the rest scored now."""
        return self._ahead.collect(groups)

    def metrics(self) -> dict[str, float]:
        """The scheduler's figures over this step's rounds ({} on the plain path); resets."""
        rounds, self._figures = self._figures, []
        episodes, self._episode_figures = self._episode_figures, []
        out = sum(rounds, RolloutFigures()).metrics() if rounds else {}
        return out | (sum(episodes, EpisodeFigures()).metrics() if episodes else {})

    def take_figures(self) -> list[RolloutFigures]:
        """The scheduler's figures of this step's rounds, as records that add (a driver
        that sums several workers' rounds); resets, as `metrics` does."""
        rounds, self._figures = self._figures, []
        return rounds

    @property
    def version(self) -> int:
        return self.engine.version

    def stage(self, weights: Published) -> None:
        """On the trainer's thread, while its tensors hold still: an engine that owns its
        weights takes its converted copy (kept as the staged handle); one that reads or
        converts the parameters at activation takes nothing. Tokens keep the active
        version until `activate`."""
        self.slots.stage(weights, self._take)

    def _take(self, weights: Published) -> Published:
        take = getattr(self.engine, "take", None)
        taken = take() if take is not None else None
        return weights if taken is None else replace(weights, handle=taken)

    def activate(self, version: int) -> None:
        """At a step boundary: the engine installs the staged weights (its copy, or the
        parameters as they are) and later tokens carry `version`."""
        self.slots.activate(version, self._install)

    def _install(self, weights: Published) -> None:
        if weights.handle is not None:
            self.engine.publish(weights.version, weights.handle)
        else:
            self.engine.publish(weights.version)

    def publish(self, weights: Published) -> None:
        """Stage and activate at once (no step runs in between)."""
        self.stage(weights)
        self.activate(weights.version)

    def close(self) -> None:
        """Stop the scoring thread (started again if the stage is used after)."""
        self._ahead.close()

    def state_dict(self) -> dict[str, Any] | None:
        """The scheduler's partial pool and reuse cache; None on the plain path."""
        return self.scheduler.state_dict() if self.scheduler is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scheduler is not None and state is not None:
            self.scheduler.load_state_dict(state)

