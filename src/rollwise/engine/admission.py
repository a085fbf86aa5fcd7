"""The native engine's admission: which requests hold a row of the KV cache, and the budget.

`Admission` owns the request table, the waiting queue, the resident rows, the computed
prompt prefixes (one slot per group) and every move of the `KVCache` that goes with them.
It knows nothing of the model: the engine's step loop computes what it admits (`admit`
returns the groups to prefill and the requests to start).

Every step, finished sequences leave and waiting ones join (highest `priority` first, then
submission order). Requests with identical prompt ids share one prefix, prefilled once,
while any of them is unfinished. The budget counts the tokens held in the cache (each
shared prompt once). A request waits when it would exceed the budget; when the running rows
outgrow it, drafts are dropped, then idle prompts, then the newest row is parked: its cache
is set aside (host memory, as Seer's global pool) and restored when it is admitted again.
With `chunk_tokens`, a request is parked after that many tokens and re-queued (Seer's
divided rollout).

Conversations (`keep_kv`): when such a request finishes, the keys and values of its prompt
and of its cached tokens are copied aside ("retained"), keyed by those tokens. A later group
whose prompt extends a retained key (the next turn: history + sampled tokens + observation)
takes that copy into its prefix slot and is prefilled from where it ends. Retained tokens
count in the budget and are the first to go under pressure (least recently retained first,
before idle prompts and before parking); new weights drop them (`follow_weights`: also
when the weights are another engine's, as the evaluator's are the rollout engine's).
"""

from __future__ import annotations

from collections import OrderedDict, deque

import torch

from rollwise.engine.base import EngineStats
from rollwise.engine.kvcache import KVCache
from rollwise.engine.requests import Group, Request


