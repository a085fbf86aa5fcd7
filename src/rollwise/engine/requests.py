"""The native engine's bookkeeping records: groups (shared prompts), requests, and the
acceptance walk of speculative verification."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from rollwise.engine.base import SamplingParams
from rollwise.types import Completion


@dataclass
class Group:
    key: tuple
    tokens: list[int]
    refs: int = 0  # unfinished requests (waiting, parked or running)
    running: int = 0
    slot: int = -1  # prefix slot, -1 while not computed
    logits: torch.Tensor | None = None  # [V] next-token logits after the prompt
    reuse: torch.Tensor | None = None  # retained keys/values of the prompt's head, to restore


@dataclass
class Request:
    id: int
    group: Group
    params: SamplingParams
    seed: int
    stops: frozenset[int]
    tag: int = 0  # caller's label (generate(): the prompt index)
    priority: float = 0.0  # admission order: highest first, then submission order
    chunk_tokens: int = 0  # divided rollout: park after this many tokens per residency (0: off)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cached: int = 0  # own tokens whose keys/values are in the row cache
    resident_since: int = 0  # len(tokens) when last admitted
    draft: list[int] = field(default_factory=list)  # proposed continuation to verify
    draft_logprobs: list[float] | None = None  # behaviour log-probs of a reused draft
    lenience: float | None = None  # None: exact (lossless) acceptance
    parked: torch.Tensor | None = None  # [layers, 2, kv_heads, cached, head_dim] when parked
    zombie: bool = False  # static batching: finished, still occupying its row
    keep_kv: bool = False  # a conversation: retain the keys/values when it finishes
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, when params ask
    entropies: list[float] | None = None  # per token, when params ask

    @property
    def wants_stats(self) -> bool:
        """Whether this request records per-token statistics (SamplingParams)."""
        return self.top_logprobs is not None or self.entropies is not None

    @property
    def inputs(self) -> int:
        """Tokens the row feeds to the model this step: pending ones plus its draft."""
        return len(self.tokens) - self.cached + len(self.draft)

    def finish_reason(self, max_context: int) -> str | None:
        """"stop" or "length" once the request is done, None while it runs on."""
        if not self.tokens:
            return None
        if self.tokens[-1] in self.stops:
            return "stop"
        if len(self.tokens) >= self.params.max_tokens:
            return "length"
        if len(self.group.tokens) + len(self.tokens) >= max_context:
            return "length"
        return None

    def completion(self, reason: str) -> Completion:
        """The request as a Completion (copies of its tokens, log-probs and versions)."""
        return Completion(prompt_index=self.tag, token_ids=list(self.tokens),
                          logprobs=list(self.logprobs), finish_reason=reason,
                          versions=list(self.versions), request_id=self.id,
                          top_logprobs=None if self.top_logprobs is None
                          else [list(t) for t in self.top_logprobs],
                          entropies=None if self.entropies is None else list(self.entropies))


def walk_draft(sampled: list[int], logps_sampled: list[float], draft: list[int],
               logps_draft: list[float], accept_u: list[float], req: Request,
               ) -> tuple[list[int], list[float], int]:
    """Emitted tokens (and their log-probs) of one verification, and how many draft tokens
    were accepted. `sampled[k]` is the token the policy itself draws at draft position k
    (with the request's own uniform), `logps_draft[k]` the policy's log-prob of draft[k].

    Exact mode (lenience None): accept draft[k] iff the policy's own draw equals it. For a
    deterministic draft that is the standard speculative-sampling rule (accept with
    probability p(d), else draw from p without d), realised with a coupled uniform, so
    the output is exactly what plain sampling would have produced.
    Lenient mode (a draft sampled earlier with stored log-probs q, SPEC-RL): accept with
    probability min(1, lenience * p(d) / q(d)); at the first rejection emit the policy's
    own draw (SPEC-RL regenerates there)."""
    out, lps, accepted = [], [], 0
    for k, tok in enumerate(sampled):
        if k < len(draft):
            d = draft[k]
            if req.lenience is None:
                ok = tok == d
            else:
                q = req.draft_logprobs[k] if req.draft_logprobs else 0.0
                ok = math.log(max(accept_u[k], 1e-300)) <= math.log(req.lenience) + (
                    logps_draft[k] - q)
            if ok:
                out.append(d)
                lps.append(logps_draft[k])
                accepted += 1
                continue
        out.append(tok)
        lps.append(logps_sampled[k])
        break
    return out, lps, accepted
