"""Outcome-level advantage estimators: fn(rewards [N], group_ids [N], **options) -> [N].

Every estimator sees the flat batch of rewards and the group each one belongs to, so a
group need not be contiguous and groups may differ in size.
"""

from __future__ import annotations

import torch

from rollwise.algos.registry import advantage_estimators, register


def group_stats(values: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row mean and unbiased std of the row's group ([N] each); std is 0 for a group of 1."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    values = values.double()
    sums = torch.zeros(len(counts), dtype=values.dtype).index_add_(0, inverse, values)
    mean = sums / counts
    sq = torch.zeros_like(sums).index_add_(0, inverse, (values - mean[inverse]) ** 2)
    var = sq / (counts - 1).clamp(min=1)
    return mean[inverse], var.sqrt()[inverse]


@register(advantage_estimators, "grpo")
def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """GRPO (DeepSeekMath, arXiv 2402.03300): A_i = (r_i - mean_g(r)) / (std_g(r) + eps).

    std is the unbiased group standard deviation; a zero-variance group gets A = 0.
    """
    mean, std = group_stats(rewards, group_ids)
    return ((rewards.double() - mean) / (std + eps)).to(rewards.dtype)
