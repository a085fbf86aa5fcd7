"""Evaluation as the field reports it: pass@1 (greedy), mean@k and unbiased pass@k on held-out
prompts, overall and per task of a mixture.

- pass@1 (greedy) = `accuracy`: the share of prompts whose greedy completion scores 1.
- `mean_score`: the mean greedy score (partial credit counts, e.g. tests passed / tests).
- with eval.pass_k = k > 0: n = eval.pass_samples samples per prompt at the rollout
  temperature; mean@n = their mean score; pass@k = the unbiased estimator
  1 - C(n - c, k) / C(n, k) with c = samples scoring 1 (Chen et al. 2021), averaged.
- per task: keys ``task/<label>/<metric>`` for each label when there is more than one; the
  label is the sample's evaluation task (eval.tasks) and, in a reasoning-gym mixture, its
  source dataset (``reasoning_gym/chain_sum``). `task_table` turns them into rows.
"""

from __future__ import annotations

import time
from collections import defaultdict
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
        stats = self.pool.score(trajs)
        out = {
            "accuracy": sum(t.reward >= 1.0 for t in trajs) / len(trajs),
            "mean_score": sum(t.reward for t in trajs) / len(trajs),
            "num_prompts": float(len(trajs)),
            "mean_response_len": sum(t.num_tokens for t in trajs) / len(trajs),
        }
        if stats.num_errors or stats.num_timeouts or stats.num_infra:
            out["reward_failures"] = float(stats.num_errors + stats.num_timeouts
                                           + stats.num_infra)
        by_label: dict[str, list] = defaultdict(list)
        for g in greedy:
            by_label[task_label(g.sample)].append(g)
        sampled = self._sampled() if self.pass_k else None
        if sampled is not None:
            out.update(self._sampled_metrics(sampled))
        if len(by_label) > 1:
            sampled_by: dict[str, list] = defaultdict(list)
            for g in sampled or []:
                sampled_by[task_label(g.sample)].append(g)
            for label, groups in sorted(by_label.items()):
                rewards = [t.reward for g in groups for t in g.trajectories]
                out[f"task/{label}/n"] = float(len(rewards))
                out[f"task/{label}/pass@1"] = sum(r >= 1.0 for r in rewards) / len(rewards)
                out[f"task/{label}/mean@1"] = sum(rewards) / len(rewards)
                if sampled_by.get(label):
                    out.update({f"task/{label}/{k}": v for k, v in
                                self._sampled_metrics(sampled_by[label]).items()})
        out["seconds"] = time.perf_counter() - start
        return out

    def _sampled(self) -> list[Group]:
        params = SamplingParams(n=self.pass_samples, temperature=self.temperature,
                                max_tokens=self.max_tokens)
        groups = self._generate(params, f"evaluating (pass@{self.pass_k})")
        self.pool.score([t for g in groups for t in g.trajectories])
        return groups

    def _sampled_metrics(self, groups: list[Group]) -> dict[str, float]:
        """mean@n and unbiased pass@k over sampled groups."""
        k, n = self.pass_k, self.pass_samples
        passes = [pass_at_k(len(g.trajectories), sum(r >= 1.0 for r in g.rewards), k)
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


def task_table(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows {task, n, pass@1, mean@1, ...} from an evaluation result's ``task/...`` keys
    (one row, "all", when there is a single task).

    >>> task_table({"task/a/n": 2.0, "task/a/pass@1": 0.5, "accuracy": 0.5})
    [{'task': 'a', 'n': 2.0, 'pass@1': 0.5}]
    """
    rows: dict[str, dict[str, Any]] = {}
    for key, value in result.items():
        if key.startswith("task/"):
            label, _, metric = key[5:].rpartition("/")
            rows.setdefault(label, {"task": label})[metric] = value
    if not rows:
        row = {"task": "all", "n": result.get("num_prompts"), "pass@1": result.get("accuracy"),
               "mean@1": result.get("mean_score")}
        row |= {k: v for k, v in result.items() if k.startswith(("pass@", "mean@"))}
        return [row]
    return list(rows.values())


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
