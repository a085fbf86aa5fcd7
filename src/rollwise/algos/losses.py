"""Policy losses: fn(logprobs [N,T], old_logprobs [N,T], advantages [N] | [N,T], mask [N,T],
**options) -> (loss: scalar Tensor, metrics: dict[str, float]).

Options every loss takes:
    clip_low, clip_high   ratio clip range [1 - clip_low, 1 + clip_high]
    aggregation           "token-mean" | "seq-mean-token-mean" | "seq-mean-token-sum-norm"
    weights [N,T]         optional per-token weight, detached (TIS/MIS corrections)
    num_tokens, num_seqs  totals over the whole batch when the caller splits it into
                          micro-batches: the micro-batch losses then add up to the full loss
    max_tokens            the constant of "seq-mean-token-sum-norm" (the generation budget)

A loss decorated `@zero_at_zero_advantage` declares that a token's loss and gradient are 0
where its advantage is 0 (zero-advantage rows then cost the learner nothing; see the registry).

The entropy bonus and the KL penalty are added by the learner, the same way for every loss.
"""

from __future__ import annotations

import torch

from rollwise.algos.registry import policy_losses, register, zero_at_zero_advantage

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


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
    raise ValueError(f"unknown aggregation '{mode}'; use one of {', '.join(AGGREGATIONS)}")


def _finish(per_token: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None,
            aggregation: str, totals: tuple, ratio: torch.Tensor, clipped: torch.Tensor,
            **extra: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Weight, aggregate, and report ratio metrics over response tokens."""
    if weights is not None:
        per_token = per_token * weights.detach()
    loss = aggregate(per_token, mask, aggregation, *totals)
    with torch.no_grad():
        m = mask.bool()
        n = max(int(m.sum()), 1)
        metrics = {
            "clip_frac": float((clipped & m).sum()) / n,
            "ratio_mean": float(ratio[m].mean()) if m.any() else 1.0,
            "ratio_max": float(ratio[m].max()) if m.any() else 1.0,
            **extra,
        }
    return loss, metrics


@register(policy_losses, "ppo")
@zero_at_zero_advantage
def ppo_clip(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, *, clip_low: float = 0.2, clip_high: float = 0.2,
             dual_clip: float | None = None, aggregation: str = "token-mean",
             weights: torch.Tensor | None = None, num_tokens: float | None = None,
             num_seqs: float | None = None, max_tokens: float | None = None,
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017) as used by GRPO, with DAPO's asymmetric
    clip (clip_high > clip_low, arXiv 2503.14476) and optional dual clip (Ye et al. 2020,
    arXiv 1912.09729) that bounds the loss of negative advantages at large ratios:

        rho = exp(logp - logp_old);  o_t = min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A)
        dual clip (c > 1):  o_t = max(o_t, c A) where A < 0;   l_t = -w_t o_t
    """
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (got {dual_clip}); typical is 3")
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    ratio = torch.exp((logprobs - old_logprobs) * mask)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    objective = torch.minimum(unclipped, clipped)
    extra = {}
    if dual_clip is not None:
        floor = dual_clip * adv
        dual = (adv < 0) & (objective < floor)
        objective = torch.where(dual, floor, objective)
        extra["dual_clip_frac"] = float((dual & mask.bool()).sum()) / max(int(mask.sum()), 1)
    return _finish(-objective, mask, weights, aggregation, (num_tokens, num_seqs, max_tokens),
                   ratio.detach(), (clipped != unclipped).detach(), **extra)


@register(policy_losses, "gspo")
@zero_at_zero_advantage
def gspo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
         mask: torch.Tensor, *, clip_low: float = 3e-4, clip_high: float = 4e-4,
         aggregation: str = "seq-mean-token-mean", weights: torch.Tensor | None = None,
         num_tokens: float | None = None, num_seqs: float | None = None,
         max_tokens: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al., arXiv 2507.18071), in its GSPO-token form:

        s_i = exp(1/|o_i| sum_t (logp_t - logp_old_t))          (sequence ratio)
        s_it = sg[s_i] * exp(logp_t - sg[logp_t])                (value s_i, grad s_i dlogp_t)
        l_t = -w_t min(s_it A_it, clip(s_it, 1 - clip_low, 1 + clip_high) A_it)

    With aggregation "seq-mean-token-mean" and one advantage per sequence this is exactly the
    sequence objective 1/G sum_i min(s_i A_i, clip(s_i) A_i) of the paper, value and
    gradient. The paper's clip range is 3e-4 / 4e-4.
    """
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    m = mask.to(logprobs.dtype)
    log_s = ((logprobs - old_logprobs) * m).sum(-1) / m.sum(-1).clamp(min=1)  # [N]
    seq_ratio = torch.exp(log_s.detach())[:, None]
    ratio = seq_ratio * torch.exp(logprobs - logprobs.detach())  # [N, T], value s_i
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    return _finish(per_token, mask, weights, aggregation, (num_tokens, num_seqs, max_tokens),
                   seq_ratio.expand_as(ratio), (clipped != unclipped).detach())


@register(policy_losses, "cispo")
@zero_at_zero_advantage
def cispo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
          mask: torch.Tensor, *, clip_low: float = 1.0, clip_high: float = 0.28,
          aggregation: str = "token-mean", weights: torch.Tensor | None = None,
          num_tokens: float | None = None, num_seqs: float | None = None,
          max_tokens: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update, so
    every token keeps a gradient:

        rho = exp(logp - logp_old);  l_t = -w_t sg[clip(rho, 1 - clip_low, 1 + clip_high)] A logp_t

    MiniMax-M1 sets no lower bound (clip_low = 1 here: the weight is only kept >= 0) and
    tunes the upper one; 0.28 (DAPO's clip-higher value) is this library's default guess.
    """
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    ratio = torch.exp((logprobs - old_logprobs) * mask).detach()
    weight = ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = -weight * adv * logprobs
    return _finish(per_token, mask, weights, aggregation, (num_tokens, num_seqs, max_tokens),
                   ratio, weight != ratio)
