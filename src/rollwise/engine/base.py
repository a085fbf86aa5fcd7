"""The engine contract: token ids in, completions (ids, behaviour log-probs, finish reason) out
as `rollwise.types.Completion` records, with running counters in `EngineStats`.

An engine knows nothing of chat templates, rewards or advantages. Sampling follows the usual
conventions: temperature 0 means greedy, `top_k` 0 and `top_p` 1 mean no truncation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from rollwise.types import Completion

# sequences an engine decodes at once unless told: the one default every engine, the remote
# rollout and the config ([engine] batch_size) read
ENGINE_ROWS = 64

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
    # per-token statistics of the model's distribution (temperature 1, before truncation) at
    # every sampled position, returned in the Completion; computed only for rows that ask
    top_logprobs: int = 0  # the k most likely tokens and their log-probs (0: off)
    entropy: bool = False  # the distribution's entropy (nats)


@dataclass
class EngineStats:
    """Deterministic counters (and timers) since the engine was made."""

    forward_passes: int = 0  # model forward calls: prompt prefills, chunk passes, decodes
    prefill_tokens: int = 0  # prompt tokens computed (a shared prompt counts once)
    recompute_tokens: int = 0  # own tokens recomputed after preemption or resume
    generated_tokens: int = 0  # tokens emitted
    decode_tokens: int = 0  # row-tokens run through single-token decode forwards
    row_forwards: int = 0  # rows taking part in forwards (one per row per pass)
    decode_passes: int = 0  # single-token decode forwards (every row one token)
    steps: int = 0
    preemptions: int = 0
    parks: int = 0  # divided rollout: requests set aside with their cache after a chunk
    peak_kv_tokens: int = 0  # most tokens held in the cache at once
    reused_tokens: int = 0  # prompt tokens whose keys/values came from a retained conversation
    retained: int = 0  # finished keep_kv requests whose keys/values were kept
    retained_evictions: int = 0  # retained conversations dropped for room (not publication)
    spec_verifies: int = 0  # rows verified with a draft
    spec_drafted: int = 0  # draft tokens proposed
    spec_accepted: int = 0  # draft tokens accepted
    decode_seconds: float = 0.0  # single-token decode forwards + sampling
    prefill_seconds: float = 0.0  # prompt prefills and multi-token chunk passes
    publish_seconds: float = 0.0  # weight conversion at publication (0 when shared)

    @property
    def mean_accepted_len(self) -> float:
        """Tokens emitted per verification (accepted draft tokens + the one sampled)."""
        return 1.0 + self.spec_accepted / self.spec_verifies if self.spec_verifies else 0.0


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


def release_cache(engine: Engine | None) -> int:
    """Free an idle engine's key/value memory, where it keeps any (the native engine's
    `release_cache`); the bytes freed."""
    release = getattr(engine, "release_cache", None)
    return release() if release is not None else 0


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
