"""The native engine: continuous batching over a token-budgeted KV cache, one shared prompt
prefill per group, abort and resume, exact behaviour log-probs, per-token policy versions,
speculative verification of drafts, divided rollout (chunks with parking), and per-token
statistics on request (`SamplingParams.top_logprobs`, `entropy`: computed from the logits
of the rows that ask, on every path a token is drawn: the first token from the prompt's
logits, decode steps, and the verifier; a step where no row asks computes nothing extra).

    engine = NativeEngine(policy.model, kv_budget_tokens=65536, max_num_seqs=64)
    outs = engine.generate(prompts, SamplingParams(n=8, temperature=1.0, max_tokens=256))

The lower-level interface drives it one step at a time:

    rid = engine.submit(prompt_ids, params, seed=7)      # one sequence
    done = engine.step()                                  # Completions finished this step
    part = engine.abort(rid)                              # partial ids, log-probs, versions
    rid2 = engine.submit(prompt_ids, params, seed=7, resume=part)   # continues it

Every step, finished sequences leave and waiting ones join (see `admission.py` for the
order, the shared prompt prefixes, the KV budget and parking), and drafts are verified by
`verifier.py`. Draws are counter-based (see `sampling.py`), so a request's tokens depend
only on its seed and the weights.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from rollwise.engine.admission import Admission
from rollwise.engine.base import ENGINE_ROWS, Drafter, EngineStats, SamplingParams
from rollwise.engine.decoder import Decoder, Taken
from rollwise.engine.kvcache import KVCache
from rollwise.engine.layers import Layers
from rollwise.engine.passes import Passes
from rollwise.engine.requests import Group, Request
from rollwise.engine.sampling import derive_seed, draw, token_stats
from rollwise.engine.step import DecodeStep
from rollwise.engine.verifier import DraftVerifier
from rollwise.types import Completion


class NativeEngine:
    def __init__(self, model, *, kv_budget_tokens: int = 65536, max_num_seqs: int = ENGINE_ROWS,
                 device: str | torch.device | None = None, dtype: torch.dtype | str | None = None,
                 eos_token_ids: list[int] | None = None, share_prefix: bool = True,
                 static_batch: bool = False, drafter: Drafter | None = None,
                 spec_tokens: int = 4, spec_max_batch: int = 8, version: int = 0,
                 weights_from: NativeEngine | None = None, step_mode: str = "auto",
                 spec_max_tokens: int = 0, own_weights: bool = False):
        """`static_batch`: admit only into an empty batch and keep finished rows computing
        until the whole batch ends (a baseline). `drafter`: given [(request id, tokens so
        far)] and `spec_tokens` returns a draft per request; consulted when at most
        `spec_max_batch` rows run (speculation pays in small batches). Both are defaults
        that a caller of `step` may replace for that step (the rollout scheduler does).
        `spec_max_tokens`: the widest window a long draft's verification grows to (0: none
        wider than `spec_tokens`; see verifier.py).
        `dtype`: the weights, activations and KV cache (float32 or bfloat16), see
        docs/precision.md. `weights_from`: an engine over the same model whose converted
        weights this one reads (refreshed when that engine publishes), e.g. the evaluator's.
        `own_weights`: a copy of the weights even in the parameters' precision, refreshed
        only at a publication (a trainer in another thread updates them in place).
        `step_mode`: how the single-token decode step runs (step.py): eager, graph (CUDA
        graphs per batch bucket), compile (torch.compile), or auto (graph on CUDA, else
        eager)."""
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.borrowed = weights_from is not None  # its owner refreshes the weights
        if weights_from is not None:
            self.decoder = weights_from.decoder
        else:
            self.decoder = Decoder(model, dtype=dtype, device=device, own_weights=own_weights)
        d = self.decoder
        self.cache = KVCache(len(d.layers), d.kv_heads, d.head_dim, d.dtype, d.device)
        self.share_prefix, self.static_batch, self.version = share_prefix, static_batch, version
        self.drafter = drafter
        if eos_token_ids is None:
            eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
            eos = eos if eos is not None else d.cfg.eos_token_id
            eos_token_ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        self.eos_token_ids = [int(e) for e in eos_token_ids if e is not None]
        self.stats = EngineStats()
        self.admission = Admission(self.cache, self.stats, kv_budget_tokens=kv_budget_tokens,
                                   max_num_seqs=max_num_seqs)
        layers = Layers(d)
        self.passes = Passes(layers, self.cache)  # prefill and chunk passes
        self.decode_step = DecodeStep(layers, self.cache, step_mode, max_rows=max_num_seqs,
                                      kv_budget_tokens=kv_budget_tokens)
        self.verifier = _NotingVerifier(self.passes, self.cache, self.stats, self._emit,
                                        spec_tokens=spec_tokens, spec_max_batch=spec_max_batch,
                                        verify_window=spec_max_tokens)
        self.verifier.note = self._note_stats
        self._next_id = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.dtype

    @property
    def max_context(self) -> int:
        return self.decoder.max_context

    @property
    def kv_budget_tokens(self) -> int:
        return self.admission.kv_budget_tokens

    @torch.inference_mode()
    def take(self) -> Taken | None:
        """The weights as they are now, converted for this engine and installed by a later
        `publish(version, taken)`: the rollout side's stage of a publication. None when
        the engine does not own its weights (it reads the parameters in place, or converts
        them at `publish`: nothing trains while it generates)."""
        if self.borrowed or not self.decoder.own_weights:
            return None
        return self.decoder.take()

    @torch.inference_mode()
    def publish(self, version: int, taken: Taken | None = None) -> None:
        """New weights are in place (or in `taken`): later tokens carry `version`. Cached
        prompts of groups with no running row are dropped (recomputed under the new
        weights when needed). An engine reading another's weights only follows them."""
        self.version = version
        if not self.borrowed:
            self.stats.publish_seconds += self.decoder.refresh(taken)
        self.admission.evict_idle_prefixes(keep=None)
        self.admission.follow_weights(self.decoder.generation)

    def release_cache(self) -> int:
        """Free the key/value cache while no request waits or runs (between a step's rollouts
        and its update, after an evaluation); the bytes freed (0 while busy). Idle prompts go
        with it (recomputed if asked again); retained conversations are kept aside as they
        were."""
        if self.admission.requests or self.admission.rows:
            return 0
        self.admission.evict_idle_prefixes(keep=None)
        return self.cache.release()

    # -- requests --------------------------------------------------------------------------

    def submit(self, prompt: list[int], params: SamplingParams, *, seed: int | None = None,
               resume: Completion | None = None, tag: int = 0, priority: float = 0.0,
               chunk_tokens: int = 0, draft: list[int] | None = None,
               draft_logprobs: list[float] | None = None, lenience: float | None = None,
               keep_kv: bool = False) -> int:
        """Queue one sequence (params.n is ignored: submit n times for a group; identical
        prompts share their prefix). `resume`: a partial Completion (from `abort`) to
        continue. `draft`: a proposed continuation verified in one pass (exact acceptance,
        or SPEC-RL's lenient rule when `lenience` and the draft's `draft_logprobs` are
        given). `keep_kv`: a conversation's turn: when it finishes, its keys/values are kept
        so that a later prompt extending prompt + tokens computes only what is new (see
        admission.py). Returns the request id."""
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
        group = self.admission.group(key, prompt)
        stops = frozenset() if params.ignore_eos else frozenset(
            params.stop_token_ids if params.stop_token_ids is not None else self.eos_token_ids)
        req = Request(rid, group, params, seed, stops, tag, priority, chunk_tokens,
                      keep_kv=keep_kv)
        if resume is not None:
            req.tokens = list(resume.token_ids)
            req.logprobs = list(resume.logprobs)
            req.versions = list(resume.versions) or [self.version] * done
        self._ask_stats(req, resume)
        if draft:
            room = params.max_tokens - done
            req.draft = list(draft[:room])
            req.draft_logprobs = list(draft_logprobs[:room]) if draft_logprobs else None
            req.lenience = lenience
        self.admission.queue(req)
        return rid

    def retune(self, rid: int, params: SamplingParams) -> None:
        """Draw a running request's next tokens under `params` (temperature, top-k/top-p;
        its stop tokens and max_tokens stay those it was submitted with): tree rollouts move
        greedy branches to sampling without recomputing them. Statistics `params` no longer
        asks for are dropped; new ones cannot be asked for midway."""
        req = self.admission.requests[rid]
        if (params.top_logprobs > 0 and req.top_logprobs is None) or (
                params.entropy and req.entropies is None):
            raise ValueError("retune cannot start per-token statistics midway")
        if params.max_tokens != req.params.max_tokens:
            raise ValueError("retune keeps the request's max_tokens")
        req.params = params
        if params.top_logprobs <= 0:
            req.top_logprobs = None
        if not params.entropy:
            req.entropies = None

    def set_priority(self, rid: int, priority: float) -> None:
        """Re-rank a waiting or running request (ignored once it has finished)."""
        if rid in self.admission.requests:
            self.admission.requests[rid].priority = priority

    def has_unfinished(self) -> bool:
        return bool(self.admission.requests)

    def num_running(self) -> int:
        return self.admission.num_running()

    def kv_tokens(self) -> int:
        """Tokens held in the cache now (each computed prompt once)."""
        return self.admission.kv_tokens()

    def peek(self, rid: int) -> Completion:
        """The request's tokens so far (finish_reason 'abort' if it were stopped now)."""
        return self.admission.requests[rid].completion("abort")

    def branch_kv(self, prompt: list[int], tokens: list[int], cuts: list[int]) -> int:
        """Tree forks inside a response: the retained keys/values of the finished
        conversation `prompt` + `tokens` (submitted with keep_kv) are lent to later requests
        whose prompts are prompt + tokens[:t] for t in `cuts`: each such group takes its
        copy at admission (counted in `reused_tokens`) and computes only its last token. The
        conversation's own entry is let go. Returns the entries made (0: nothing retained,
        e.g. dropped for room or by a publication; the forks are then prefilled in full)."""
        full, retained = tuple(prompt) + tuple(tokens), self.admission.retained
        need = len(prompt) + max(cuts, default=0)
        key = next((k for k in reversed(retained) if len(k) >= need and full[: len(k)] == k),
                   None)
        if key is None:
            return 0
        kv = retained.pop(key)
        for n in sorted({len(prompt) + t for t in cuts}):
            retained[full[:n]] = kv[:, :, :, :n]  # views: no copy until a fork is admitted
        return len(set(cuts))

    @torch.inference_mode()
    def abort(self, rid: int) -> Completion:
        """Stop a request; its partial tokens, log-probs and versions come back."""
        req = self.admission.requests[rid]
        self.admission.remove(req)
        return req.completion("abort")

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One Completion per prompt x n, in order (prompt 0's n samples first)."""
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine; use submit/step instead")
        base = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)))
        one = replace(params, n=1)
        ids = [self.submit(p, one, seed=derive_seed(base, i * params.n + k), tag=i)
               for i, p in enumerate(prompts) for k in range(params.n)]
        done: dict[int, Completion] = {}
        while self.has_unfinished():
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
        adm = self.admission
        adm.follow_weights(self.decoder.generation)  # published here or by the weights' owner
        self._start(*adm.admit(static))
        if adm.rows:
            self.verifier.attach_drafts(adm.rows, drafter or self.drafter)
            adm.make_room()
            rows = list(adm.rows)
            # finished by their first token (drawn at admission): nothing to decode, unless
            # a static batch keeps them computing
            done = set() if static else {i for i, r in enumerate(rows) if not r.zombie
                                         and r.finish_reason(self.max_context) is not None}
            single = [i for i, r in enumerate(rows) if r.inputs == 1 and i not in done]
            multi = [i for i, r in enumerate(rows) if r.inputs > 1 and i not in done]
            if multi and single and self.verifier.merges(len(rows), len(multi)):
                multi, single = single + multi, []  # one pass, some padding (merges says when)
            if single and not multi and not done and self.decode_step.mode != "rows":
                # every row decodes one token: the static-shape step
                self._decode(rows)
            elif single:
                self._decode([rows[i] for i in single], single)
            if multi:
                self.verifier.verify([rows[i] for i in multi], multi, len(adm.rows))
        finished = self._retire(static)
        self.stats.peak_kv_tokens = max(self.stats.peak_kv_tokens, self.kv_tokens())
        return finished

    def _start(self, new_groups: list[Group], fresh: list[Request]) -> None:
        """Prefill the newly admitted prompts and draw the first token of fresh requests
        (verifying their draft, if they came with one)."""
        if new_groups:
            self._prefill(new_groups)
        start = time.perf_counter()
        plain = [r for r in fresh if not r.draft]
        if plain:
            logits = torch.stack([r.group.logits for r in plain])
            before = [len(r.tokens) for r in plain]
            for i, (tok, lp) in self._draw(plain, logits).items():
                self._emit(plain[i], [tok], [lp])
            self._note_stats(plain, logits, before)
        drafted = [r for r in fresh if r.draft]
        if drafted:  # the first token of each: one sampling call for all
            self.verifier.accept_rows(drafted, torch.stack([r.group.logits for r in drafted]),
                                      [(i, 1) for i in range(len(drafted))])
        self.stats.decode_seconds += time.perf_counter() - start

    def _prefill(self, groups: list[Group]) -> None:
        start = time.perf_counter()
        plain = [g for g in groups if g.reuse is None]  # their slots come first (admission)
        if plain:
            lengths = [len(g.tokens) for g in plain]
            width = max(lengths)
            self.cache.ensure_prefix(len(self.admission.slots), width)
            ids = torch.zeros(len(plain), width, dtype=torch.long)
            for i, g in enumerate(plain):
                ids[i, : len(g.tokens)] = torch.tensor(g.tokens)
            logits = self.passes.prefill(ids.to(self.decoder.device), lengths, plain[0].slot)
            for g, row in zip(plain, logits):
                g.logits = row
            self.stats.forward_passes += 1
            self.stats.prefill_tokens += sum(lengths)
        kept = [g for g in groups if g.reuse is not None]
        if kept:  # a conversation's next turn: only the tokens after the kept cache
            self.cache.ensure_prefix(len(self.admission.slots), max(len(g.tokens) for g in kept))
            starts = []
            for g in kept:
                self.cache.put_prefix(g.slot, g.reuse)
                starts.append(g.reuse.shape[3])
                g.reuse = None
            logits = self.passes.prefill_from([g.slot for g in kept],
                                              [g.tokens[n:] for g, n in zip(kept, starts)],
                                              starts)
            for g, row in zip(kept, logits):
                g.logits = row
            self.stats.forward_passes += 1
            self.stats.prefill_tokens += sum(len(g.tokens) for g in kept) - sum(starts)
            self.stats.reused_tokens += sum(starts)
        self.stats.prefill_seconds += time.perf_counter() - start

    def _decode(self, reqs: list[Request], rows: list[int] | None = None) -> None:
        """One token for each of `reqs`: through the static-shape step when they are every
        resident row (`rows` None: rows 0..B-1), else through the general chunk pass over
        cache rows `rows`."""
        start = time.perf_counter()
        if rows is None:
            drawn, logits = self.decode_step(reqs)
        else:
            self.cache.ensure_rows(len(self.admission.rows), max(r.cached for r in reqs) + 1)
            plan = self.passes.plan(rows, [[r.tokens[-1]] for r in reqs],
                                    [r.cached for r in reqs], [r.group.slot for r in reqs],
                                    [len(r.group.tokens) for r in reqs])
            hidden = self.passes.forward_rows(plan)[:, -1]
            drawn, logits = None, self.passes.logits(hidden)
        for r in reqs:
            r.cached += 1
        self.stats.forward_passes += 1
        self.stats.decode_passes += 1
        self.stats.decode_tokens += len(reqs)
        self.stats.row_forwards += len(reqs)
        if drawn is not None:  # [2, B]: ids and log-probs, one copy from the device
            ids, lps = drawn.tolist()
            for r, tok, lp in zip(reqs, ids, lps):
                self._emit(r, [int(tok)], [lp])
        else:
            before = [len(r.tokens) for r in reqs]
            for idx, (tok, lp) in self._draw(reqs, logits).items():
                self._emit(reqs[idx], [tok], [lp])
            self._note_stats(reqs, logits, before)
        self.stats.decode_seconds += time.perf_counter() - start

    def _draw(self, reqs: list[Request], logits: torch.Tensor) -> dict[int, tuple[int, float]]:
        """Each request's next token from its row of `logits`, by its sampling settings."""
        settings = [(r.params.temperature, r.params.top_k, r.params.top_p) for r in reqs]
        return draw(logits, settings, [r.seed for r in reqs], [len(r.tokens) for r in reqs])

    def _ask_stats(self, req: Request, resume: Completion | None) -> None:
        """Start the per-token statistics lists of a request whose params ask for them (a
        resumed one continues its own, which must cover every token it already has)."""
        p, done = req.params, len(req.tokens)
        for name, asked in (("top_logprobs", p.top_logprobs > 0), ("entropies", p.entropy)):
            if not asked:
                continue
            have = getattr(resume, name, None) if resume is not None else None
            if done and (have is None or len(have) != done):
                raise ValueError(f"resumed request asks for {name} but its Completion does "
                                 f"not carry them for its {done} tokens")
            setattr(req, name, list(have) if done else [])

    def _note_stats(self, reqs: list[Request], logits: torch.Tensor, before: list[int],
                    starts: list[int] | None = None) -> None:
        """Record per-token statistics for the requests among `reqs` that ask: request i's
        tokens after `before[i]` were drawn from rows starts[i], starts[i] + 1, ... of
        `logits` (default row i). Nothing runs when no request asks."""
        starts = range(len(reqs)) if starts is None else starts
        picks, owners = [], []
        for r, b, s in zip(reqs, before, starts):
            if r.wants_stats and not r.zombie:
                new = len(r.tokens) - b
                picks += range(s, s + new)
                owners += [r] * new
        if not picks:
            return
        top, ent = token_stats(logits[picks], max(r.params.top_logprobs for r in owners))
        for r, t, e in zip(owners, top, ent):
            if r.top_logprobs is not None:
                r.top_logprobs.append(t[: r.params.top_logprobs])
            if r.entropies is not None:
                r.entropies.append(e)

    def _emit(self, r: Request, tokens: list[int], lps: list[float]) -> None:
        """Append tokens up to the first stop or the length limit; the last is pending."""
        if not r.zombie and r.finish_reason(self.max_context) is not None:
            return  # finished by its first token this step: its row retires at the step's end
        if r.zombie:  # a finished row of a static batch: it computes on, reporting nothing
            r.tokens.append(tokens[0])
        else:
            for t, lp in zip(tokens, lps):
                r.tokens.append(t)
                r.logprobs.append(lp)
                r.versions.append(self.version)
                self.stats.generated_tokens += 1
                if r.finish_reason(self.max_context) is not None:
                    break
        r.cached = len(r.tokens) - 1

    def _retire(self, static: bool) -> list[Completion]:
        """The requests that finished this step; the admission lets their rows go (a static
        batch keeps them until all are done) and parks the rows that ran their chunk."""
        finished, done = [], set()
        for i, r in enumerate(self.admission.rows):
            reason = None if r.zombie else r.finish_reason(self.max_context)
            if reason is not None:
                finished.append(r.completion(reason))
                done.add(i)
        self.admission.retire(done, static)
        return finished


class _NotingVerifier(DraftVerifier):
    """The draft verifier, recording the per-token statistics of the tokens it emits for
    requests that ask (a resumed or preempted row's first token and accepted drafts come
    through here). `note` is the engine's `_note_stats`."""

    note = None

    def on_emitted(self, r: Request, logits: torch.Tensor, before: int) -> None:
        if r.wants_stats:
            self.note([r], logits, [before], [0])
