"""Advantage estimators that reshape a group baseline with more than the rewards: a fixed
anchor (PVPO), the policy's confidence in each rollout (ACE, XRPO's sharpening) or how rare
a correct rollout's solution is in its group (uniqueness-aware). Same signature as
algos/advantages.py; the inputs they take (`logprobs`, `input_ids`, `ref_values`, `mask`)
are fields of `AdvantageInputs`.

Readings of papers known from their abstracts only (docs/algorithms.md says the same):
ACE's confidence shift is taken against the group, not a reference model (the estimators get
no reference log-probs); XRPO's sharpening bonus and the uniqueness weight's exponent and
normalisation are reconstructions; uniqueness clusters by token n-gram overlap, a
programmatic stand-in for the paper's LLM judge.
"""

from __future__ import annotations

import torch

from rollwise.algos.advantages import _groups, group_stats, grpo
from rollwise.algos.inputs import uses
from rollwise.algos.registry import advantage_estimators, register


def mean_logprob(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] length-normalised sequence log-likelihood: the mean behaviour log-prob over each
    row's response tokens (0 for a row without any)."""
    m = mask.double()
    return (logprobs.double() * m).sum(-1) / m.sum(-1).clamp(min=1)


@register(advantage_estimators, "pvpo")
@uses("ref_values")
def pvpo(rewards: torch.Tensor, group_ids: torch.Tensor, *,
         ref_values: torch.Tensor | None = None) -> torch.Tensor:
    """PVPO (arXiv 2508.21104): the baseline is a fixed anchor, the prompt's value under a
    reference policy, instead of the group's own mean:

        A_i = r_i - V_ref(x)     V_ref = ref_values_i (Sample.meta["ref_value"], e.g. the
                                 mean reward of reference rollouts); the group mean where
                                 it is missing (NaN), which is Dr. GRPO's advantage

    A group whose rewards all agree still has a signal wherever it differs from the anchor.
    """
    r = rewards.double()
    mean, _ = group_stats(r, group_ids)
    if ref_values is None:
        return (r - mean).to(rewards.dtype)
    anchor = ref_values.to(r)
    return (r - torch.where(torch.isfinite(anchor), anchor, mean)).to(rewards.dtype)


@register(advantage_estimators, "ace")
@uses("logprobs", "mask")
def ace(rewards: torch.Tensor, group_ids: torch.Tensor, *, logprobs: torch.Tensor,
        mask: torch.Tensor, alpha: float = 1.0, eps: float = 1e-6) -> torch.Tensor:
    """ACE, asymmetric confidence-aware error penalty (arXiv 2602.21420): a rollout with a
    negative advantage (an error) is penalised more the more confident the policy is in it.

        A_i = GRPO advantage;  l_i = mean_t log pi(y_it)  (behaviour log-probs)
        c_i = l_i - mean_g(l)                  confidence shift (reference: the group)
        A'_i = A_i (1 + alpha softplus(c_i))   if A_i < 0;  A'_i = A_i otherwise

    The paper's c_i = log pi_theta(y_i)/pi_ref(y_i) needs reference log-probs, which no
    estimator receives here; the group's mean length-normalised log-likelihood stands in for
    the reference (see docs/algorithms.md).
    """
    base = grpo(rewards, group_ids, eps=eps).double()
    ell = mean_logprob(logprobs, mask)
    shift = ell - group_stats(ell, group_ids)[0]
    factor = 1 + alpha * torch.nn.functional.softplus(shift)
    return torch.where(base < 0, base * factor, base).to(rewards.dtype)


@register(advantage_estimators, "xrpo")
@uses("logprobs", "mask")
def xrpo(rewards: torch.Tensor, group_ids: torch.Tensor, *, logprobs: torch.Tensor,
         mask: torch.Tensor, lam: float = 1.0, correct_threshold: float = 0.5,
         eps: float = 1e-6) -> torch.Tensor:
    """XRPO's novelty-aware advantage sharpening (arXiv 2510.06672): a correct rollout the
    policy found unlikely, relative to its group, gets a bonus.

        A_i = GRPO advantage;  l_i = mean_t log pi(y_it)  (behaviour log-probs)
        A'_i = A_i + lam max(0, mean_g(l) - l_i)   if r_i >= correct_threshold
        A'_i = A_i                                 otherwise

    The bonus also reaches a group that is correct throughout (GRPO gives it 0). Its form
    is a reconstruction from the abstract (docs/algorithms.md).
    """
    base = grpo(rewards, group_ids, eps=eps).double()
    ell = mean_logprob(logprobs, mask)
    novelty = (group_stats(ell, group_ids)[0] - ell).clamp(min=0)
    correct = rewards.detach() >= correct_threshold
    return torch.where(correct, base + lam * novelty, base).to(rewards.dtype)


def ngrams(tokens: list[int], n: int) -> frozenset:
    """The set of token n-grams of a response (the whole response when shorter than n)."""
    if len(tokens) < n:
        return frozenset([tuple(tokens)])
    return frozenset(tuple(tokens[k: k + n]) for k in range(len(tokens) - n + 1))


def cluster_sizes(sets: list[frozenset], similarity: float) -> list[int]:
    """For each set, the size of its cluster: sets are linked when their Jaccard overlap
    |a & b| / |a | b| is at least `similarity`, clusters are the linked components.

    >>> cluster_sizes([frozenset({1, 2}), frozenset({1, 2}), frozenset({3})], 0.5)
    [2, 2, 1]
    """
    parent = list(range(len(sets)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for i in range(len(sets)):
        for j in range(i):
            union = len(sets[i] | sets[j])
            if union and len(sets[i] & sets[j]) / union >= similarity:
                parent[root(i)] = root(j)
    roots = [root(i) for i in range(len(sets))]
    return [roots.count(r) for r in roots]


@register(advantage_estimators, "uniqueness")
@uses("input_ids", "mask")
def uniqueness(rewards: torch.Tensor, group_ids: torch.Tensor, *, input_ids: torch.Tensor,
               mask: torch.Tensor, alpha: float = 1.0, ngram: int = 3,
               similarity: float = 0.5, correct_threshold: float = 0.5,
               eps: float = 1e-6) -> torch.Tensor:
    """Uniqueness-aware RL, "rewarding the rare" (arXiv 2601.08763): the correct rollouts of
    a group are clustered by solution, and a correct rollout's positive advantage is
    reweighted inversely with its cluster's size.

        A_i = GRPO advantage;  P = {i in group : r_i >= correct_threshold}
        clusters of P: responses whose token `ngram`-gram sets overlap (Jaccard) by at least
        `similarity`, linked transitively;  |C(i)| the size of i's cluster
        w_i = |C(i)|^-alpha / mean_{j in P} |C(j)|^-alpha
        A'_i = A_i w_i  for i in P with A_i > 0;  A'_i = A_i otherwise

    The weights have mean 1 over P, so the group's positive mass moves to rare solutions.
    """
    base = grpo(rewards, group_ids, eps=eps).double()
    factor = torch.ones_like(base)
    correct = rewards.detach() >= correct_threshold
    for rows in _groups(group_ids):
        pos = rows[correct[rows]]
        if len(pos) < 2:
            continue
        sets = [ngrams(input_ids[i][mask[i] > 0].tolist(), ngram) for i in pos.tolist()]
        sizes = torch.tensor(cluster_sizes(sets, similarity), dtype=torch.float64,
                             device=base.device)
        w = sizes.pow(-alpha)
        w = w / w.mean()
        factor[pos] = torch.where(base[pos].detach() > 0, w, torch.ones_like(w))
    return (base * factor).to(rewards.dtype)
