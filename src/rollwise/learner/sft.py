"""The supervised warm start ([sft]): demonstrations read from JSONL, tokenized as the
policy sees an episode, and a loop of AdamW steps on the assistant tokens only.

A demonstration is one line `{"messages": [{"role": ..., "content": ...}, ...]}`: the
messages before the first assistant turn are the prompt (the chat template with its
generation prompt, as `Policy.encode` renders a task prompt; the contents joined by "\\n"
for a model without a template), then assistant turns and observations alternate (an
observation is any other role, "tool" for tool results), ending with an assistant turn.
An assistant turn is its text's tokens plus the stop token a sampled turn ends with; an
observation is the ids the caller's `observe(text, turn_ids)` gives (the episode runner's
`TurnRenderer.observation_ids`), so the tokens are exactly those of an episode.

The optimizer is its own (the RL learner's AdamW and schedule are untouched). Imports
torch and rollwise.models (the `Policy` record) only.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rollwise.models import Policy

Observe = Callable[[str, list[int]], list[int]]


class DemonstrationError(ValueError):
    """A demonstration file that cannot be read; the message names the file and line."""


@dataclass
class SftSettings:
    """The warm start's settings. The fields with help text are declared here once: the
    config's [sft] section is built from them (compose/schema.py `section_of`)."""

    path: str | None = field(default=None, metadata={
        "help": "JSONL of demonstrations, one {\"messages\": [{\"role\", \"content\"}, ...]} "
        "a line; the assistant turns are learned, tool results are role \"tool\" messages."})
    steps: int = field(default=0, metadata={
        "ge": 0, "help": "Optimizer steps (0: `epochs` passes over the demonstrations)."})
    epochs: int = field(default=1, metadata={
        "ge": 1, "help": "Passes over the demonstrations when steps = 0."})
    lr: float = field(default=1e-4, metadata={
        "gt": 0, "help": "AdamW learning rate (its own optimizer)."})
    batch_size: int = field(default=8, metadata={
        "ge": 1, "help": "Demonstrations per optimizer step."})
    max_tokens: int = field(default=1024, metadata={
        "ge": 2, "help": "A demonstration's tokens at most; longer ones are cut."})
    log_every: int = field(default=5, metadata={
        "ge": 1, "help": "Optimizer steps per 'sft' metrics record."})
    seed: int = 0  # run.seed
    bf16_autocast: bool = False  # the learner's precision, settled by compose/precision.py


def _check_messages(row: object) -> list[dict]:
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
        raise ValueError('expected an object with a "messages" list')
    messages = row["messages"]
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise ValueError(f"message {i}: expected {{'role': str, 'content': str}}")
    roles = [m["role"] for m in messages]
    if "assistant" not in roles or roles[-1] != "assistant" or roles[0] == "assistant":
        raise ValueError("expected prompt message(s), then assistant turns, the last one "
                         f"an assistant turn; roles are {roles}")
    first = roles.index("assistant")
    for a, b in zip(roles[first:], roles[first + 1:]):
        if (a == "assistant") == (b == "assistant"):
            raise ValueError(f"after the first assistant turn, assistant turns and "
                             f"observations must alternate; roles are {roles}")
    return messages


def read_demonstrations(path: str | Path) -> list[list[dict]]:
    """The message lists of a JSONL file (blank lines skipped); DemonstrationError names
    the file and the 1-based line of a malformed row."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise DemonstrationError(f"{path}: cannot read demonstrations: {e}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(_check_messages(json.loads(line)))
        except ValueError as e:  # json.JSONDecodeError is one
            raise DemonstrationError(f"{path}:{n}: {e}") from None
    if not out:
        raise DemonstrationError(f"{path}: no demonstrations")
    return out


def stop_id(policy: Policy) -> int:
    """The token a sampled turn ends with: EOS when it stops a response, else the first
    stop id."""
    eos = policy.tokenizer.eos_token_id
    return eos if eos in policy.stop_ids or not policy.stop_ids else policy.stop_ids[0]


def encode_demonstration(messages: list[dict], policy: Policy,
                         observe: Observe) -> tuple[list[int], list[int]]:
    """(token ids, loss mask): 1 on the assistant turns' tokens (their stop token too)."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    head = messages[:first]
    ids = policy.encode(head if policy.chat else "\n".join(m["content"] for m in head))
    mask = [0] * len(ids)
    turn: list[int] = []
    for m in messages[first:]:
        if m["role"] == "assistant":
            turn = [int(i) for i in policy.tokenizer(
                m["content"], add_special_tokens=False)["input_ids"]] + [stop_id(policy)]
            ids, mask = ids + turn, mask + [1] * len(turn)
        else:
            obs = observe(m["content"], turn)
            ids, mask = ids + obs, mask + [0] * len(obs)
    return ids, mask


