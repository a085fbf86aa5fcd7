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