class Admission:
    def __init__(self, cache: KVCache, stats: EngineStats, *, kv_budget_tokens: int,
                 max_num_seqs: int):
        self.cache, self.stats = cache, stats
        self.kv_budget_tokens, self.max_num_seqs = kv_budget_tokens, max_num_seqs
        self.groups: dict[tuple, Group] = {}
        self.slots: list[Group] = []  # computed prefixes, by slot
        self.rows: list[Request] = []  # resident, by row
        self.waiting: deque[Request] = deque()
        self.requests: dict[int, Request] = {}  # every unfinished request, by id
        # finished conversations' keys/values, [layers, 2, kv_heads, n, head_dim], by tokens
        self.retained: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.generation = 0  # the weights' generation the retained keys/values were computed by

    # -- the request table -----------------------------------------------------------------

    def group(self, key: tuple, prompt: list[int]) -> Group:
        """The group of `key` (one per distinct shared prompt), made on first use."""
        return self.groups.get(key) or self.groups.setdefault(key, Group(key, list(prompt)))

    def queue(self, req: Request) -> None:
        """A new request: known by id and waiting for a row."""
        req.group.refs += 1
        self.requests[req.id] = req
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take a request out wherever it is (resident or waiting) and finish it."""
        if req in self.rows:
            self.remove_rows([self.rows.index(req)])
        else:
            self.waiting.remove(req)
            self.finish(req)

    def finish(self, req: Request) -> None:
        self.requests.pop(req.id, None)
        g = req.group
        g.refs -= 1
        if g.refs == 0:
            if g.slot >= 0:
                self.drop_prefix(g)
            self.groups.pop(g.key, None)

    def num_running(self) -> int:
        return sum(not r.zombie for r in self.rows)

    def kv_tokens(self) -> int:
        """Tokens held in the cache now (each computed prompt once)."""
        return (sum(len(g.tokens) for g in self.slots) + sum(r.cached for r in self.rows)
                + self.retained_tokens())

    # -- retained conversations ------------------------------------------------------------

    def retained_tokens(self) -> int:
        return sum(kv.shape[3] for kv in self.retained.values())

    def retain(self, r: Request, row: int) -> None:
        """Copy aside the keys/values of a finished request's prompt and cached tokens."""
        g = r.group
        key = tuple(g.tokens) + tuple(r.tokens[: r.cached])
        kv = self.cache.take_prefix(g.slot, len(g.tokens))
        if r.cached:  # none when it ended on its first token (drawn from the prompt's logits)
            kv = torch.cat((kv, self.cache.take_row(row, r.cached)), dim=3)
        self.retained.pop(key, None)
        self.retained[key] = kv
        self.stats.retained += 1

    def reuse(self, g: Group) -> None:
        """A group about to take a slot: the longest retained conversation its prompt
        extends (at least one prompt token is left to compute, for the logits) is taken
        out of the table into `g.reuse`."""
        best, n = None, 0
        for key in self.retained:
            m = len(key)
            if n < m < len(g.tokens) + 1 and tuple(g.tokens[:m]) == key:
                best, n = key, m
        if best is not None:
            kv = self.retained.pop(best)
            g.reuse = kv[:, :, :, : min(n, len(g.tokens) - 1)]

    def follow_weights(self, generation: int) -> None:
        """The weights are at `generation` (their publications so far): retained keys and
        values computed by earlier weights are dropped."""
        if generation != self.generation:
            self.retained.clear()
            self.generation = generation

    def evict_retained(self) -> int:
        """Drop the oldest retained conversation; the tokens freed (0 when none)."""
        if not self.retained:
            return 0
        _, kv = self.retained.popitem(last=False)
        self.stats.retained_evictions += 1
        return kv.shape[3]

    # -- admission and the budget ----------------------------------------------------------

    def pick(self) -> Request:
        if any(r.priority for r in self.waiting):
            return max(self.waiting, key=lambda r: r.priority)  # first of the highest
        return self.waiting[0]

    def admit(self, static: bool) -> tuple[list[Group], list[Request]]:
        """Give rows to waiting requests while the budget allows (a static batch only when
        empty); parked ones get their cache back. Returns the groups that took a prefix
        slot (to prefill) and the admitted requests that have no token yet (to start)."""
        new_groups: list[Group] = []
        fresh: list[Request] = []
        if static and self.rows:
            return new_groups, fresh
        held = self.kv_tokens() + sum(r.inputs for r in self.rows)
        while self.waiting and len(self.rows) < self.max_num_seqs:
            req = self.pick()
            g = req.group
            need = (len(g.tokens) if g.slot < 0 else 0) + len(req.tokens) + 1 + len(req.draft)
            if held + need > self.kv_budget_tokens:
                freed = self.evict_retained()
                if freed:
                    held -= freed
                    continue
                if self.rows or not self.evict_idle_prefixes(keep=g):
                    break
                held = self.kv_tokens()
                continue
            held += need
            self.waiting.remove(req)
            if g.slot < 0:
                g.slot = len(self.slots)
                self.slots.append(g)
                new_groups.append(g)
                if self.retained:
                    self.reuse(g)
            g.running += 1
            self.rows.append(req)
            req.resident_since = len(req.tokens)
            if req.parked is not None:
                self.restore(req, len(self.rows) - 1)
            elif not req.tokens:
                fresh.append(req)
        if any(g.reuse is not None for g in new_groups):
            # slots just taken, nothing written yet: the plainly prefilled ones first, so
            # that they stay contiguous for their one batched prefill
            base = new_groups[0].slot
            for j, g in enumerate(sorted(new_groups, key=lambda g: g.reuse is not None)):
                g.slot = base + j
                self.slots[base + j] = g
        return new_groups, fresh

    def make_room(self) -> None:
        """Keep the cache within budget for this step's inputs: drop drafts, drop idle
        prompts, then park the newest rows."""
        def over() -> bool:
            return self.kv_tokens() + sum(r.inputs for r in self.rows) > self.kv_budget_tokens

        if over():
            for r in self.rows:
                r.draft, r.draft_logprobs = [], None
        while over():
            if self.evict_retained() or self.evict_idle_prefixes(keep=None):
                continue
            if len(self.rows) <= 1:
                break
            self.park([len(self.rows) - 1])
            self.stats.preemptions += 1

    def park(self, rows: list[int]) -> None:
        """Set rows aside with their cache and queue them again (front for preemptions)."""
        for i in rows:
            r = self.rows[i]
            r.parked = self.cache.take_row(i, r.cached)
        reqs = [self.rows[i] for i in rows]
        self.remove_rows(rows, requeue=True)
        self.stats.parks += len(reqs)
        for r in reqs:
            self.waiting.appendleft(r)

    def restore(self, r: Request, row: int) -> None:
        n = r.parked.shape[3]
        self.cache.ensure_rows(len(self.rows), n + 1)
        self.cache.put_row(row, r.parked)
        r.cached, r.parked = n, None

    def retire(self, done: set[int], static: bool) -> None:
        """End of a step: the rows `done` have finished and leave (in a static batch they
        stay as zombies until every row is done); rows that have run their chunk (divided
        rollout) are parked at the back of the queue."""
        gone, park = [], []
        for i, r in enumerate(self.rows):
            if i in done:
                if static:
                    r.zombie = True
                    self.requests.pop(r.id, None)  # reported; keeps its row
                else:
                    gone.append(i)
                    if r.keep_kv:
                        self.retain(r, i)
            elif (not r.zombie and r.chunk_tokens and self.waiting
                  and len(r.tokens) - r.resident_since >= r.chunk_tokens):
                park.append(i)
        if static and self.rows and all(r.zombie for r in self.rows):
            gone = list(range(len(self.rows)))
        for i in park:
            self.rows[i].parked = self.cache.take_row(i, self.rows[i].cached)
        parked = [self.rows[i] for i in park]
        self.remove_rows(sorted(gone + park), requeue_ids={r.id for r in parked})
        self.waiting.extend(parked)
        self.stats.parks += len(parked)

    # -- prefix slots and rows -------------------------------------------------------------

    def evict_idle_prefixes(self, keep: Group | None) -> bool:
        """Drop the computed prompts of groups with no running row (but `keep`'s)."""
        idle = [g for g in self.slots if g.running == 0 and g is not keep]
        for g in idle:
            self.drop_prefix(g)
        return bool(idle)

    def drop_prefix(self, g: Group) -> None:
        last = self.slots[-1]
        if last is not g:
            self.cache.move_group(last.slot, g.slot, len(last.tokens))
            self.slots[g.slot] = last
            last.slot = g.slot
        self.slots.pop()
        g.slot, g.logits = -1, None

    def remove_rows(self, rows: list[int], *, requeue: bool = False,
                    requeue_ids: set[int] | None = None) -> None:
        """Take rows out of the batch (the last row moves into each hole); finish those
        not re-queued."""
        for i in sorted(rows, reverse=True):
            req = self.rows[i]
            last = self.rows[-1]
            if last is not req:
                self.cache.move_row(len(self.rows) - 1, i, last.cached)
                self.rows[i] = last
            self.rows.pop()
            req.group.running -= 1
            if req.parked is None:
                req.cached = 0
            if not (requeue or (requeue_ids and req.id in requeue_ids)):
                self.finish(req)
