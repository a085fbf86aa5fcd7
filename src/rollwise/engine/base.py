"""The engine contract: token ids in, completions (ids, behaviour log-probs, finish reason) out.

An engine knows nothing of chat templates, rewards or advantages. Sampling follows the usual
conventions: temperature 0 means greedy, `top_k` 0 and `top_p` 1 mean no truncation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from rollwise.types import FinishReason

if TYPE_CHECKING:
    from rollwise.engine.requests import EngineStats

# Given [(request id, tokens so far)] and the most draft tokens one pass verifies, a draft
# continuation per request (empty: none). The rollout scheduler's grouped drafts are one.
Drafter = Callable[[list[tuple[int, list[int]]], int], list[list[int]]]


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


@runtime_checkable
class RequestEngine(Engine, Protocol):
    """The request-level contract: what the rollout scheduler drives one step at a time
    (and what a server or a remote worker in front of an engine has to provide). Requests
    are single sequences; a group is n submits of the same prompt ids."""

    stats: EngineStats  # running counters (forward passes, generated tokens, drafts...)

    def submit(self, prompt: list[int], params: SamplingParams, *, seed: int | None = None,
               resume: Completion | None = None, tag: int = 0, priority: float = 0.0,
               chunk_tokens: int = 0, draft: list[int] | None = None,
               draft_logprobs: list[float] | None = None,
               lenience: float | None = None, keep_kv: bool = False) -> int:
        """Queue one sequence; `resume` continues a partial Completion from `abort`;
        `draft` a proposed continuation to verify; `keep_kv` a conversation's turn, whose
        keys/values the next turn (a prompt extending this one's prompt + tokens) reuses.
        Returns the request id."""
        ...

    def step(self, *, static_batch: bool | None = None,
             drafter: Drafter | None = None) -> list[Completion]:
        """Advance every running request by one token (or a verified draft); the requests
        finished by it. `static_batch`: admit only into an empty batch (a baseline)."""
        ...

    def abort(self, rid: int) -> Completion:
        """Stop a request: its tokens, log-probs and versions so far."""
        ...

    def peek(self, rid: int) -> Completion:
        """A running request's tokens so far, leaving it running."""
        ...

    def set_priority(self, rid: int, priority: float) -> None:
        """Re-rank a waiting or running request (higher first)."""
        ...

    def has_unfinished(self) -> bool:
        ...
