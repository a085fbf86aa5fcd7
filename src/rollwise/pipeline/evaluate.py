"""Evaluation as the field reports it: pass@1 (greedy), mean@k and unbiased pass@k on held-out
prompts, overall and per task of a mixture.

- pass@1 (greedy) = `accuracy`: the share of prompts whose greedy completion scores 1.
- `mean_score`: the mean greedy score (partial credit counts, e.g. tests passed / tests).
- with eval.pass_k = k > 0: n = eval.pass_samples samples per prompt at the rollout
  temperature; mean@n = their mean score; pass@k = the unbiased estimator
  1 - C(n - c, k) / C(n, k) with c = samples scoring 1 (Chen et al. 2021), averaged.
- per task: keys ``task/<label>/<metric>`` for each label when there is more than one; the
  label is the sample's evaluation task (eval.tasks) and, in a reasoning-gym mixture, its
  source dataset (``reasoning_gym/chain_sum``). `observe.metrics.task_table` makes them
  rows.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from math import comb
from typing import Any, Protocol

from rollwise.engine.base import Engine, SamplingParams, release_cache
from rollwise.observe import progress_bar
from rollwise.rewards import RewardPool, RewardStats
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


class Rollouts(Protocol):
    """How the evaluator rolls out held-out prompts: groups scored, and the scoring's counts."""

    def __call__(self, prompts: list[EncodedPrompt],
                 params: SamplingParams) -> tuple[list[Group], RewardStats]: ...


@dataclass
class Generated:
    """Single-turn tasks: batched generation, scored by the evaluation reward pool (the
    task's correctness verifier, as the term `correct`)."""

    engine: Engine
    pool: RewardPool
    decode: Callable[[list[int]], str]

    def __call__(self, prompts: list[EncodedPrompt],
                 params: SamplingParams) -> tuple[list[Group], RewardStats]:
        groups = generate_groups(self.engine, prompts, params, self.decode)
        return groups, self.pool.score([t for g in groups for t in g.trajectories])


@dataclass
class Episodes:
    """Tasks with an environment: episodes through an episode runner over the evaluation
    engine (rollout/episodes.py); the environment scores them."""

    runner: Any  # EpisodeRunner

    def __call__(self, prompts: list[EncodedPrompt],
                 params: SamplingParams) -> tuple[list[Group], RewardStats]:
        groups, _, _ = self.runner.run(prompts, [params.n] * len(prompts), params)
        return groups, RewardStats(0, 0, 0, 0.0)


@dataclass
class Evaluator:
    """Scores a policy on fixed held-out prompts. One definition of solved for every task:
    `Trajectory.correct` (the task's verifier term scored 1), whether the prompts are
    rolled out as single responses or as episodes."""

    engine: Engine  # the evaluation engine (`publish` follows the driver's weights)
    rollouts: Rollouts  # `Generated` or `Episodes` over `engine`
    prompts: list[EncodedPrompt]
    max_tokens: int
    pass_k: int = 0
    pass_samples: int = 8
    temperature: float = 1.0
    chunk: int = 64  # prompts per call (the progress bar advances per call)

    def publish(self, version: int) -> None:
        """The driver's policy now holds `version` (weights trained in another process)."""
        self.engine.publish(version)

    def _roll(self, params: SamplingParams, label: str) -> tuple[list[Group], RewardStats]:
        """Groups for every held-out prompt, `chunk` prompts per call, with a progress bar."""
        groups: list[Group] = []
        stats = RewardStats(0, 0, 0, 0.0)
        with progress_bar(len(self.prompts), label) as bar:
            for i in range(0, len(self.prompts), self.chunk):
                part = self.prompts[i: i + self.chunk]
                out, counts = self.rollouts(part, params)
                groups, stats = groups + out, stats + counts
                bar.advance(len(part))
        return groups, stats

    def __call__(self) -> dict[str, float]:
        start = time.perf_counter()
        greedy, stats = self._roll(
            SamplingParams(n=1, temperature=0.0, max_tokens=self.max_tokens), "evaluating (greedy)")
        trajs = [t for g in greedy for t in g.trajectories]
        out = {
            "accuracy": sum(t.correct for t in trajs) / len(trajs),
            "mean_score": sum(t.reward for t in trajs) / len(trajs),
            "num_prompts": float(len(trajs)),
            "mean_response_len": sum(sum(t.sampled_mask) for t in trajs) / len(trajs),
        }
        if any(t.turns for t in trajs):  # episodes
            out["mean_turns"] = sum(t.num_turns for t in trajs) / len(trajs)
            out["multi_turn"] = sum(t.num_turns > 1 for t in trajs) / len(trajs)
        if stats.num_errors or stats.num_timeouts or stats.num_infra:
            out["reward_failures"] = float(stats.num_errors + stats.num_timeouts
                                           + stats.num_infra)
        sampled = self._sampled() if self.pass_k else None
        if sampled is not None:
            out.update(self._sampled_metrics(sampled))
        out.update(self._per_task(greedy, sampled or []))
        release_cache(self.engine)  # idle until the next evaluation, under new weights
        out["seconds"] = time.perf_counter() - start
        return out

    def _per_task(self, greedy: list[Group], sampled: list[Group]) -> dict[str, float]:
        """``task/<label>/...`` figures when the prompts come from more than one task."""
        by_label: dict[str, list[Group]] = defaultdict(list)
        for g in greedy:
            by_label[task_label(g.sample)].append(g)
        if len(by_label) < 2:
            return {}
        sampled_by: dict[str, list[Group]] = defaultdict(list)
        for g in sampled:
            sampled_by[task_label(g.sample)].append(g)
        out: dict[str, float] = {}
        for label, groups in sorted(by_label.items()):
            trajs = [t for g in groups for t in g.trajectories]
            out[f"task/{label}/n"] = float(len(trajs))
            out[f"task/{label}/pass@1"] = sum(t.correct for t in trajs) / len(trajs)
            out[f"task/{label}/mean@1"] = sum(t.reward for t in trajs) / len(trajs)
            if sampled_by.get(label):
                out.update({f"task/{label}/{k}": v for k, v in
                            self._sampled_metrics(sampled_by[label]).items()})
        return out

    def _sampled(self) -> list[Group]:
        params = SamplingParams(n=self.pass_samples, temperature=self.temperature,
                                max_tokens=self.max_tokens)
        return self._roll(params, f"evaluating (pass@{self.pass_k})")[0]

    def _sampled_metrics(self, groups: list[Group]) -> dict[str, float]:
        """mean@n and unbiased pass@k over sampled groups."""
        k, n = self.pass_k, self.pass_samples
        passes = [pass_at_k(len(g.trajectories), sum(t.correct for t in g.trajectories), k)
                  for g in groups]
        means = [sum(g.rewards) / len(g.rewards) for g in groups]
        return {f"pass@{k}": sum(passes) / len(passes), f"mean@{n}": sum(means) / len(means)}


def task_label(sample) -> str:
    """The sample's task for per-task figures: its eval task, then its source dataset.

    >>> from rollwise.types import Sample
    >>> task_label(Sample("a", "q", "1", meta={"eval_task": "reasoning_gym",
    ...                                        "source_dataset": "chain_sum"}))
    'reasoning_gym/chain_sum'
    """
    task = sample.meta.get("eval_task") or sample.id.split("/")[0]
    source = sample.meta.get("source_dataset")
    return f"{task}/{source}" if source else task
