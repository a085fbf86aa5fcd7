"""Attention in the native engine, written once for every pass.

`attend_regions` is the attention of a decode or chunk pass over the KV cache's two regions
(kvcache.py): a query attends to its group's prompt keys (one copy for the whole group) and
to its own row's keys, under one softmax. The prompt keys are read once per group: the
queries of a group's rows are regrouped (`GroupLayout`) so that each group's product is one
matrix multiply, then the results are gathered back to rows. Both the general chunk pass
(passes.py, exact shapes) and the static decode step (step.py, exact or bucketed shapes)
call it; `region_mask` is their one mask. Scores and the softmax are float32 whatever the
engine's dtype.

`attend_prompt` is the prefill's attention: a prompt's queries over its own keys (causal),
or over the keys already cached before them and their own (a mask).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def region_mask(plen: torch.Tensor, own: torch.Tensor, chunk: int, pmax: int, smax: int,
                rep: int) -> torch.Tensor:
    """The additive float32 mask (0 or -inf) of `attend_regions`, on `plen`'s device: row b's
    queries at own positions own[b] + t (t < chunk) see the P prompt keys below plen[b], then
    the S own keys up to their own position. [B, 1, rep * chunk, P + S] in the queries'
    (head, token) order; [B, 1, 1, P + S] when chunk is 1 (broadcast over the heads)."""
    b, dev = plen.shape[0], plen.device
    keys = torch.arange(pmax + smax, device=dev)
    qpos = own[:, None] + torch.arange(chunk, device=dev)  # [B, C]
    ok = torch.where(keys < pmax, keys < plen[:, None, None],
                     keys - pmax <= qpos[:, :, None])  # [B, C, P+S]
    mask = torch.zeros(ok.shape, dtype=torch.float32, device=dev).masked_fill_(
        ~ok, float("-inf"))
    if chunk == 1:
        return mask[:, None]
    return mask[:, None, None].expand(b, 1, rep, chunk, pmax + smax).reshape(
        b, 1, rep * chunk, pmax + smax)


class GroupLayout:
    """Where each of B rows sits in the [G, nmax] group layout: group `put[b]` (G, one past
    the last, for a padded row whose result is dropped) at place `place[b]` among its
    group's rows, read back from group `get[b]`. Tensors [B] on the device. `fresh`: every
    `to_groups` call writes a buffer of its own (for a pass autograd differentiates: the
    learner's grouped pass, learner/grouped.py), else one per name is reused."""

    def __init__(self, put: torch.Tensor, get: torch.Tensor, place: torch.Tensor, groups: int,
                 nmax: int, fresh: bool = False):
        self.put, self.get, self.place, self.groups, self.nmax = put, get, place, groups, nmax
        self.fresh = fresh
        self._buffers: dict[str, torch.Tensor] = {}  # to_groups' buffers, by name

    def to_groups(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """[B, kvH, M, X] rows -> [G, kvH, nmax*M, X] groups (absent places are zero).

        The rows are written into a zeroed buffer that this layout allocates on the first
        call with this `name` (e.g. "queries") and reuses in every later call (every layer
        of a pass): the result is a view of that buffer, valid until the next call with the
        same name. Every call writes the same places, so the others stay zero."""
        _, h, m, x = t.shape
        buf = None if self.fresh else self._buffers.get(name)
        if buf is None or buf.shape[1:] != (h, self.nmax, m, x) or buf.dtype != t.dtype:
            buf = self._buffers[name] = t.new_zeros(self.groups + 1, h, self.nmax, m, x)
        buf[self.put, :, self.place] = t
        return buf[: self.groups].view(self.groups, h, self.nmax * m, x)

    def to_rows(self, t: torch.Tensor) -> torch.Tensor:
        """[G, kvH, nmax*M, X] groups -> [B, kvH, M, X] rows: one gather."""
        g, h, m, x = t.shape
        return t.view(g, h, self.nmax, m // self.nmax, x)[self.get, :, self.place]


def attend_regions(q: torch.Tensor, own_k: torch.Tensor, own_v: torch.Tensor,
                   pre_k: torch.Tensor, pre_v: torch.Tensor, layout: GroupLayout,
                   mask: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Queries q [B, kvH, M, hd] (M: a key head's query heads times the chunk's tokens)
    over their group's prompt keys/values pre_k, pre_v [G, kvH, P, hd] and their own
    own_k, own_v [B, kvH, S, hd] under one softmax with `mask` (`region_mask`);
    [B, kvH, M, hd] in `dtype`. Scores and the softmax in float32, or float64 for float64
    queries (the learner's exactness tests)."""
    s_pre = layout.to_rows(layout.to_groups(q, "queries") @ pre_k.transpose(-1, -2))
    scores = torch.cat([s_pre, q @ own_k.transpose(-1, -2)], dim=-1)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)).mul_(scale).add_(mask)
    probs = scores.softmax(-1).to(dtype)
    p = pre_k.shape[2]
    out = probs[..., p:] @ own_v
    return out + layout.to_rows(layout.to_groups(probs[..., :p], "weights") @ pre_v)


def attend_prompt(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  mask: torch.Tensor | None, scale: float, rep: int) -> torch.Tensor:
    """Prompt queries q [g, heads, w, hd] over keys/values [g, kvH, E, hd]: causal when
    `mask` is None (the keys are the queries' own), else under the boolean `mask`
    [g, 1, w, E]; [g, heads, w, hd]."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                          is_causal=mask is None, scale=scale,
                                          enable_gqa=rep > 1)
