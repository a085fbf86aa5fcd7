"""The native engine: continuous batching over a token-budgeted KV cache, one shared prompt
prefill per group, abort and resume, exact behaviour log-probs, per-token policy versions,
speculative verification of drafts, and divided rollout (chunks with parking).

    engine = NativeEngine(policy.model, kv_budget_tokens=65536, max_num_seqs=128)
    outs = engine.generate(prompts, SamplingParams(n=8, temperature=1.0, max_tokens=256))

The lower-level interface drives it one step at a time:

    rid = engine.submit(prompt_ids, params, seed=7)      # one sequence
    done = engine.step()                                  # Completions finished this step
    part = engine.abort(rid)                              # partial ids, log-probs, versions
    rid2 = engine.submit(prompt_ids, params, seed=7, resume=part)   # continues it

Every step, finished sequences leave and waiting ones join (highest `priority` first, then
submission order). Requests with identical prompt ids share one prefix, prefilled once,
while any of them is unfinished. The budget counts the tokens held in the cache (each
shared prompt once). A request waits when it would exceed the budget; when the running rows
outgrow it, the newest is parked: its cache is set aside (host memory, as Seer's global
pool) and restored when it is admitted again. With `chunk_tokens`, a request is parked
after that many tokens and re-queued (Seer's divided rollout). Draws are counter-based (see
`sampling.py`), so a request's tokens depend only on its seed and the weights.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace

import torch

from rollwise.engine.base import Completion, Drafter, SamplingParams
from rollwise.engine.decoder import Decoder
from rollwise.engine.kvcache import KVCache
from rollwise.engine.requests import EngineStats, Group, Request, walk_draft
from rollwise.engine.sampling import derive_seed, sample_and_score, sample_tokens, uniforms

_ACCEPT_STREAM = 0x5DEECE66D  # second uniform stream (lenient acceptance tests)


class NativeEngine:
    def __init__(self, model, *, kv_budget_tokens: int = 65536, max_num_seqs: int = 128,
                 device: str | torch.device | None = None, dtype: torch.dtype | str | None = None,
                 eos_token_ids: list[int] | None = None, share_prefix: bool = True,
                 static_batch: bool = False, drafter: Drafter | None = None,
                 spec_tokens: int = 4, spec_max_batch: int = 8, version: int = 0,
                 weights_from: NativeEngine | None = None):
        """`static_batch`: admit only into an empty batch and keep finished rows computing
        until the whole batch ends (a baseline). `drafter`: given [(request id, tokens so
        far)] and `spec_tokens` returns a draft per request; consulted when at most
        `spec_max_batch` rows run (speculation pays in small batches). Both are defaults
        that a caller of `step` may replace for that step (the rollout scheduler does).
        `dtype`: the weights, activations and KV cache (float32 or bfloat16), see
        docs/precision.md. `weights_from`: an engine over the same model whose converted
        weights this one reads (refreshed when that engine publishes), e.g. the evaluator's."""
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if weights_from is not None:
            self.decoder = weights_from.decoder
        else:
            self.decoder = Decoder(model, dtype=dtype, device=device)
        d = self.decoder
        self.cache = KVCache(len(d.layers), d.kv_heads, d.head_dim, d.dtype, d.device)
        self.kv_budget_tokens, self.max_num_seqs = kv_budget_tokens, max_num_seqs
        self.share_prefix, self.static_batch, self.version = share_prefix, static_batch, version
        self.drafter, self.spec_tokens, self.spec_max_batch = drafter, spec_tokens, spec_max_batch
        self.verify_window = 16  # draft tokens one verification pass feeds per row (a long
        # reused draft is verified in windows: a rejection early wastes at most this much)
        if eos_token_ids is None:
            eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
            eos = eos if eos is not None else d.cfg.eos_token_id
            eos_token_ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        self.eos_token_ids = [int(e) for e in eos_token_ids if e is not None]
        self.stats = EngineStats()
        self._groups: dict[tuple, Group] = {}
        self._slots: list[Group] = []  # computed prefixes, by slot
        self._rows: list[Request] = []  # resident, by row
        self._waiting: deque[Request] = deque()
        self._requests: dict[int, Request] = {}
        self._next_id = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.dtype

    @property
    def max_context(self) -> int:
        return self.decoder.max_context

    @torch.inference_mode()
    def publish(self, version: int) -> None:
        """New weights are in place: later tokens carry `version`. Cached prompts of groups
        with no running row are dropped (recomputed under the new weights when needed)."""
        self.version = version
        self.stats.publish_seconds += self.decoder.refresh()
        for g in [g for g in self._slots if g.running == 0]:
            self._drop_prefix(g)

    # -- requests --------------------------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams, *, seed: int | None = None,
               resume: Completion | None = None, tag: int = 0, priority: float = 0.0,
               chunk_tokens: int = 0, draft: list[int] | None = None,
               draft_logprobs: list[float] | None = None, lenience: float | None = None) -> int:
        """Queue one sequence (params.n is ignored: submit n times for a group; identical
        prompts share their prefix). `resume`: a partial Completion (from `abort`) to
        continue. `draft`: a proposed continuation verified in one pass (exact acceptance,
        or SPEC-RL's lenient rule when `lenience` and the draft's `draft_logprobs` are
        given). Returns the request id."""
        if not prompt:
            raise ValueError("empty prompt")
        done = len(resume.token_ids) if resume is not None else 0
        if done >= params.max_tokens:
            raise ValueError(f"resumed request already has {done} of max_tokens="
                             f"{params.max_tokens} tokens: nothing left to generate")
        if len(prompt) + done >= self.max_context:
            raise ValueError(f"prompt of {len(prompt)} tokens (+{done} resumed) leaves no room "
                             f"in the model's context of {self.max_context}")
        if len(prompt) + params.max_tokens + 1 > self.kv_budget_tokens:
            raise ValueError(f"one request needs up to {len(prompt) + params.max_tokens + 1} "
                             f"cached tokens, over kv_budget_tokens={self.kv_budget_tokens}")
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)))
        rid = self._next_id
        self._next_id += 1
        key = tuple(prompt) if self.share_prefix else (rid, *prompt)
        group = self._groups.get(key) or self._groups.setdefault(key, Group(key, list(prompt)))
        group.refs += 1
        stops = frozenset() if params.ignore_eos else frozenset(
            params.stop_token_ids if params.stop_token_ids is not None else self.eos_token_ids)
        req = Request(rid, group, params, seed, stops, tag, priority, chunk_tokens)
        if resume is not None:
            req.tokens = list(resume.token_ids)
            req.logprobs = list(resume.logprobs)
            req.versions = list(resume.versions) or [self.version] * done
        if draft:
            room = params.max_tokens - done
            req.draft = list(draft[:room])
            req.draft_logprobs = list(draft_logprobs[:room]) if draft_logprobs else None
            req.lenience = lenience
        self._requests[rid] = req
        self._waiting.append(req)
        return rid

    def set_priority(self, rid: int, priority: float) -> None:
        """Re-rank a waiting or running request (ignored once it has finished)."""
        if rid in self._requests:
            self._requests[rid].priority = priority

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def num_running(self) -> int:
        return sum(not r.zombie for r in self._rows)

    def kv_tokens(self) -> int:
        """Tokens held in the cache now (each computed prompt once)."""
        return sum(len(g.tokens) for g in self._slots) + sum(r.cached for r in self._rows)

    def peek(self, rid: int) -> Completion:
        """The request's tokens so far (finish_reason 'abort' if it were stopped now)."""
        return self._completion(self._requests[rid], "abort")

    @torch.inference_mode()
    def abort(self, rid: int) -> Completion:
        """Stop a request; its partial tokens, log-probs and versions come back."""
        req = self._requests[rid]
        if req in self._rows:
            self._remove_rows([self._rows.index(req)])
        else:
            self._waiting.remove(req)
            self._finish(req)
        return self._completion(req, "abort")

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One Completion per prompt x n, in order (prompt 0's n samples first)."""
        if self._requests:
            raise RuntimeError("generate() needs an idle engine; use submit/step instead")
        base = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)))
        one = replace(params, n=1)
        ids = [self.submit(p, one, seed=derive_seed(base, i * params.n + k), tag=i)
               for i, p in enumerate(prompts) for k in range(params.n)]
        done: dict[int, Completion] = {}
        while self._requests:
            for c in self.step():
                done[c.request_id] = c
        return [done[i] for i in ids]

    # -- one step --------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, *, static_batch: bool | None = None,
             drafter: Drafter | None = None) -> list[Completion]:
        """Admit what fits, advance every resident row (one token, or a verified draft);
        returns the requests finished in this step. `static_batch`, `drafter`: this step's
        admission mode and draft source (None: the engine's own, from construction)."""
        static = self.static_batch if static_batch is None else static_batch
        self.stats.steps += 1
        emitted: dict[int, int] = {}  # request id -> tokens emitted this step
        self._admit(emitted, static)
        if self._rows:
            self._attach_drafts(drafter or self.drafter)
            self._make_room()
            rows = list(self._rows)
            single = [i for i, r in enumerate(rows) if _inputs(r) == 1]
            multi = [i for i, r in enumerate(rows) if _inputs(r) > 1]
            if multi and single and len(rows) <= self.spec_max_batch:
                multi, single = single + multi, []  # small batch: one pass, a little padding
            if single:
                self._decode([rows[i] for i in single], single, emitted)
            if multi:
                self._verify([rows[i] for i in multi], multi, emitted)
        finished = self._retire(emitted, static)
        self.stats.peak_kv_tokens = max(self.stats.peak_kv_tokens, self.kv_tokens())
        return finished

    def _decode(self, reqs: list[Request], rows: list[int], emitted: dict[int, int]) -> None:
        start = time.perf_counter()
        self.cache.ensure_rows(len(self._rows), max(r.cached for r in reqs) + 1)
        plan = self.decoder.plan(rows, [[r.tokens[-1]] for r in reqs], [r.cached for r in reqs],
                                 [r.group.slot for r in reqs], [len(r.group.tokens) for r in reqs])
        hidden = self.decoder.forward_rows(self.cache, plan)[:, -1]
        for r in reqs:
            r.cached += 1
        self.stats.forward_passes += 1
        self.stats.decode_tokens += len(reqs)
        self.stats.row_forwards += len(reqs)
        logits = self.decoder.logits(hidden)
        for idx, (tok, lp) in self._draw(reqs, logits).items():
            self._emit(reqs[idx], [tok], [lp], emitted)
        self.stats.decode_seconds += time.perf_counter() - start

    def _draw(self, reqs: list[Request], logits: torch.Tensor) -> dict[int, tuple[int, float]]:
        """Each request's next token from its row of `logits`, by sampling settings."""
        by_params: dict[tuple, list[int]] = {}
        for i, r in enumerate(reqs):
            p = r.params
            by_params.setdefault((p.temperature, p.top_k, p.top_p), []).append(i)
        out = {}
        for (temp, top_k, top_p), idx in by_params.items():
            sub = logits if len(idx) == len(reqs) else logits[idx]
            u = uniforms([reqs[i].seed for i in idx], [len(reqs[i].tokens) for i in idx])
            tok, lp = sample_tokens(sub, temp, top_k, top_p, u)
            out.update(zip(idx, zip(tok.tolist(), lp.tolist())))
        return out

    def _verify(self, reqs: list[Request], rows: list[int], emitted: dict[int, int]) -> None:
        """One pass over each row's pending tokens plus its draft; emit what is accepted."""
        start = time.perf_counter()
        w = self.verify_window
        chunks = [r.tokens[r.cached:] + r.draft[:w] for r in reqs]
        # padded positions of short chunks are written too: room for the widest chunk
        self.cache.ensure_rows(len(self._rows), max(r.cached for r in reqs)
                               + max(map(len, chunks)))
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
            self._accept(r, logits[s: s + n], emitted)
        self.stats.prefill_seconds += time.perf_counter() - start

    def _accept(self, r: Request, logits: torch.Tensor, emitted: dict[int, int]) -> None:
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
        self._emit(r, out, lps, emitted)

    def _emit(self, r: Request, tokens: list[int], lps: list[float],
              emitted: dict[int, int]) -> None:
        """Append tokens up to the first stop or the length limit; the last is pending."""
        if r.zombie:  # a finished row of a static batch: it computes on, reporting nothing
            r.tokens.append(tokens[0])
        else:
            for t, lp in zip(tokens, lps):
                r.tokens.append(t)
                r.logprobs.append(lp)
                r.versions.append(self.version)
                emitted[r.id] = emitted.get(r.id, 0) + 1
                self.stats.generated_tokens += 1
                if self._finish_reason(r) is not None:
                    break
        r.cached = len(r.tokens) - 1

    def _finish_reason(self, r: Request) -> str | None:
        if not r.tokens:
            return None
        if r.tokens[-1] in r.stops:
            return "stop"
        if len(r.tokens) >= r.params.max_tokens:
            return "length"
        if len(r.group.tokens) + len(r.tokens) >= self.max_context:
            return "length"
        return None

    # -- admission, budget, retirement -----------------------------------------------------

    def _pick(self) -> Request:
        if any(r.priority for r in self._waiting):
            return max(self._waiting, key=lambda r: r.priority)  # first of the highest
        return self._waiting[0]

    def _admit(self, emitted: dict[int, int], static: bool) -> None:
        if static and self._rows:
            return
        new_groups: list[Group] = []
        fresh: list[Request] = []
        held = self.kv_tokens() + sum(_inputs(r) for r in self._rows)
        while self._waiting and len(self._rows) < self.max_num_seqs:
            req = self._pick()
            g = req.group
            need = (len(g.tokens) if g.slot < 0 else 0) + len(req.tokens) + 1 + len(req.draft)
            if held + need > self.kv_budget_tokens:
                if self._rows or not self._evict_idle_prefixes(keep=g):
                    break
                held = self.kv_tokens()
                continue
            held += need
            self._waiting.remove(req)
            if g.slot < 0:
                g.slot = len(self._slots)
                self._slots.append(g)
                new_groups.append(g)
            g.running += 1
            self._rows.append(req)
            req.resident_since = len(req.tokens)
            if req.parked is not None:
                self._restore(req, len(self._rows) - 1)
            elif not req.tokens:
                fresh.append(req)
        if new_groups:
            self._prefill(new_groups)
        start = time.perf_counter()
        plain = [r for r in fresh if not r.draft]
        if plain:
            draws = self._draw(plain, torch.stack([r.group.logits for r in plain]))
            for i, (tok, lp) in draws.items():
                self._emit(plain[i], [tok], [lp], emitted)
        for r in fresh:
            if r.draft:
                self._accept(r, r.group.logits[None], emitted)
        self.stats.decode_seconds += time.perf_counter() - start

    def _prefill(self, groups: list[Group]) -> None:
        start = time.perf_counter()
        lengths = [len(g.tokens) for g in groups]
        width = max(lengths)
        self.cache.ensure_prefix(len(self._slots), width)
        ids = torch.zeros(len(groups), width, dtype=torch.long)
        for i, g in enumerate(groups):
            ids[i, : len(g.tokens)] = torch.tensor(g.tokens)
        logits = self.decoder.prefill(self.cache, ids.to(self.decoder.device), lengths,
                                      groups[0].slot)
        for g, row in zip(groups, logits):
            g.logits = row
        self.stats.forward_passes += 1
        self.stats.prefill_tokens += sum(lengths)
        self.stats.prefill_seconds += time.perf_counter() - start

    def _attach_drafts(self, drafter: Drafter | None) -> None:
        """Ask the drafter for continuations when the batch is small enough to profit."""
        if drafter is None or self.num_running() > self.spec_max_batch:
            return
        rows = [r for r in self._rows if not r.zombie and not r.draft and _inputs(r) == 1]
        if not rows:
            return
        drafts = drafter([(r.id, r.tokens) for r in rows], self.spec_tokens)
        for r, d in zip(rows, drafts):
            room = r.params.max_tokens - len(r.tokens) - 1
            r.draft = list(d[: min(self.spec_tokens, room)]) if room > 0 else []

    def _make_room(self) -> None:
        """Keep the cache within budget for this step's inputs: drop drafts, drop idle
        prompts, then park the newest rows."""
        def over() -> bool:
            return self.kv_tokens() + sum(_inputs(r) for r in self._rows) > self.kv_budget_tokens

        if over():
            for r in self._rows:
                r.draft, r.draft_logprobs = [], None
        while over():
            if self._evict_idle_prefixes(keep=None):
                continue
            if len(self._rows) <= 1:
                break
            self._park([len(self._rows) - 1])
            self.stats.preemptions += 1

    def _park(self, rows: list[int]) -> None:
        """Set rows aside with their cache and queue them again (front for preemptions)."""
        for i in rows:
            r = self._rows[i]
            r.parked = self.cache.take_row(i, r.cached)
        reqs = [self._rows[i] for i in rows]
        self._remove_rows(rows, requeue=True)
        self.stats.parks += len(reqs)
        for r in reqs:
            self._waiting.appendleft(r)

    def _restore(self, r: Request, row: int) -> None:
        n = r.parked.shape[3]
        self.cache.ensure_rows(len(self._rows), n + 1)
        self.cache.put_row(row, r.parked)
        r.cached, r.parked = n, None

    def _retire(self, emitted: dict[int, int], static: bool) -> list[Completion]:
        finished, gone, park = [], [], []
        for i, r in enumerate(self._rows):
            if r.zombie:
                continue
            reason = self._finish_reason(r)
            if reason is not None:
                finished.append(self._completion(r, reason))
                if static:
                    r.zombie = True
                    self._requests.pop(r.id, None)
                else:
                    gone.append(i)
            elif (r.chunk_tokens and self._waiting
                  and len(r.tokens) - r.resident_since >= r.chunk_tokens):
                park.append(i)
        if static and self._rows and all(r.zombie for r in self._rows):
            gone = list(range(len(self._rows)))
        for i in park:
            self._rows[i].parked = self.cache.take_row(i, self._rows[i].cached)
        parked = [self._rows[i] for i in park]
        self._remove_rows(sorted(gone + park), requeue_ids={r.id for r in parked})
        self._waiting.extend(parked)
        self.stats.parks += len(parked)
        return finished

    def _evict_idle_prefixes(self, keep: Group | None) -> bool:
        idle = [g for g in self._slots if g.running == 0 and g is not keep]
        for g in idle:
            self._drop_prefix(g)
        return bool(idle)

    def _drop_prefix(self, g: Group) -> None:
        last = self._slots[-1]
        if last is not g:
            self.cache.move_group(last.slot, g.slot, len(last.tokens))
            self._slots[g.slot] = last
            last.slot = g.slot
        self._slots.pop()
        g.slot, g.logits = -1, None

    def _remove_rows(self, rows: list[int], *, requeue: bool = False,
                     requeue_ids: set[int] | None = None) -> None:
        """Take rows out of the batch (the last row moves into each hole); finish those
        not re-queued."""
        for i in sorted(rows, reverse=True):
            req = self._rows[i]
            last = self._rows[-1]
            if last is not req:
                self.cache.move_row(len(self._rows) - 1, i, last.cached)
                self._rows[i] = last
            self._rows.pop()
            req.group.running -= 1
            if req.parked is None:
                req.cached = 0
            if not (requeue or (requeue_ids and req.id in requeue_ids)):
                self._finish(req)

    def _finish(self, req: Request) -> None:
        self._requests.pop(req.id, None)
        g = req.group
        g.refs -= 1
        if g.refs == 0:
            if g.slot >= 0:
                self._drop_prefix(g)
            self._groups.pop(g.key, None)

    def _completion(self, r: Request, reason: str) -> Completion:
        return Completion(prompt_index=r.tag, token_ids=list(r.tokens), logprobs=list(r.logprobs),
                          finish_reason=reason, versions=list(r.versions), request_id=r.id)


def _inputs(r: Request) -> int:
    """Tokens the row feeds to the model this step: pending ones plus its draft."""
    return len(r.tokens) - r.cached + len(r.draft)