def sft_loss(model, rows: list[tuple[list[int], list[int]]], pad_id: int,
             ) -> tuple[torch.Tensor, int, int]:
    """(summed cross-entropy over the masked tokens, tokens, tokens predicted right) of
    right-padded `rows` of (ids, mask)."""
    device = next(model.parameters()).device
    width = max(len(ids) for ids, _ in rows)
    padded = [(x + [pad_id] * (width - len(x)), [1] * len(x) + [0] * (width - len(x)),
               m + [0] * (width - len(m))) for x, m in rows]
    ids = torch.tensor([x for x, _, _ in padded], dtype=torch.long, device=device)
    attention = torch.tensor([a for _, a, _ in padded], dtype=torch.long, device=device)
    mask = torch.tensor([m for _, _, m in padded], dtype=torch.bool, device=device)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    target, keep = ids[:, 1:], mask[:, 1:]
    picked = logits[keep].float()
    loss = torch.nn.functional.cross_entropy(picked, target[keep], reduction="sum")
    right = int((picked.argmax(-1) == target[keep]).sum())
    return loss, int(keep.sum()), right


def _batches(n: int, s: SftSettings) -> list[list[int]]:
    """Indices of each optimizer step's demonstrations: shuffled passes, cut to `steps`."""
    rng = random.Random(f"sft:{s.seed}")
    per_epoch = math.ceil(n / s.batch_size)
    total = s.steps or s.epochs * per_epoch
    out: list[list[int]] = []
    while len(out) < total:
        order = list(range(n))
        rng.shuffle(order)
        out += [order[i:i + s.batch_size] for i in range(0, n, s.batch_size)]
    return out[:total]


def train_sft(model, rows: list[tuple[list[int], list[int]]], pad_id: int,
              settings: SftSettings, log: Callable[[dict], None]) -> dict:
    """AdamW steps on `rows` (encoded demonstrations); `log` gets one record per
    `log_every` steps (loss, token_accuracy, tokens, seconds); the totals."""
    s = settings
    rows = [(ids[:s.max_tokens], mask[:s.max_tokens]) for ids, mask in rows]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0)
    device_type = params[0].device.type
    autocast = (lambda: torch.autocast(device_type, dtype=torch.bfloat16)) if s.bf16_autocast \
        else contextlib.nullcontext
    began, window = time.perf_counter(), [0.0, 0, 0, time.perf_counter()]
    total_tokens, batches = 0, _batches(len(rows), s)
    model.train()
    try:
        for step, picked in enumerate(batches, 1):
            with autocast():
                loss, tokens, right = sft_loss(model, [rows[i] for i in picked], pad_id)
            optimizer.zero_grad(set_to_none=True)
            (loss / max(tokens, 1)).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            window[0] += float(loss.detach())
            window[1] += tokens
            window[2] += right
            total_tokens += tokens
            if step % s.log_every == 0 or step == len(batches):
                log({"sft_step": step, "sft_steps": len(batches),
                     "loss": window[0] / max(window[1], 1),
                     "token_accuracy": window[2] / max(window[1], 1), "tokens": window[1],
                     "seconds": time.perf_counter() - window[3]})
                window = [0.0, 0, 0, time.perf_counter()]
    finally:
        model.eval()
        optimizer.zero_grad(set_to_none=True)
    return {"steps": len(batches), "demonstrations": len(rows), "tokens": total_tokens,
            "seconds": time.perf_counter() - began}
