"""Policy losses: fn(logprobs [N,T], old_logprobs [N,T], advantages [N] | [N,T], mask [N,T],
**options) -> (loss: scalar Tensor, metrics: dict[str, float]).

`num_tokens` / `num_seqs` (optional) are the totals over the whole batch when the caller
splits it into micro-batches: the micro-batch losses then add up to the full-batch loss.
"""

from __future__ import annotations

import torch

from rollwise.algos.registry import policy_losses, register


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str,
              num_tokens: float | None = None, num_seqs: float | None = None,
              max_tokens: float | None = None) -> torch.Tensor:
    """Reduce [N, T] token losses to a scalar.

    token-mean:               sum(l * m) / total tokens            (DAPO; verl "token-mean")
    seq-mean-token-mean:      mean over sequences of (sum_t l*m / |o_i|)   (GRPO paper)
    seq-mean-token-sum-norm:  sum(l * m) / (N * max_tokens)         (Dr. GRPO's constant)
    """
    mask = mask.to(per_token.dtype)
    if mode == "token-mean":
        return (per_token * mask).sum() / (num_tokens or mask.sum().clamp(min=1))
    if mode == "seq-mean-token-mean":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / (num_seqs or per_token.shape[0])
    if mode == "seq-mean-token-sum-norm":
        norm = max_tokens or per_token.shape[1]
        return (per_token * mask).sum() / ((num_seqs or per_token.shape[0]) * norm)
    raise ValueError(f"unknown aggregation '{mode}'; use token-mean, seq-mean-token-mean "
                     "or seq-mean-token-sum-norm")


@register(policy_losses, "ppo")
def ppo_clip(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, *, clip_low: float = 0.2, clip_high: float = 0.2,
             aggregation: str = "token-mean", num_tokens: float | None = None,
             num_seqs: float | None = None, max_tokens: float | None = None,
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017) as used by GRPO, with DAPO's asymmetric
    clip (clip_high > clip_low, arXiv 2503.14476):

        rho = exp(logp - logp_old);  l_t = -min(rho * A, clip(rho, 1 - clip_low, 1 + clip_high) * A)
    """
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    log_ratio = (logprobs - old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    loss = aggregate(per_token, mask, aggregation, num_tokens, num_seqs, max_tokens)
    with torch.no_grad():
        m = mask.bool()
        n = max(int(m.sum()), 1)
        metrics = {
            "clip_frac": float(((clipped != unclipped) & m).sum()) / n,
            "ratio_mean": float(ratio[m].mean()) if m.any() else 1.0,
            "ratio_max": float(ratio[m].max()) if m.any() else 1.0,
        }
    return loss, metrics
