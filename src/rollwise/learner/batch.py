"""Collate scored trajectories into the learner's padded `Batch`."""

from __future__ import annotations

from dataclasses import fields

import torch

from rollwise.types import Batch, Trajectory


def collate(trajectories: list[Trajectory], advantages: torch.Tensor, group_ids: torch.Tensor,
            pad_id: int) -> Batch:
    """Right-pad prompt+response rows; sampled response positions carry old log-probs and
    versions and loss mask 1; tokens an environment inserted (multi-turn) get loss mask 0."""
    width = max(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)
    n = len(trajectories)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.float32)
    old = torch.zeros((n, width), dtype=torch.float32)
    versions = torch.full((n, width), -1, dtype=torch.long)
    for i, t in enumerate(trajectories):
        p, r = len(t.prompt_ids), len(t.response_ids)
        ids[i, : p + r] = torch.tensor(t.prompt_ids + t.response_ids)
        attn[i, : p + r] = 1
        sampled = torch.tensor(t.sampled_mask, dtype=torch.float32)  # env tokens: 0
        loss_mask[i, p: p + r] = sampled
        old[i, p: p + r] = torch.tensor(t.logprobs, dtype=torch.float32) * sampled
        versions[i, p: p + r] = torch.where(sampled > 0, torch.tensor(t.versions), -1)
    return Batch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask, old_logprobs=old,
                 advantages=advantages.float(), group_ids=group_ids, versions=versions)


def micro_batches(batch: Batch, max_tokens: int) -> list[torch.Tensor]:
    """Row indices per micro-batch: rows sorted by length and packed while rows x longest
    row <= max_tokens, so padding stays small and activation memory is bounded."""
    lengths = batch.attention_mask.sum(-1)
    order = torch.argsort(lengths, descending=True).tolist()
    out, current = [], []
    for i in order:
        longest = int(lengths[current[0]]) if current else int(lengths[i])
        if current and (len(current) + 1) * longest > max_tokens:
            out.append(torch.tensor(current))
            current = []
        current.append(i)
    if current:
        out.append(torch.tensor(current))
    return out


def prefix_lengths(loss_mask: torch.Tensor) -> torch.Tensor:
    """[N] each row's prefix: the tokens before the position that predicts its first
    response token (first trained column - 1); -1 for a row with no trained token."""
    has = loss_mask.bool().any(-1)
    first = loss_mask.bool().float().argmax(-1)
    return torch.where(has, first - 1, torch.full_like(first, -1))


def group_micro_batches(batch: Batch, max_tokens: int, split: bool = True
                        ) -> list[tuple[torch.Tensor, int | None, int]]:
    """Micro-batches when prompts are shared (learner/grouped.py): (row indices, the group
    cut into pieces it belongs to, else None, and that group's prefix length, else 0).
    Whole groups are packed, largest first, while the tokens that run stay within
    `max_tokens`: each group's prefix once plus its rows' suffixes (a row with no trained
    token runs nothing; a group of one row runs its row). A group over `max_tokens` on its
    own is cut into pieces of its rows, each within the budget with the prefix counted
    (`split`; else it runs whole, over the budget)."""
    lengths = batch.attention_mask.sum(-1).tolist()
    k = prefix_lengths(batch.loss_mask).tolist()
    # a unit: the rows of one group with one prefix (rows a group_id joins under other
    # prompts are units of their own), and the group's rows with no trained token
    units: dict[tuple, list[int]] = {}
    ids = batch.input_ids
    for i, g in enumerate(batch.group_ids.tolist()):
        key = (g, tuple(ids[i, : k[i]].tolist())) if k[i] >= 0 else (g, None)
        units.setdefault(key, []).append(i)

    def prefix(rows: list[int]) -> int:
        trained = [k[r] for r in rows if k[r] >= 0]
        return min(trained) if len(trained) > 1 else 0

    def cost(rows: list[int]) -> int:
        p = prefix(rows)
        return p + sum(lengths[r] - p for r in rows if k[r] >= 0)

    order = sorted(units.values(), key=lambda rows: (-cost(rows), rows[0]))
    out: list[tuple[torch.Tensor, int | None, int]] = []
    current: list[int] = []
    used = 0
    for cut, rows in enumerate(order):
        c = cost(rows)
        if current and used + c > max_tokens:
            out.append((torch.tensor(current), None, 0))
            current, used = [], 0
        if c <= max_tokens or not split or len(rows) == 1:
            current, used = current + rows, used + c
            continue
        piece, budget = [], max_tokens - prefix(rows)
        taken = 0
        for r in sorted(rows, key=lambda r: -lengths[r]):
            s = lengths[r] - prefix(rows) if k[r] >= 0 else 0
            if piece and taken + s > budget:
                out.append((torch.tensor(piece), cut, prefix(rows)))
                piece, taken = [], 0
            piece.append(r)
            taken += s
        out.append((torch.tensor(piece), cut, prefix(rows)))
    if current:
        out.append((torch.tensor(current), None, 0))
    return out


def take_rows(batch: Batch, rows: torch.Tensor, *, trim: bool = False,
              device: torch.device | str | None = None) -> Batch:
    """The batch restricted to row indices `rows` (every field is indexed by row first);
    `trim`: [N, L] fields cut to the longest selected row (micro-batches carry no columns
    of padding only); `device`: where the selected rows go."""
    width = int(batch.attention_mask[rows].sum(-1).max()) if trim and len(rows) else None

    def select(t: torch.Tensor) -> torch.Tensor:
        t = t[rows]
        if width is not None and t.dim() == 2:  # [N, L] fields, [N, L] advantages included
            t = t[:, :width]
        return t.to(device) if device is not None else t

    return Batch(**{f.name: select(getattr(batch, f.name)) for f in fields(Batch)})
