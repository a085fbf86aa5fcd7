"""The native engine's draft verification (speculative decoding and SPEC-RL draft reuse).

`DraftVerifier` asks a drafter for continuations when the batch is small enough to profit,
runs one forward pass over each row's pending tokens plus its draft (at most
`verify_window` draft tokens), and walks each draft against the policy's own draws
(`requests.walk_draft`: exact acceptance, or SPEC-RL's lenient rule for a reused draft with
stored log-probs). The tokens it accepts go to the step loop's `emit`, handed in as a
callable, so this module never imports the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from rollwise.engine.base import Drafter, EngineStats
from rollwise.engine.decoder import Decoder
from rollwise.engine.kvcache import KVCache
from rollwise.engine.requests import Request, walk_draft
from rollwise.engine.sampling import sample_and_score, uniforms

_ACCEPT_STREAM = 0x5DEECE66D  # second uniform stream (lenient acceptance tests)

# The step loop's emit: append (tokens, log-probs) to a request up to its first stop.
Emit = Callable[[Request, list[int], list[float]], None]


class DraftVerifier:
    def __init__(self, decoder: Decoder, cache: KVCache, stats: EngineStats, emit: Emit, *,
                 spec_tokens: int = 4, spec_max_batch: int = 8, verify_window: int = 16):
        """`spec_tokens`: the most tokens a drafter proposes per row; `spec_max_batch`: the
        most running rows at which the drafter is asked; `verify_window`: the draft tokens
        one pass feeds per row (a long reused draft is verified in windows, so a rejection
        early wastes at most this much)."""
        self.decoder, self.cache, self.stats, self.emit = decoder, cache, stats, emit
        self.spec_tokens, self.spec_max_batch = spec_tokens, spec_max_batch
        self.verify_window = verify_window

    def attach_drafts(self, rows: list[Request], drafter: Drafter | None) -> None:
        """Ask the drafter for continuations of the resident `rows` when the batch is small
        enough to profit."""
        if drafter is None or sum(not r.zombie for r in rows) > self.spec_max_batch:
            return
        rows = [r for r in rows if not r.zombie and not r.draft and r.inputs == 1]
        if not rows:
            return
        drafts = drafter([(r.id, r.tokens) for r in rows], self.spec_tokens)
        for r, d in zip(rows, drafts):
            room = r.params.max_tokens - len(r.tokens) - 1
            r.draft = list(d[: min(self.spec_tokens, room)]) if room > 0 else []

    def verify(self, reqs: list[Request], rows: list[int], resident: int) -> None:
        """One pass over each row's pending tokens plus its draft; emit what is accepted.
        `rows`: the requests' cache rows; `resident`: how many rows the batch holds."""
        start = time.perf_counter()
        w = self.verify_window
        chunks = [r.tokens[r.cached:] + r.draft[:w] for r in reqs]
        # padded positions of short chunks are written too: room for the widest chunk
        self.cache.ensure_rows(resident, max(r.cached for r in reqs) + max(map(len, chunks)))
        plan = self.decoder.plan(rows, chunks, [r.cached for r in reqs],
                                 [r.group.slot for r in reqs], [len(r.group.tokens) for r in reqs])
        hidden = self.decoder.forward_rows(self.cache, plan)
        self.stats.forward_passes += 1
        self.stats.row_forwards += len(reqs)
        # logits at the last pending token and at every draft token
        picks, spans = [], []
        for b, r in enumerate(reqs):
            first = len(r.tokens) - r.cached - 1
            spans.append((len(picks), len(r.draft[:w]) + 1))
            picks += [(b, first + k) for k in range(len(r.draft[:w]) + 1)]
            self.stats.recompute_tokens += first
        ix = torch.tensor(picks, device=hidden.device)
        logits = self.decoder.logits(hidden[ix[:, 0], ix[:, 1]])
        for r, (s, n) in zip(reqs, spans):
            r.cached = len(r.tokens)  # the pending tokens are now cached
            self.accept(r, logits[s: s + n])
        self.stats.prefill_seconds += time.perf_counter() - start

    def accept(self, r: Request, logits: torch.Tensor) -> None:
        """Verify r.draft against `logits` ([len(draft) + 1, V]; [1, V] at admission)."""
        n = logits.shape[0]
        positions = [len(r.tokens) + k for k in range(n)]
        u = uniforms([r.seed] * n, positions)
        draft = r.draft[:n]
        score = torch.tensor(draft + [0] * (n - len(draft)))
        p = r.params
        tok, lp, lp_draft = sample_and_score(logits, p.temperature, p.top_k, p.top_p, u, score)
        accept_u = uniforms([r.seed ^ _ACCEPT_STREAM] * n, positions).tolist()
        out, lps, accepted = walk_draft(tok.tolist(), lp.tolist(), draft, lp_draft.tolist(),
                                        accept_u, r)
        if draft:
            self.stats.spec_verifies += 1
            self.stats.spec_drafted += len(draft)
            self.stats.spec_accepted += accepted
        r.draft = r.draft[n:] if accepted == n else []
        if r.draft_logprobs is not None:
            r.draft_logprobs = r.draft_logprobs[n:] if r.draft else None
        self.emit(r, out, lps)
