"""The `Task` record and the seeded, disjoint train/eval split shared by generated tasks.

How generated tasks split: each possible prompt text belongs to exactly one side, decided by
a seeded hash of the text (`EVAL_FRACTION` of all prompts are on the eval side). Each split
then draws from the task's distribution with its own random stream, rejecting prompts of the
other side. Because the partition ignores everything but the text, rejection keeps the shape
of the distribution (e.g. arith_chain's length tail), and no eval prompt can appear in train.
The partition depends only on the seed, so a split depends only on (seed, its own size,
options): asking for more training prompts extends train and leaves eval unchanged, and a
smaller split is a prefix of a larger one.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollwise.types import Prompt, Sample

EVAL_FRACTION = 0.1  # share of the prompt space reserved for eval


@dataclass(frozen=True)
class TaskSetup:
    """What every task builder takes besides its own options: the seeded split sizes and
    whether prompts are chat messages (instruction models) or plain text (the tiny model)."""

    seed: int = 0
    num_train: int = 2000
    num_eval: int = 200
    chat: bool = False

    def prompt_style(self, style: str | None) -> str:
        """A generated task's prompt style: "instruct" (the answer format spelled out, for
        instruction models) or "plain" (bare text to continue); None: instruct for chat.

        >>> TaskSetup(chat=True).prompt_style(None), TaskSetup().prompt_style("instruct")
        ('instruct', 'instruct')
        """
        style = style or ("instruct" if self.chat else "plain")
        if style not in PROMPT_STYLES:
            raise ValueError(f"option style={style!r}: expected one of {', '.join(PROMPT_STYLES)}")
        return style


PROMPT_STYLES = ("instruct", "plain")
DEFAULT_SETUP = TaskSetup()


@dataclass
class Task:
    """A prompt source with its correctness verifier."""

    name: str  # registry name, e.g. "arith"
    train: list[Sample]  # training prompts
    eval: list[Sample]  # held-out prompts; no prompt text is shared with train
    verifier: Callable[[str, Sample], float]  # (completion, sample) -> 1.0 correct / 0.0
    # multi-turn tasks: a fresh environment per episode (rollwise.envs); None: single turn
    env: Callable[[], Any] | None = None
    # the least per-call verifier time limit the task needs (code tasks: a retried sandbox run)
    reward_timeout_s: float | None = None
    info: dict = field(default_factory=dict)  # recorded in summary.json (e.g. the sandbox)


def as_prompt(text: str, chat: bool) -> Prompt:
    """The prompt as chat messages (one user turn) when `chat`, else the plain text.

    >>> as_prompt("23+45=", chat=False), as_prompt("Hi", chat=True)
    ('23+45=', [{'role': 'user', 'content': 'Hi'}])
    """
    return [{"role": "user", "content": text}] if chat else text


def prompt_key(prompt: Prompt) -> str:
    """The text that identifies a prompt for disjointness (all message contents for chat).

    >>> prompt_key([{"role": "system", "content": "Be brief."},
    ...             {"role": "user", "content": "1+1="}])
    'Be brief.\\n1+1='
    """
    if isinstance(prompt, str):
        return prompt
    return "\n".join(message["content"] for message in prompt)


def in_eval_side(text: str, seed: int, eval_fraction: float) -> bool:
    """Whether prompt `text` belongs to the eval side of the partition for `seed`."""
    digest = hashlib.blake2b(f"{seed}\x00{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < eval_fraction


def draw_split(
    draw: Callable[[random.Random], Sample],
    *,
    name: str,
    setup: TaskSetup,
    unique: bool,
) -> tuple[list[Sample], list[Sample]]:
    """Draw disjoint (train, eval) lists of samples from `draw` (which returns a plain-text
    prompt and an empty id); see the module docstring for how the split is made.

    With `unique`, a split avoids repeating a prompt while fresh ones are easy to find (right
    for uniform prompt spaces); it falls back to repeats when the space is nearly exhausted.
    Raises ValueError when a side of the partition seems empty.
    """
    seed, num_train, num_eval, chat = setup.seed, setup.num_train, setup.num_eval, setup.chat
    if num_train < 0 or num_eval < 0:
        raise ValueError(f"num_train and num_eval must be >= 0, got {num_train}, {num_eval}")
    splits = []
    for side, count, want_eval in (("eval", num_eval, True), ("train", num_train, False)):
        rng = random.Random(f"{name}:{seed}:{side}")
        samples: list[Sample] = []
        seen: set[str] = set()
        misses, distinct = 0, unique
        while len(samples) < count:
            sample = draw(rng)
            key = prompt_key(sample.prompt)
            fresh = not distinct or key not in seen
            if in_eval_side(key, seed, EVAL_FRACTION) == want_eval and fresh:
                sample.id = f"{name}/{side}/{len(samples)}"
                sample.prompt = as_prompt(key, chat)
                samples.append(sample)
                seen.add(key)
                misses = 0
                continue
            misses += 1
            distinct = distinct and misses <= 200  # nearly exhausted: allow repeats from now on
            if misses > 100_000:
                raise ValueError(
                    f"task {name!r}: cannot draw {count} {side} prompts for seed {seed} "
                    f"(found {len(samples)}); the prompt space is too small for "
                    f"num_train={num_train}, num_eval={num_eval}; widen the options"
                )
        splits.append(samples)
    eval_samples, train_samples = splits
    return train_samples, eval_samples
