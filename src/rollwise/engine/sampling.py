"""Sampling shared by the engines: logit warping and counter-based random draws.

Each request owns a 64-bit seed; the uniform that picks its t-th token is a hash of
(seed, t). A request's output therefore depends only on its seed and the model, not on
which other requests share its batch, on preemption, or on abort and resume.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def derive_seed(base: int, index: int) -> int:
    """A well-mixed 63-bit seed for request `index` of a call seeded with `base`."""
    with np.errstate(over="ignore"):
        z = np.array([base], dtype=np.uint64) * _GOLDEN + np.uint64(index)
    return int(_splitmix(_splitmix(z))[0] >> np.uint64(1))


def uniforms(seeds: list[int], positions: list[int]) -> torch.Tensor:
    """[B] float64 uniforms in [0, 1): the draw for token `positions[b]` of request `seeds[b]`."""
    s = np.array(seeds, dtype=np.uint64)
    p = np.array(positions, dtype=np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):
        z = _splitmix(s + p * _GOLDEN)
    return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) * 2.0**-53)


def warp_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[B, V] logits -> [B, V] log-probs of the sampling distribution (-inf where truncated).

    Temperature 0 (greedy) leaves the logits unscaled.
    """
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.log_softmax(logits, dim=-1)


def sample_tokens(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                  u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row by inverting the CDF at `u`; returns (tokens [B], log-probs [B]).

    Temperature 0 takes the arg-max. The log-prob is that of the distribution sampled from.
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        picked = logits.gather(-1, tokens[:, None])[:, 0]
        return tokens, picked - torch.logsumexp(logits, -1)
    if top_k == 0 and top_p >= 1.0:
        probs = torch.softmax(logits / temperature if temperature != 1.0 else logits, -1)
    else:
        probs = warp_logits(logits, temperature, top_k, top_p).exp()
    tokens = inverse_cdf(probs, u.to(probs.device))
    return tokens, probs.gather(-1, tokens[:, None])[:, 0].log()


def draw(logits: torch.Tensor, settings: list[tuple[float, int, float]], seeds: list[int],
         positions: list[int]) -> dict[int, tuple[int, float]]:
    """Row i's token of `logits` [B, V] and its log-prob, under row i's (temperature, top_k,
    top_p) with the uniform of (seeds[i], positions[i]); rows alike are drawn together."""
    by_settings: dict[tuple, list[int]] = {}
    for i, s in enumerate(settings):
        by_settings.setdefault(s, []).append(i)
    out = {}
    for (temp, top_k, top_p), idx in by_settings.items():
        sub = logits if len(idx) == len(settings) else logits[idx]
        u = uniforms([seeds[i] for i in idx], [positions[i] for i in idx])
        tok, lp = sample_tokens(sub, temp, top_k, top_p, u)
        out.update(zip(idx, zip(tok.tolist(), lp.tolist())))
    return out


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, block: int = 256) -> torch.Tensor:
    """[B] indices i with cdf[i-1] <= u * total < cdf[i], through block sums (a full cumsum
    over a 50k vocabulary is sequential and slow). The chosen index always has mass > 0."""
    b, v = probs.shape
    nb = -(-v // block)
    padded = F.pad(probs, (0, nb * block - v)) if nb * block != v else probs
    blocks = padded.view(b, nb, block)
    sums = blocks.sum(-1)  # [B, nb]
    csum = sums.cumsum(-1)
    target = u.to(csum.dtype).clamp(max=1 - 1e-6) * csum[:, -1]
    k = torch.searchsorted(csum, target[:, None], right=True).clamp_(max=nb - 1)  # [B, 1]
    inner = blocks[torch.arange(b, device=probs.device), k[:, 0]]  # [B, block]
    icum = inner.cumsum(-1)
    rest = (target[:, None] - (csum.gather(-1, k) - sums.gather(-1, k)))
    rest = torch.minimum(rest.clamp_(min=0), icum[:, -1:] * (1 - 1e-6))
    j = torch.searchsorted(icum, rest, right=True).clamp_(max=block - 1)
    return (k * block + j)[:, 0]


def sample_and_score(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                     u: torch.Tensor, score_ids: torch.Tensor,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Like `sample_tokens`, plus the log-prob of `score_ids` [B] (draft tokens) per row."""
    logp = warp_logits(logits, temperature, top_k, top_p)
    if temperature == 0:
        tokens = logp.argmax(-1)
    else:
        tokens = inverse_cdf(logp.exp(), u.to(logp.device))
    return (tokens, logp.gather(-1, tokens[:, None])[:, 0],
            logp.gather(-1, score_ids.to(logp.device)[:, None])[:, 0])


def sample_and_score_rows(logits: torch.Tensor, settings: list[tuple[float, int, float]],
                          u: torch.Tensor, score_ids: torch.Tensor,
                          ) -> tuple[list[int], list[float], list[float]]:
    """`sample_and_score` for rows with their own (temperature, top_k, top_p): one call per
    distinct setting over all its rows (a verification pass's rows usually share one), so a
    batch costs a few tensor calls rather than one per request. Every operation is per row,
    so each row's results are those of a call on that row alone."""
    by_settings: dict[tuple, list[int]] = {}
    for i, s in enumerate(settings):
        by_settings.setdefault(s, []).append(i)
    n = len(settings)
    tokens, lp, lp_score = [0] * n, [0.0] * n, [0.0] * n
    for (temp, top_k, top_p), idx in by_settings.items():
        rows = None if len(idx) == n else torch.tensor(idx, device=logits.device)

        def pick(x: torch.Tensor) -> torch.Tensor:  # each tensor indexed on its own device
            # called in this iteration only, so the late-bound `rows` is this iteration's
            return x if rows is None else x[rows.to(x.device)]  # noqa: B023

        tok, a, b = sample_and_score(pick(logits), temp, top_k, top_p, pick(u), pick(score_ids))
        for i, t, x, y in zip(idx, tok.tolist(), a.tolist(), b.tolist()):
            tokens[i], lp[i], lp_score[i] = t, x, y
    return tokens, lp, lp_score


def token_stats(logits: torch.Tensor, k: int) -> tuple[list[list[tuple[int, float]]], list[float]]:
    """Per row of `logits` [N, V]: the k most likely (id, log-prob) pairs and the entropy of
    the temperature-1 distribution before any truncation (what an engine reports on request)."""
    logp = torch.log_softmax(logits.float(), -1)
    entropy = -(logp.exp() * logp).sum(-1)
    if k <= 0:
        return [[] for _ in range(logits.shape[0])], entropy.tolist()
    vals, ids = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
    top = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return top, entropy.tolist()
