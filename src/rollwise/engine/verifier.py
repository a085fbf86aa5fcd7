"""The native engine's draft verification (speculative decoding and SPEC-RL draft reuse).

`DraftVerifier` asks a drafter for continuations when the batch is small enough to profit
(or, in a larger one, while rows submitted with a draft run and most rows would verify one),
runs one forward pass over each row's pending tokens plus its draft (a long draft in windows
of `spec_tokens`, or, when `verify_window` is wider, in windows that double while accepted up
to it), and walks each draft against the policy's own draws (`requests.walk_draft`: exact
acceptance, or SPEC-RL's lenient rule for a reused draft with stored log-probs), the draws of
all the pass's rows coming from one sampling call. The tokens it accepts go to the step loop's
`emit`, handed in as a callable, so this module never imports the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from rollwise.engine.base import Drafter, EngineStats
from rollwise.engine.kvcache import KVCache
from rollwise.engine.passes import Passes
from rollwise.engine.requests import Request, walk_draft
from rollwise.engine.sampling import sample_and_score_rows, uniforms

_ACCEPT_STREAM = 0x5DEECE66D  # second uniform stream (lenient acceptance tests)

# The step loop's emit: append (tokens, log-probs) to a request up to its first stop.
Emit = Callable[[Request, list[int], list[float]], None]


class DraftVerifier:
    def __init__(self, passes: Passes, cache: KVCache, stats: EngineStats, emit: Emit, *,
                 spec_tokens: int = 4, spec_max_batch: int = 8, verify_window: int = 0):
        """`spec_tokens`: the most tokens a drafter proposes per row; `spec_max_batch`: the
        most running rows at which the drafter is always asked; `verify_window`: the most draft
        tokens one pass feeds per row (a long reused draft is verified in windows from
        `spec_tokens` up to this, so a rejection early wastes little); 0 or anything below
        `spec_tokens`: `spec_tokens`, windows that never grow. A pass is as wide as its widest
        row for every row, so on a compute-bound CPU a grown window costs more wall time than
        the passes it saves (docs/rollout.md has the figures)."""
        self.passes, self.cache, self.stats, self.emit = passes, cache, stats, emit
        self.spec_tokens, self.spec_max_batch = spec_tokens, spec_max_batch
        self.verify_window = max(verify_window, spec_tokens)
        self.merge_share = 0.5  # see `merges`
        self._windows: dict[int, int] = {}  # request id -> its long draft's next window
        self._reusing: set[int] = set()  # resident requests submitted with a draft

    def attach_drafts(self, rows: list[Request], drafter: Drafter | None) -> None:
        """Ask the drafter for continuations of the resident `rows` that have none: when the
        batch is small enough to profit, or, in a larger batch, while rows submitted with a
        draft (reused responses) run. There the drafts are kept only when at least
        `merge_share` of the rows would then verify one, so that one pass serves every row
        (see `merges`); fewer would cost a pass of their own."""
        live = [r for r in rows if not r.zombie]
        self._forget_gone(rows)
        large = len(live) > self.spec_max_batch
        if drafter is None or (large and not any(r.draft or r.id in self._reusing
                                                 for r in live)):
            return
        ask = [r for r in live if not r.draft and r.inputs == 1]
        if not ask:
            return
        drafts = drafter([(r.id, r.tokens) for r in ask], self.spec_tokens)
        if large and (sum(bool(r.draft) for r in live) + sum(bool(d) for d in drafts)
                      < self.merge_share * len(live)):
            return
        for r, d in zip(ask, drafts):
            room = r.params.max_tokens - len(r.tokens) - 1
            r.draft = list(d[: min(self.spec_tokens, room)]) if room > 0 else []
            if r.draft:  # a drafter's guess has no stored log-probs: the exact rule
                r.lenience, r.draft_logprobs = None, None

    def _forget_gone(self, rows: list[Request]) -> None:
        """Drop the windows and marks of requests no longer resident (finished, aborted)."""
        if len(self._windows) + len(self._reusing) > 4 * len(rows):
            here = {r.id for r in rows}
            self._windows = {k: v for k, v in self._windows.items() if k in here}
            self._reusing &= here

    def merges(self, resident: int, multi: int) -> bool:
        """Whether this step's one-token rows join the rows with drafts in one pass: in a
        small batch (a little padding), or when most rows verify a draft anyway (the few
        without one cost padding instead of a pass of their own)."""
        return resident <= self.spec_max_batch or multi >= self.merge_share * resident

    def verify(self, reqs: list[Request], rows: list[int], resident: int) -> None:
        """One pass over each row's pending tokens plus its draft; emit what is accepted.
        `rows`: the requests' cache rows; `resident`: how many rows the batch holds."""
        start = time.perf_counter()
        windows = [self._window(r) for r in reqs]
        chunks = [r.tokens[r.cached:] + r.draft[:w] for r, w in zip(reqs, windows)]
        # padded positions of short chunks are written too: room for the widest chunk
        self.cache.ensure_rows(resident, max(r.cached for r in reqs) + max(map(len, chunks)))
        plan = self.passes.plan(rows, chunks, [r.cached for r in reqs],
                                [r.group.slot for r in reqs], [len(r.group.tokens) for r in reqs])
        hidden = self.passes.forward_rows(plan)
        self.stats.forward_passes += 1
        self.stats.row_forwards += len(reqs)
        # logits at the last pending token and at every draft token
        picks, spans = [], []
        for b, (r, w) in enumerate(zip(reqs, windows)):
            first = len(r.tokens) - r.cached - 1
            spans.append((len(picks), w + 1))
            picks += [(b, first + k) for k in range(w + 1)]
            self.stats.recompute_tokens += first
        ix = torch.tensor(picks, device=hidden.device)
        logits = self.passes.logits(hidden[ix[:, 0], ix[:, 1]])
        for r in reqs:
            r.cached = len(r.tokens)  # the pending tokens are now cached
        self.accept_rows(reqs, logits, spans)
        for r, (_, n) in zip(reqs, spans):
            self._grow(r, n - 1)
        self.stats.prefill_seconds += time.perf_counter() - start

    def _window(self, r: Request) -> int:
        """Draft tokens of `r` this pass feeds: a long (reused) draft starts with a window
        of `spec_tokens` that doubles each time it is accepted whole, up to
        `verify_window`, so a draft rejected early pads the pass little."""
        return min(len(r.draft), self._windows.get(r.id, self.spec_tokens))

    def _grow(self, r: Request, window: int) -> None:
        """After `r`'s verification: a window accepted whole (draft left) doubles."""
        if r.draft:
            self._windows[r.id] = min(2 * max(window, 1), self.verify_window)
        else:
            self._windows.pop(r.id, None)

    def accept(self, r: Request, logits: torch.Tensor) -> None:
        """Verify r.draft against `logits` ([len(draft) + 1, V]; [1, V] at admission)."""
        self.accept_rows([r], logits, [(0, logits.shape[0])])

    def accept_rows(self, reqs: list[Request], logits: torch.Tensor,
                    spans: list[tuple[int, int]]) -> None:
        """Verify each request's draft against its rows of `logits`: request i's are rows
        spans[i][0] .. + spans[i][1] (its draft's length + 1). The policy's draws and the
        draft tokens' log-probs of all rows come from one sampling call per sampling setting
        (one call per request cost as much as the pass's forward on CPU); each row keeps its
        own uniforms, so the tokens are those of a call per request."""
        seeds, accept_seeds, positions, scores, settings = [], [], [], [], []
        for r, (_, n) in zip(reqs, spans):
            if r.draft and not r.tokens:  # its first token: a draft it was submitted with
                self._reusing.add(r.id)
            draft = r.draft[:n]
            seeds += [r.seed] * n
            accept_seeds += [r.seed ^ _ACCEPT_STREAM] * n
            positions += range(len(r.tokens), len(r.tokens) + n)
            scores += draft + [0] * (n - len(draft))
            p = r.params
            settings += [(p.temperature, p.top_k, p.top_p)] * n
        tok, lp, lp_draft = sample_and_score_rows(logits, settings, uniforms(seeds, positions),
                                                  torch.tensor(scores, device=logits.device))
        accept_u = uniforms(accept_seeds, positions).tolist()
        for r, (s, n) in zip(reqs, spans):
            draft = r.draft[:n]
            out, lps, accepted = walk_draft(tok[s: s + n], lp[s: s + n], draft,
                                            lp_draft[s: s + n], accept_u[s: s + n], r)
            if draft:
                self.stats.spec_verifies += 1
                self.stats.spec_drafted += len(draft)
                self.stats.spec_accepted += accepted
            r.draft = r.draft[n:] if accepted == n else []
            if r.draft_logprobs is not None:
                r.draft_logprobs = r.draft_logprobs[n:] if r.draft else None
            before = len(r.tokens)
            self.emit(r, out, lps)
            self.on_emitted(r, logits[s: s + n], before)

    def on_emitted(self, r: Request, logits: torch.Tensor, before: int) -> None:
        """Called after `r`'s accepted tokens (those after its first `before`) were emitted,
        drawn from `logits` in order: a hook for per-token statistics (the engine's)."""
