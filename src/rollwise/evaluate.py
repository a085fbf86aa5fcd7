"""Evaluation: greedy accuracy and unbiased pass@k on held-out prompts."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from math import comb
from typing import Any

from rollwise.engine.base import Engine, SamplingParams
from rollwise.observe import progress_bar
from rollwise.rewards import RewardPool
from rollwise.rollout import generate_groups
from rollwise.types import EncodedPrompt, Group


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 - C(n-c,k)/C(n,k).

    >>> pass_at_k(4, 1, 1), pass_at_k(4, 0, 2), pass_at_k(4, 3, 2)
    (0.25, 0.0, 1.0)
    """
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclass
class Evaluator:
    """Scores a policy on fixed held-out prompts with the task's correctness verifier."""

    engine: Engine
    prompts: list[EncodedPrompt]
    pool: RewardPool  # correctness only: accuracy is the fraction scored 1
    decode: Callable[[list[int]], str]
    max_tokens: int
    pass_k: int = 0
    pass_samples: int = 8
    temperature: float = 1.0
    chunk: int = 64  # prompts per generate call (the progress bar advances per call)

    def _generate(self, params: SamplingParams, label: str) -> list[Group]:
        """Groups for every held-out prompt, `chunk` prompts per call, with a progress bar."""
        groups: list[Group] = []
        with progress_bar(len(self.prompts), label) as bar:
            for i in range(0, len(self.prompts), self.chunk):
                part = self.prompts[i: i + self.chunk]
                groups += generate_groups(self.engine, part, params, self.decode)
                bar.advance(len(part))
        return groups

    def __call__(self) -> dict[str, float]:
        start = time.perf_counter()
        greedy = self._generate(SamplingParams(n=1, temperature=0.0, max_tokens=self.max_tokens),
                                "evaluating (greedy)")
        trajs = [t for g in greedy for t in g.trajectories]
        self.pool.score(trajs)
        out = {
            "accuracy": sum(t.reward >= 1.0 for t in trajs) / len(trajs),
            "num_prompts": float(len(trajs)),
            "mean_response_len": sum(t.num_tokens for t in trajs) / len(trajs),
        }
        if self.pass_k:
            out[f"pass@{self.pass_k}"] = self._pass_at_k()
        out["seconds"] = time.perf_counter() - start
        return out

    def _pass_at_k(self) -> float:
        params = SamplingParams(n=self.pass_samples, temperature=self.temperature,
                                max_tokens=self.max_tokens)
        groups = self._generate(params, f"evaluating (pass@{self.pass_k})")
        self.pool.score([t for g in groups for t in g.trajectories])
        scores = [pass_at_k(len(g.trajectories), sum(r >= 1.0 for r in g.rewards), self.pass_k)
                  for g in groups]
        return sum(scores) / len(scores)


@dataclass
class EpisodeEvaluator:
    """Held-out success of a task with an environment: one greedy episode per prompt
    through an episode runner (rollout/episodes.py); accuracy is the share solved."""

    runner: Any  # EpisodeRunner over the evaluation engine
    prompts: list[EncodedPrompt]
    max_tokens: int
    chunk: int = 64

    def __call__(self) -> dict[str, float]:
        start = time.perf_counter()
        params = SamplingParams(n=1, temperature=0.0, max_tokens=self.max_tokens)
        trajs = []
        with progress_bar(len(self.prompts), "evaluating (episodes)") as bar:
            for i in range(0, len(self.prompts), self.chunk):
                part = self.prompts[i: i + self.chunk]
                groups, _, _ = self.runner.run(part, [1] * len(part), params)
                trajs += [t for g in groups for t in g.trajectories]
                bar.advance(len(part))
        return {"accuracy": sum(t.correct for t in trajs) / len(trajs),
                "num_prompts": float(len(trajs)),
                "mean_response_len": sum(sum(t.sampled_mask) for t in trajs) / len(trajs),
                "mean_turns": sum(t.num_turns for t in trajs) / len(trajs),
                "mean_reward": sum(t.reward for t in trajs) / len(trajs),
                "seconds": time.perf_counter() - start}
