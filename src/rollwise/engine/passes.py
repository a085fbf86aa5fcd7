"""The native engine's general passes, each the one layer body (`Layers.forward`) with its
own cache writes and attention:

- `prefill`: a batch of group prompts (right-padded), causal self-attention, keys and values
  written to the prefix region of the cache; returns the next-token logits of each prompt.
- `prefill_from`: the rest of prompts whose first tokens are already cached (a
  conversation's next turn, a tree's fork).
- `forward_rows`: a chunk of `c_r` new tokens for each running row (1 when decoding outside
  the static step, more when resuming or verifying a draft), planned on the host by `plan`;
  queries attend to their group's prompt and their own earlier tokens (`attend_regions`).

The decode step that every resident row takes one token through has its own static-shape
pass (step.py) over the same layers and attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollwise.engine.attention import GroupLayout, attend_prompt, attend_regions, region_mask
from rollwise.engine.kvcache import KVCache
from rollwise.engine.layers import Layers


@dataclass
class RowPlan:
    """Everything a `forward_rows` call needs about its rows, built once per call."""

    rows: slice | torch.Tensor  # the cache rows of the B inputs (a slice when contiguous)
    tokens: torch.Tensor  # [B, C] input ids (right-padded chunks)
    cos: torch.Tensor  # [B, C, 1, d]
    sin: torch.Tensor
    write_rows: torch.Tensor  # [B*C] cache row of each input token
    write_pos: torch.Tensor  # [B*C] position in the row's own region
    smax: int  # own-token keys to read
    gslots: torch.Tensor | None  # prefix slots read, None when they are 0..G-1
    layout: GroupLayout  # each row's group (its index among the slots read) and place
    pmax: int  # prefix keys to read
    mask: torch.Tensor  # [B, 1, rep*C or 1, pmax + smax] additive (`region_mask`)

    def prefix(self, t: torch.Tensor) -> torch.Tensor:
        """The prompt keys (or values) of the groups read, [G, kvH, pmax, hd]."""
        view = t[:, :, : self.pmax]
        return (view[: self.layout.groups] if self.gslots is None
                else view.index_select(0, self.gslots))


class Passes:
    def __init__(self, layers: Layers, cache: KVCache):
        self.layers, self.cache = layers, cache
        self.decoder = layers.decoder

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, D] last hidden states -> [N, V] float32 logits."""
        return self.layers.logits(hidden)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, lengths: list[int], slot0: int) -> torch.Tensor:
        """Prompts [g, P] (right-padded) into prefix slots slot0..slot0+g-1; [g, V] logits."""
        lay, cache = self.layers, self.cache
        g, p = tokens.shape
        cos, sin = self.decoder.cos[:p][None, :, None], self.decoder.sin[:p][None, :, None]

        def attend(i, q, k, v):
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            cache.pk[i][slot0: slot0 + g, :, :p] = k
            cache.pv[i][slot0: slot0 + g, :, :p] = v
            o = attend_prompt(q.transpose(1, 2), k, v, None, lay.scale, lay.rep)
            return o.transpose(1, 2).reshape(g, p, -1)

        x = lay.forward(lay.embed(tokens), cos, sin, attend)
        last = x[torch.arange(g, device=x.device), torch.tensor(lengths, device=x.device) - 1]
        return lay.logits(last)

    @torch.inference_mode()
    def prefill_from(self, slots: list[int], tokens: list[list[int]],
                     starts: list[int]) -> torch.Tensor:
        """The rest of g prompts whose first `starts[i]` tokens are already in prefix slot
        `slots[i]`: `tokens[i]` at positions starts[i].. attend to those and causally to
        each other, and their keys/values are written after them. One pass; [g, V] logits."""
        lay, cache, dev = self.layers, self.cache, self.layers.device
        g, w = len(tokens), max(len(t) for t in tokens)
        ids = torch.zeros(g, w, dtype=torch.long)
        for r, t in enumerate(tokens):
            ids[r, : len(t)] = torch.tensor(t)
        start = torch.tensor(starts)
        n = torch.tensor([len(t) for t in tokens])
        pos = start[:, None] + torch.arange(w)  # [g, w]
        valid = torch.arange(w)[None] < n[:, None]  # [g, w] real tokens, not padding
        # padding queries attend like their row's last real token (no unwritten keys)
        pos = torch.minimum(pos, (start + n - 1)[:, None])
        end = int((start + n).max())
        mask = (torch.arange(end)[None, None] <= pos[:, :, None])[:, None].to(dev)  # [g,1,w,E]
        slot_t = torch.tensor(slots)
        put = (slot_t[:, None].expand(g, w)[valid].to(dev), pos[valid].to(dev))
        pos, valid = pos.to(dev), valid.to(dev)
        cos, sin = self.decoder.cos[pos][:, :, None], self.decoder.sin[pos][:, :, None]

        def attend(i, q, k, v):  # k, v: [g, w, kv_heads, head_dim]
            cache.pk[i][put[0], :, put[1]] = k[valid]
            cache.pv[i][put[0], :, put[1]] = v[valid]
            keys, values = cache.pk[i][slot_t, :, :end], cache.pv[i][slot_t, :, :end]
            o = attend_prompt(q.transpose(1, 2), keys, values, mask, lay.scale, lay.rep)
            return o.transpose(1, 2).reshape(g, w, -1)

        x = lay.forward(lay.embed(ids.to(dev)), cos, sin, attend)
        return lay.logits(x[torch.arange(g, device=dev), (n - 1).to(dev)])

    def plan(self, rows: list[int], tokens: list[list[int]], own: list[int], slots: list[int],
             prefix_lens: list[int]) -> RowPlan:
        """Plan a `forward_rows` over cache `rows` with chunks `tokens`, `own[r]` own tokens
        already cached, prompt in prefix slot `slots[r]` of length `prefix_lens[r]`."""
        dev, d = self.layers.device, self.decoder
        r0 = rows[0]
        row_sel = (slice(r0, r0 + len(rows)) if rows == list(range(r0, r0 + len(rows)))
                   else torch.tensor(rows, device=dev))
        b, c = len(tokens), max(len(t) for t in tokens)
        ids = torch.zeros(b, c, dtype=torch.long)
        for r, t in enumerate(tokens):
            ids[r, : len(t)] = torch.tensor(t)
        own_t = torch.tensor(own)
        plen = torch.tensor(prefix_lens)
        step = torch.arange(c)
        positions = (plen + own_t)[:, None] + step  # [B, C]
        positions.clamp_(max=d.max_context - 1)  # padding beyond the context is masked
        smax = max(o + len(t) for o, t in zip(own, tokens))
        pmax = max(prefix_lens)
        # group layout: slot -> group index, and each row's place among its siblings
        unique = sorted(set(slots))
        contiguous = unique == list(range(len(unique)))
        index = {s: i for i, s in enumerate(unique)}
        seen: dict[int, int] = {}
        place = []
        for s in slots:
            place.append(seen.get(s, 0))
            seen[s] = place[-1] + 1
        group = torch.tensor([index[s] for s in slots], device=dev)
        layout = GroupLayout(group, group, torch.tensor(place, device=dev), len(unique),
                             max(seen.values()))
        mask = region_mask(plen, own_t, c, pmax, smax, self.layers.rep)
        return RowPlan(
            rows=row_sel, tokens=ids.to(dev), cos=d.cos[positions.to(dev)][:, :, None],
            sin=d.sin[positions.to(dev)][:, :, None],
            write_rows=torch.tensor(rows).repeat_interleave(c).to(dev),
            write_pos=(own_t[:, None] + step).reshape(-1).to(dev), smax=smax,
            gslots=None if contiguous else torch.tensor(unique, device=dev),
            layout=layout, pmax=pmax, mask=mask.to(dev))

    @torch.inference_mode()
    def forward_rows(self, p: RowPlan) -> torch.Tensor:
        """Run the planned chunks; returns [B, C, D] hidden states (before the final norm)."""
        lay, cache = self.layers, self.cache
        b, c = p.tokens.shape
        kvh, rep, hd = lay.kv_heads, lay.rep, lay.head_dim

        def attend(i, q, k, v):
            rk, rv = cache.rk[i], cache.rv[i]
            rk[p.write_rows, :, p.write_pos] = k.reshape(b * c, kvh, hd)
            rv[p.write_rows, :, p.write_pos] = v.reshape(b * c, kvh, hd)
            # [B, C, heads, hd] -> [B, kvH, rep*C, hd]: a key head's queries, head-major
            qh = q.view(b, c, kvh, rep, hd).permute(0, 2, 3, 1, 4).reshape(b, kvh, rep * c, hd)
            out = attend_regions(qh, rk[p.rows, :, : p.smax], rv[p.rows, :, : p.smax],
                                 p.prefix(cache.pk[i]), p.prefix(cache.pv[i]), p.layout,
                                 p.mask, lay.scale, lay.dtype)
            return out.view(b, kvh, rep, c, hd).permute(0, 3, 1, 2, 4).reshape(b, c, -1)

        return lay.forward(lay.embed(p.tokens), p.cos, p.sin, attend)
