"""The engine contract: token ids in, completions (ids, behaviour log-probs, finish reason) out.

An engine knows nothing of chat templates, rewards or advantages. Sampling follows the usual
conventions: temperature 0 means greedy, `top_k` 0 and `top_p` 1 mean no truncation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from rollwise.types import FinishReason


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off
    max_tokens: int = 256  # response budget
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's EOS ids
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks)
    seed: int | None = None  # reproducible sampling


@dataclass
class Completion:
    prompt_index: int  # which prompt of the call this answers
    token_ids: list[int]  # [T] sampled tokens, the stop token included when one was sampled
    logprobs: list[float]  # [T] log-prob of each token under the distribution it was sampled from
    finish_reason: FinishReason  # "stop" | "length" | "abort"
    versions: list[int] = field(default_factory=list)  # [T] policy version that sampled each
    request_id: int = -1  # the engine's id for the request (native engine)


@runtime_checkable
class Engine(Protocol):
    """What the rollout stage needs from a generation engine."""

    version: int  # policy version the engine's weights correspond to

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One Completion per prompt x n, in order (prompt 0's n samples first)."""
        ...

    def publish(self, version: int) -> None:
        """New policy weights are ready (in one process the engine shares the learner's
        tensors, so this only records the version); later tokens carry `version`."""
        ...
