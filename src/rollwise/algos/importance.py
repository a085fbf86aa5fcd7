"""Off-policy corrections between the learner and the rollout engine (TIS / MIS):
fn(old_logprobs [N,T], behaviour_logprobs [N,T], mask [N,T], **options)
    -> (weights [N,T], metrics: dict[str, float])

`old_logprobs` are the learner's log-probs of the sampled tokens before the update
(log pi_train), `behaviour_logprobs` those the engine recorded while sampling (log
pi_rollout). They differ when the engine runs at lower precision, or when tokens were sampled
by an older policy version (partial rollouts, asynchronous training). The weights multiply
the per-token policy-gradient loss; they carry no gradient and are 0 off the mask. With
identical policies every weight is 1.

    log r_t = log pi_train(y_t) - log pi_rollout(y_t), clamped to [-20, 20]

Metrics: weight_mean / weight_max over response tokens (over sequences for the sequence
modes), clipped_frac (TIS: share capped; MIS: share rejected), ess = 1 / mean((w/mean w)^2)
in (0, 1], and kl / kl_k1: the k3 and k1 estimates of KL(pi_rollout || pi_train) per token.
Formulas follow verl's rollout_corr_helper (docs/precision.md, docs/rollout.md).
"""

from __future__ import annotations

import torch

from rollwise.algos.registry import corrections, register

_LOG_CLAMP = 20.0


def _log_ratio(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
    return ((old_logprobs.detach() - behaviour_logprobs.detach()) * mask).clamp(
        -_LOG_CLAMP, _LOG_CLAMP)


def _metrics(weights: torch.Tensor, valid: torch.Tensor, changed: torch.Tensor,
             log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """weights/valid/changed are over the units that were weighted (tokens or sequences)."""
    m = mask.bool()
    w = weights[valid]
    lr = log_ratio[m]
    if w.numel() == 0:
        return {"weight_mean": 1.0, "weight_max": 1.0, "clipped_frac": 0.0, "ess": 1.0,
                "kl": 0.0, "kl_k1": 0.0}
    mean = w.mean()
    ess = 1.0 / float(((w / mean) ** 2).mean()) if float(mean) > 0 else 0.0
    return {
        "weight_mean": float(mean), "weight_max": float(w.max()),
        "clipped_frac": float(changed[valid].float().mean()), "ess": ess,
        "kl": float((lr.exp() - 1 - lr).mean()), "kl_k1": float((-lr).mean()),
    }


@register(corrections, "tis")
def tis(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, *,
        cap: float = 2.0, low: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Token TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"): w_t = min(exp(log r_t), cap). `low` is not used."""
    del low
    lr = _log_ratio(old_logprobs, behaviour_logprobs, mask)
    raw = lr.exp()
    w = raw.clamp(max=cap) * mask
    return w, _metrics(w, mask.bool(), raw > cap, lr, mask)


@register(corrections, "mis")
def mis(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, *,
        cap: float = 2.0, low: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Token MIS / rejection sampling (Liu et al. 2025, "When Speed Kills Stability"):
    w_t = 1 if low <= r_t <= cap else 0, with low = 1 / cap by default."""
    lo = 1.0 / cap if low is None else low
    lr = _log_ratio(old_logprobs, behaviour_logprobs, mask)
    raw = lr.exp()
    keep = (raw >= lo) & (raw <= cap)
    w = keep.to(mask.dtype) * mask
    return w, _metrics(w, mask.bool(), ~keep, lr, mask)


def _sequence(old_logprobs, behaviour_logprobs, mask):
    lr = _log_ratio(old_logprobs, behaviour_logprobs, mask)
    seq = lr.sum(-1).clamp(-_LOG_CLAMP, _LOG_CLAMP).exp()  # [N] prod_t r_t
    return lr, seq, mask.sum(-1) > 0


@register(corrections, "tis_seq")
def tis_seq(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
            *, cap: float = 2.0, low: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Sequence TIS: w_i = min(prod_t r_t, cap), the same weight on every token of row i
    (unbiased before the cap, high variance on long responses). `low` is not used."""
    del low
    lr, seq, rows = _sequence(old_logprobs, behaviour_logprobs, mask)
    w_seq = seq.clamp(max=cap)
    return w_seq[:, None] * mask, _metrics(w_seq, rows, seq > cap, lr, mask)


@register(corrections, "mis_seq")
def mis_seq(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
            *, cap: float = 2.0, low: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Sequence MIS: keep row i (w = 1) iff low <= prod_t r_t <= cap (low = 1/cap by
    default), else mask the whole row (w = 0)."""
    lo = 1.0 / cap if low is None else low
    lr, seq, rows = _sequence(old_logprobs, behaviour_logprobs, mask)
    keep = (seq >= lo) & (seq <= cap)
    w_seq = keep.to(mask.dtype)
    return w_seq[:, None] * mask, _metrics(w_seq, rows, ~keep, lr, mask)
