"""The native engine: continuous batching over a token-budgeted KV cache, one shared prompt
prefill per group, abort and resume, exact behaviour log-probs, per-token policy versions.

    engine = NativeEngine(policy.model, kv_budget_tokens=65536, max_num_seqs=128)
    outs = engine.generate(prompts, SamplingParams(n=8, temperature=1.0, max_tokens=256))

The lower-level interface drives it one step at a time:

    rid = engine.submit(prompt_ids, params, seed=7)      # one sequence
    done = engine.step()                                  # Completions finished this step
    part = engine.abort(rid)                              # partial ids, log-probs, versions
    rid2 = engine.submit(prompt_ids, params, seed=7, resume=part)   # continues it

Every step, finished sequences leave and waiting ones join. Requests with identical prompt
ids share one prefix (prefilled once) while any of them is unfinished. The budget counts
the tokens held in the cache (each shared prompt once); a request waits when they would
exceed it, and when the running rows outgrow it the newest is preempted, its tokens kept,
and recomputed on re-admission. Draws are counter-based (see `sampling.py`), so a
request's tokens depend only on its seed and the weights.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from rollwise.engine.base import Completion, SamplingParams
from rollwise.engine.decoder import Decoder
from rollwise.engine.kvcache import KVCache
from rollwise.engine.sampling import derive_seed, sample_tokens, uniforms


@dataclass
class EngineStats:
    """Deterministic counters (and two timers) since the engine was made."""

    forward_passes: int = 0  # model forward calls: prompt prefills, resume chunks, decodes
    prefill_tokens: int = 0  # prompt tokens computed (a shared prompt counts once)
    recompute_tokens: int = 0  # own tokens recomputed after preemption or resume
    generated_tokens: int = 0  # tokens sampled
    decode_tokens: int = 0  # row-tokens run through decode forwards
    steps: int = 0
    preemptions: int = 0
    peak_kv_tokens: int = 0  # most tokens held at once
    decode_seconds: float = 0.0  # time in decode forwards + sampling
    prefill_seconds: float = 0.0
    publish_seconds: float = 0.0  # weight conversion at publication (0 when shared)


@dataclass
class _Group:
    key: tuple
    tokens: list[int]
    refs: int = 0  # unfinished requests (waiting or running)
    running: int = 0
    slot: int = -1  # prefix slot, -1 while not computed
    logits: torch.Tensor | None = None  # [V] next-token logits after the prompt


@dataclass
class _Request:
    id: int
    group: _Group
    params: SamplingParams
    seed: int
    stops: frozenset[int]
    tag: int = 0  # prompt index of a generate() call
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cached: int = 0  # own tokens whose keys/values are in the row cache


class NativeEngine:
    def __init__(self, model, *, kv_budget_tokens: int = 65536, max_num_seqs: int = 128,
                 device: str | torch.device | None = None, dtype: torch.dtype | str | None = None,
                 eos_token_ids: list[int] | None = None, share_prefix: bool = True,
                 version: int = 0):
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.decoder = Decoder(model, dtype=dtype, device=device)
        d = self.decoder
        self.cache = KVCache(len(d.layers), d.kv_heads, d.head_dim, d.dtype, d.device)
        self.kv_budget_tokens, self.max_num_seqs = kv_budget_tokens, max_num_seqs
        self.share_prefix, self.version = share_prefix, version
        if eos_token_ids is None:
            eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
            eos = eos if eos is not None else d.cfg.eos_token_id
            eos_token_ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        self.eos_token_ids = [int(e) for e in eos_token_ids if e is not None]
        self.stats = EngineStats()
        self._groups: dict[tuple, _Group] = {}
        self._slots: list[_Group] = []  # computed prefixes, by slot
        self._rows: list[_Request] = []  # running, by row
        self._waiting: deque[_Request] = deque()
        self._requests: dict[int, _Request] = {}
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
               resume: Completion | None = None, tag: int = 0) -> int:
        """Queue one sequence (params.n is ignored: submit n times for a group; identical
        prompts share their prefix). `resume`: a partial Completion (from `abort`) to
        continue. Returns the request id."""
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
        group = self._groups.get(key) or self._groups.setdefault(key, _Group(key, list(prompt)))
        group.refs += 1
        stops = frozenset() if params.ignore_eos else frozenset(
            params.stop_token_ids if params.stop_token_ids is not None else self.eos_token_ids)
        req = _Request(rid, group, params, seed, stops, tag)
        if resume is not None:
            req.tokens = list(resume.token_ids)
            req.logprobs = list(resume.logprobs)
            req.versions = list(resume.versions) or [self.version] * done
        self._requests[rid] = req
        self._waiting.append(req)
        return rid

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def num_running(self) -> int:
        return len(self._rows)

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
        if req in self._waiting:
            self._waiting.remove(req)
            self._finish(req)
        else:
            self._remove_rows([self._rows.index(req)])
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
    def step(self) -> list[Completion]:
        """Admit what fits, decode one token for every running row; returns the finished."""
        self.stats.steps += 1
        finished: list[Completion] = []
        self._admit(finished)
        if self._rows:
            self._make_room(len(self._rows))
            rows = list(self._rows)
            plan = self.decoder.plan(list(range(len(rows))), [[r.tokens[-1]] for r in rows], [r.cached for r in rows],
                                     [r.group.slot for r in rows],
                                     [len(r.group.tokens) for r in rows])
            self.cache.ensure_rows(len(rows), max(r.cached for r in rows) + 1)
            start = time.perf_counter()
            hidden = self.decoder.forward_rows(self.cache, plan)[:, -1]
            for r in rows:
                r.cached += 1
            self.stats.forward_passes += 1
            self.stats.decode_tokens += len(rows)
            self._sample(rows, self.decoder.logits(hidden), finished)
            self.stats.decode_seconds += time.perf_counter() - start
        self.stats.peak_kv_tokens = max(self.stats.peak_kv_tokens, self.kv_tokens())
        return finished

    def _sample(self, reqs: list[_Request], logits: torch.Tensor, finished: list) -> None:
        """Draw the next token of each request from its row of `logits`; retire the done."""
        by_params: dict[tuple, list[int]] = {}
        for i, r in enumerate(reqs):
            p = r.params
            by_params.setdefault((p.temperature, p.top_k, p.top_p), []).append(i)
        tokens = [0] * len(reqs)
        lps = [0.0] * len(reqs)
        for (temp, top_k, top_p), idx in by_params.items():
            sub = logits if len(idx) == len(reqs) else logits[idx]
            u = uniforms([reqs[i].seed for i in idx], [len(reqs[i].tokens) for i in idx])
            tok, lp = sample_tokens(sub, temp, top_k, top_p, u)
            for i, t, lpi in zip(idx, tok.tolist(), lp.tolist()):
                tokens[i], lps[i] = t, lpi
        done_rows = []
        for i, r in enumerate(reqs):
            r.tokens.append(tokens[i])
            r.logprobs.append(lps[i])
            r.versions.append(self.version)
            reason = self._finish_reason(r)
            if reason is not None:
                finished.append(self._completion(r, reason))
                done_rows.append(r)
        self.stats.generated_tokens += len(reqs)
        if done_rows:
            self._remove_rows([self._rows.index(r) for r in done_rows if r in self._rows],
                              also=[r for r in done_rows if r not in self._rows])

    def _finish_reason(self, r: _Request) -> str | None:
        if r.tokens[-1] in r.stops:
            return "stop"
        if len(r.tokens) >= r.params.max_tokens:
            return "length"
        if len(r.group.tokens) + len(r.tokens) >= self.max_context:
            return "length"
        return None

    # -- admission, budget, removal --------------------------------------------------------

    def _admit(self, finished: list[Completion]) -> None:
        new_groups: list[_Group] = []
        fresh: list[_Request] = []
        resumed: list[_Request] = []
        held = self.kv_tokens() + len(self._rows)  # running rows each grow by one this step
        while self._waiting and len(self._rows) < self.max_num_seqs:
            req = self._waiting[0]
            g = req.group
            need = (len(g.tokens) if g.slot < 0 else 0) + len(req.tokens) + 1
            if held + need > self.kv_budget_tokens:
                if self._rows or not self._evict_idle_prefixes(keep=g):
                    break
                held = self.kv_tokens()
                continue
            held += need
            self._waiting.popleft()
            if g.slot < 0:
                g.slot = len(self._slots)
                self._slots.append(g)
                new_groups.append(g)
            g.running += 1
            self._rows.append(req)
            (resumed if req.tokens else fresh).append(req)
        if new_groups:
            self._prefill(new_groups)
        if fresh:
            start = time.perf_counter()
            self._sample(fresh, torch.stack([r.group.logits for r in fresh]), finished)
            self.stats.decode_seconds += time.perf_counter() - start
        resumed = [r for r in resumed if r in self._rows]
        if resumed:
            self._run_chunks(resumed, finished)

    def _prefill(self, groups: list[_Group]) -> None:
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

    def _run_chunks(self, reqs: list[_Request], finished: list[Completion]) -> None:
        """Recompute the own tokens of resumed rows (the last rows) and sample their next."""
        start = time.perf_counter()
        chunks = [r.tokens[r.cached:] for r in reqs]
        self.cache.ensure_rows(len(self._rows), max(r.cached + len(c) for r, c in zip(reqs, chunks)))
        plan = self.decoder.plan([self._rows.index(r) for r in reqs], chunks, [r.cached for r in reqs], [r.group.slot for r in reqs],
                                 [len(r.group.tokens) for r in reqs])
        hidden = self.decoder.forward_rows(self.cache, plan)
        last = torch.tensor([len(c) - 1 for c in chunks], device=hidden.device)
        hidden = hidden[torch.arange(len(reqs), device=hidden.device), last]
        for r, c in zip(reqs, chunks):
            r.cached += len(c)
            self.stats.recompute_tokens += len(c)
        self.stats.forward_passes += 1
        self.stats.prefill_seconds += time.perf_counter() - start
        self._sample(reqs, self.decoder.logits(hidden), finished)

    def _make_room(self, growth: int) -> None:
        """Preempt the newest rows until every running row can grow by one token."""
        while self.kv_tokens() + growth > self.kv_budget_tokens:
            if self._evict_idle_prefixes(keep=None):
                continue
            if len(self._rows) <= 1:
                break
            victim = self._rows[-1]
            self._remove_rows([len(self._rows) - 1], requeue=True)
            self.stats.preemptions += 1
            growth -= 1
            self._waiting.appendleft(victim)

    def _evict_idle_prefixes(self, keep: _Group | None) -> bool:
        idle = [g for g in self._slots if g.running == 0 and g is not keep]
        for g in idle:
            self._drop_prefix(g)
        return bool(idle)

    def _drop_prefix(self, g: _Group) -> None:
        last = self._slots[-1]
        if last is not g:
            self.cache.move_group(last.slot, g.slot, len(last.tokens))
            self._slots[g.slot] = last
            last.slot = g.slot
        self._slots.pop()
        g.slot, g.logits = -1, None

    def _remove_rows(self, rows: list[int], *, requeue: bool = False,
                     also: list[_Request] | None = None) -> None:
        """Take rows out of the batch (the last row moves into each hole)."""
        for i in sorted(rows, reverse=True):
            req = self._rows[i]
            last = self._rows[-1]
            if last is not req:
                self.cache.move_row(len(self._rows) - 1, i, last.cached)
                self._rows[i] = last
            self._rows.pop()
            req.group.running -= 1
            req.cached = 0
            if not requeue:
                self._finish(req)
        for req in also or []:
            self._finish(req)

    def _finish(self, req: _Request) -> None:
        self._requests.pop(req.id, None)
        g = req.group
        g.refs -= 1
        if g.refs == 0:
            if g.slot >= 0:
                self._drop_prefix(g)
            self._groups.pop(g.key, None)

    def _completion(self, r: _Request, reason: str) -> Completion:
        return Completion(prompt_index=r.tag, token_ids=list(r.tokens), logprobs=list(r.logprobs),
                          finish_reason=reason, versions=list(r.versions), request_id=r.id)
