"""The rollout scheduler: groups of requests through the native engine, under one of the
seed papers' strategies, composable with speculative drafts.

    strategy      what a step does
    sync          one static batch at a time; the step ends when its last sequence ends
    continuous    request-level continuous batching; the step ends when every group is done
    partial       APRIL: over-provision groups (x over_provision), stop at the target number
                  of complete groups, keep unfinished responses (ids, log-probs, versions)
                  in the partial pool and resume them first next step
    context       Seer: one probe per group served first, the rest longest-predicted-first
                  from the longest finished sibling, in chunks of `chunk_tokens`
    partial+context   both
    spec_group    (flag) drafts from sibling responses of the same group (Seer)
    spec_reuse    (flag) the previous response to the same prompt is the draft (SPEC-RL),
                  longest previous first; after its first rejection the row is drafted from
                  the prompt's previous responses and running siblings (exact rule); the
                  reused draft is accepted by `reuse_rule`:
                    exact     speculative sampling with fresh seeds: lossless, but a fresh
                              draw rarely repeats a whole previous response
                    coupled   exact rule, each sample keeps its seed from the last epoch: the
                              draft is accepted wherever the current policy, with the same
                              uniforms, draws the same token; every epoch's sample is still
                              exactly the policy's (epochs are correlated, as in any reuse)
                    spec-rl   SPEC-RL's rule: accept with prob min(1, lenience * p_new/p_old)
                              from the stored log-probs; regenerate at the first rejection

No rollout is lost or trained twice: a group is returned once, when all its samples are
complete; an unfinished group waits in the pool with its samples' tokens intact (groups
that complete beyond the step's target are returned first in the next step).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from rollwise.engine.base import RequestEngine, SamplingParams
from rollwise.engine.sampling import derive_seed
from rollwise.rollout.drafts import GroupNgramIndex
from rollwise.rollout.figures import RolloutFigures
from rollwise.rollout.strategy import strategy as strategy_named
from rollwise.rollout.trees import TreeCounters, TreeGrower, TreeSettings
from rollwise.types import Completion, EncodedPrompt, Group, Sample, Trajectory

REUSE_RULES = ("exact", "coupled", "spec-rl")


@dataclass
class _Slot:
    """One sample of a group: finished, partial (from an earlier step), or not started."""

    seed: int
    done: Completion | None = None
    partial: Completion | None = None
    rid: int | None = None
    finished_at: float = 0.0
    indexed: int = 0  # spec_group: tokens of this sample already in the group's index
    mask: list[int] | None = None  # tree rollouts: loss_mask of greedy/forced tokens
    tree: int = 0  # tree rollouts: the tree of its group it is a leaf of (tree_grpo)


@dataclass
class _PendingGroup:
    uid: int
    sample: Sample
    ids: list[int]
    slots: list[_Slot]
    estimate: float = 0.0  # Seer's L̂_g: longest finished sibling (upper bound until one ends)
    measured: bool = False  # a sibling has finished: `estimate` is observed, not the bound
    age: int = 0  # steps spent in the partial pool (anti-starvation)
    index: GroupNgramIndex | None = None

    @property
    def complete(self) -> bool:
        return all(s.done is not None for s in self.slots)


@dataclass
class StepReport:
    groups: list[Group]
    figures: RolloutFigures = field(default_factory=RolloutFigures)


class RolloutScheduler:
    def __init__(self, engine: RequestEngine, params: SamplingParams,
                 decode: Callable[[list[int]], str] = lambda ids: "", *,
                 strategy: str = "continuous", over_provision: float = 2.0,
                 max_staleness: int = 4, chunk_tokens: int = 16, spec_group: bool = False,
                 spec_reuse: bool = False, reuse_rule: str = "exact", lenience: float = 1.0,
                 seed: int = 0, tree: TreeSettings | None = None):
        """`tree`: grow groups as trees inside a response (rollout/trees.py; None or mode
        'none': off)."""
        kind = strategy_named(strategy)
        if reuse_rule not in REUSE_RULES:
            raise ValueError(f"reuse_rule must be one of {', '.join(REUSE_RULES)}, "
                             f"got '{reuse_rule}'")
        self.engine, self.params, self.decode = engine, replace(params, n=1), decode
        self.group_size = params.n
        self.strategy, self.over_provision = strategy, over_provision
        self.max_staleness, self.chunk_tokens = max_staleness, chunk_tokens
        self.spec_group, self.spec_reuse = spec_group, spec_reuse
        self.reuse_rule, self.lenience, self.seed = reuse_rule, lenience, seed
        self.partial, self.context = kind.pools_partials, kind.orders_by_context
        self.pool: list[_PendingGroup] = []  # unfinished (or finished, undelivered) groups
        self.previous: dict[tuple, list[Completion]] = {}  # spec_reuse: last responses
        self.previous_seeds: dict[tuple, list[int]] = {}  # and their seeds (rule 'coupled')
        self._uid = 0
        self._by_rid: dict[int, tuple[_PendingGroup, _Slot]] = {}
        self.trees = (TreeGrower(engine, self.params, tree, seed)
                      if tree is not None and tree.mode != "none" else None)
        # the engine's admission mode and draft source, passed with every step
        self._step_options = {"static_batch": kind.static_batch,
                              "drafter": self._draft if spec_group or spec_reuse else None}

    @property
    def version(self) -> int:
        return self.engine.version

    def publish(self, version: int) -> None:
        self.engine.publish(version)

    def number_groups_from(self, uid: int) -> None:
        """The number of the next new group (its samples' seeds derive from it): a driver
        that spreads a step over several schedulers numbers the groups as one would."""
        self._uid = uid

    # -- one step --------------------------------------------------------------------------

    def run(self, prompts: list[EncodedPrompt],
            fetch: Callable[[int], list[EncodedPrompt]] | None = None, *,
            sizes: list[int] | None = None,
            on_group: Callable[[Group], None] | None = None) -> StepReport:
        """Roll out `prompts` (the step's target number of groups; `sizes[i]` samples for
        prompt i, default the sampling params' n); with partial rollouts, pooled groups come
        first and `fetch(k)` supplies the over-provisioned extra. `on_group` sees each
        returned group as soon as it is complete (e.g. to score it while decoding goes on)."""
        target = len(prompts)
        groups = list(self.pool)
        self.pool = []
        fresh = [(p, n) for p, n in zip(prompts, sizes or [self.group_size] * target,
                                        strict=True)]
        if self.partial:
            want = max(target, round(target * self.over_provision))
            if fetch is not None and len(groups) + len(fresh) < want:
                fresh += [(p, self.group_size)
                          for p in fetch(want - len(groups) - len(fresh))]
        groups += [self._new_group(s, ids, n) for (s, ids), n in fresh]
        stale = self._apply_staleness_cap(groups)
        start = time.perf_counter()
        before = replace(self.engine.stats)
        trees_before = replace(self.trees.counters) if self.trees else None
        delivered: dict[int, Group] = {}  # uid -> group, in the order they completed

        def deliver(g: _PendingGroup) -> None:
            if g.uid not in delivered and (not self.partial or len(delivered) < target):
                delivered[g.uid] = out = self._to_group(g)
                if on_group is not None:
                    on_group(out)

        for g in groups:
            if self.partial and g.complete:
                deliver(g)  # completed beyond an earlier step's target
            elif not g.complete:
                self._submit(g)
        done_times: list[float] = []
        while self.engine.has_unfinished():
            if self.partial and len(delivered) >= target:
                break
            for c in self.engine.step(**self._step_options):
                done_times.append(time.perf_counter() - start)
                g = self._take(c, done_times[-1])
                if g is not None and g.complete:
                    deliver(g)
            if self.trees is not None:
                self.trees.after_step()
        makespan = time.perf_counter() - start
        self._abort_rest(groups)
        out = [delivered[uid] for uid in sorted(delivered)]  # pooled first, then as asked
        self.pool = [g for g in groups if g.uid not in delivered]
        for g in self.pool:
            g.age += 1
        if self.spec_reuse:
            for g in groups:
                if g.uid in delivered:
                    self.previous[tuple(g.ids)] = [s.done for s in g.slots]
                    self.previous_seeds[tuple(g.ids)] = [s.seed for s in g.slots]
        stale.update(self._tree_counts(trees_before))
        return StepReport(out, self._figures(out, before, makespan, done_times, stale))

    def _take(self, c: Completion, now: float) -> _PendingGroup | None:
        """Record a finished request in its group (a tree's: when that is complete)."""
        if self.trees is not None and self.trees.owns(c.request_id):
            return self.trees.finished(c, now)
        g, slot = self._by_rid.pop(c.request_id)
        slot.done, slot.rid, slot.partial = c, None, None
        slot.finished_at = now
        self._on_finish(g, c)
        return g

    def _new_group(self, sample: Sample, ids: list[int], n: int) -> _PendingGroup:
        uid = self._uid
        self._uid += 1
        slots = [_Slot(seed=derive_seed(self.seed, uid * 1024 + k)) for k in range(n)]
        return _PendingGroup(uid, sample, list(ids), slots,
                             estimate=float(self.params.max_tokens))

    def _apply_staleness_cap(self, groups: list[_PendingGroup]) -> dict[str, int]:
        """Pooled responses (partial or finished) begun more than max_staleness versions
        ago start over, so no token older than that reaches the learner."""
        dropped = tokens = 0
        for g in groups:
            for s in g.slots:
                p = s.partial or s.done
                if p and p.age(self.version) > self.max_staleness:
                    dropped += 1
                    tokens += len(p.token_ids)
                    s.partial = s.done = None
        return {"stale_dropped": dropped, "stale_dropped_tokens": tokens}

    def _submit(self, g: _PendingGroup) -> None:
        if self.trees is not None and self.trees.takes(g.uid):
            return self.trees.start(g)
        previous = self.previous.get(tuple(g.ids)) if self.spec_reuse else None
        if g.index is None and (self.spec_group or previous is not None):
            g.index = self._new_index(g, previous)
        probe = True
        for k, s in enumerate(g.slots):
            if s.done is not None:
                continue
            options: dict[str, Any] = {}
            if previous is not None and s.partial is None and k < len(previous):
                options["draft"] = previous[k].token_ids
                # the previous length predicts this one: longest first, so the longest
                # responses do not start late and set the step's end (Seer's ordering)
                options["priority"] = float(len(previous[k].token_ids))
                if self.reuse_rule == "coupled":  # same uniforms: the draft is what the
                    s.seed = self.previous_seeds[tuple(g.ids)][k]  # policy would redraw
                if self.reuse_rule == "spec-rl":
                    options.update(draft_logprobs=previous[k].logprobs, lenience=self.lenience)
            if self.context:
                options["chunk_tokens"] = self.chunk_tokens
                options["priority"] = self._priority(g, probe)
                probe = False
            s.rid = self.engine.submit(g.ids, self.params, seed=s.seed, resume=s.partial,
                                       tag=g.uid, **options)
            self._by_rid[s.rid] = (g, s)

    def _priority(self, g: _PendingGroup, probe: bool) -> float:
        """Seer: probes first (high-priority class), then longest predicted first; a group
        carried over from earlier steps outranks new ones (anti-starvation)."""
        return ((2.0 if probe else 1.0) * 1e6 + (0.0 if probe else g.estimate)
                + g.age * 4e6)

    def _on_finish(self, g: _PendingGroup, c: Completion) -> None:
        if self.context:
            estimate = float(len(c.token_ids))
            g.estimate = max(g.estimate, estimate) if g.measured else estimate
            g.measured = True
            for s in g.slots:  # siblings still waiting move by the new estimate
                if s.rid is not None and s.done is None:
                    self.engine.set_priority(s.rid, self._priority(g, False))

    @staticmethod
    def _context(g: _PendingGroup) -> list[int]:
        """The prompt's end that drafts continue (so a draft may start at the first token)."""
        return g.ids[-8:]

    def _new_index(self, g: _PendingGroup, previous: list[Completion] | None
                   ) -> GroupNgramIndex:
        """A group's n-gram index; with spec_reuse, seeded with the previous epoch's
        responses to its prompt (drafts after a reused response is rejected)."""
        # contexts of 3+ tokens: on bench tail a 2-token match (two characters) was chance,
        # 0.1-0.2 draft tokens accepted per verification against 0.4-1.0 for longer ones
        index = GroupNgramIndex(max_context=8, min_context=3, min_share=0.7)
        context = self._context(g)
        for c in previous or []:
            index.add(context + c.token_ids, start=len(context))
        return index

    def _draft(self, rows: list[tuple[int, list[int]]], limit: int) -> list[list[int]]:
        """Seer's grouped drafts: continue each row from the n-gram index of its siblings'
        responses, finished or still running (brought up to date at every call), and with
        spec_reuse of the prompt's previous responses."""
        found = [self._by_rid.get(rid, (None, None)) for rid, _ in rows]
        for g in {id(g): g for g, _ in found if g is not None and g.index is not None}.values():
            self._index_siblings(g)
        return [g.index.draft(self._context(g) + tokens, limit)
                if g is not None and g.index is not None and g.index.table else []
                for (g, _), (_, tokens) in zip(found, rows)]

    def _index_siblings(self, g: _PendingGroup) -> None:
        """Add the tokens each sample of `g` has produced since the last call to its index.
        A row's own tokens are in it too: the counts they add are the sibling evidence a
        repeated phrase of its own would give, and no draft is ever taken on trust."""
        context = self._context(g)
        for s in g.slots:
            c = s.done or (self.engine.peek(s.rid) if s.rid is not None else s.partial)
            if c is not None and len(c.token_ids) > s.indexed:
                g.index.add(context + c.token_ids, start=len(context) + s.indexed)
                s.indexed = len(c.token_ids)

    def _abort_rest(self, groups: list[_PendingGroup]) -> None:
        for g in groups:
            for s in g.slots:
                if s.rid is not None:
                    part = self.engine.abort(s.rid)
                    self._by_rid.pop(s.rid, None)
                    s.rid = None
                    s.partial = part if part.token_ids else None

    def _to_group(self, g: _PendingGroup) -> Group:
        prompt = EncodedPrompt(g.sample, g.ids)
        out = Group(sample=g.sample, trajectories=[
            Trajectory.from_completion(prompt, s.done, self.decode, self.version,
                                       {"rollout_done": s.finished_at}) for s in g.slots])
        for t, s in zip(out.trajectories, g.slots):
            t.loss_mask, t.tree = s.mask, s.tree
        return out

    def _tree_counts(self, before: TreeCounters | None) -> dict[str, int]:
        """The round's tree counters (forks, prunes, groups) since `before`; none without trees."""
        if before is None:
            return {}
        now = self.trees.counters
        return {"tree_groups": now.groups - before.groups, "tree_forks": now.forks - before.forks,
                "tree_prunes": now.prunes - before.prunes}

    def _figures(self, groups: list[Group], before, makespan: float,
                 done_times: list[float], stale: dict[str, int]) -> RolloutFigures:
        s = self.engine.stats
        return RolloutFigures.of_returned(
            groups, self.version, makespan, done_times,
            generated_tokens=s.generated_tokens - before.generated_tokens,
            forward_passes=s.forward_passes - before.forward_passes,
            row_forwards=s.row_forwards - before.row_forwards,
            spec_verifies=s.spec_verifies - before.spec_verifies,
            spec_accepted=s.spec_accepted - before.spec_accepted,
            pool_groups=len(self.pool), **stale)

    # -- state (checkpoints) ---------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The partial pool and reuse cache, as plain data (finished samples and partial
        token ids, log-probs and versions)."""
        def slot(s: _Slot) -> dict:
            c = s.done or s.partial
            return {"seed": s.seed, "done": s.done is not None,
                    "tokens": c.token_ids if c else [], "logprobs": c.logprobs if c else [],
                    "versions": c.versions if c else [], "reason": c.finish_reason if c else "",
                    "tree": s.tree}

        return {"uid": self._uid, "pool": [
            {"uid": g.uid, "sample": asdict(g.sample), "ids": g.ids, "estimate": g.estimate,
             "measured": g.measured, "age": g.age, "slots": [slot(s) for s in g.slots]}
            for g in self.pool],
            "previous": [[list(k), [[c.token_ids, c.logprobs] for c in v],
                          self.previous_seeds.get(k, [])] for k, v in self.previous.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._uid = state["uid"]
        self.pool = []
        for g in state["pool"]:
            slots = []
            for s in g["slots"]:
                c = (Completion(g["uid"], s["tokens"], s["logprobs"], s["reason"] or "abort",
                                s["versions"]) if s["tokens"] or s["done"] else None)
                slots.append(_Slot(seed=s["seed"], done=c if s["done"] else None,
                                   partial=None if s["done"] else c, tree=s.get("tree", 0)))
            self.pool.append(_PendingGroup(g["uid"], Sample(**g["sample"]), g["ids"], slots,
                                           g["estimate"], g["measured"], g["age"]))
        self.previous = {tuple(k): [Completion(0, t, lp, "stop") for t, lp in v]
                         for k, v, _ in state["previous"]}
        self.previous_seeds = {tuple(k): seeds for k, _, seeds in state["previous"]}
