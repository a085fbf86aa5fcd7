"""Tree rollouts inside a response: a group grown as a tree of branches that share
prefixes, driven by the rollout scheduler's hooks (`tree.mode`, docs/rollout.md).

    latr      Lookahead tree-based rollouts. One greedy root per group, asking the engine for
              its top-2 log-probs. A branch forks at position t onto the second candidate
              when p2 >= latr_threshold and p1 - p2 <= latr_margin * p1 (`latr_forks`):
              the child's response is the branch's tokens[:t] + [second token], and it goes
              on greedily. At `latr_lookahead` tokens after its birth a child's span is
              compared with its parent's over the same positions and pruned when their
              ROUGE-L F1 reaches `latr_similarity` (`too_similar`). Once the group holds
              group_size live branches, every running branch switches to the rollout's
              sampling (retuned in place); when the tree ends short, plain samples fill it.
    entropy   Tree-GRPO at uncertain tokens. group_size / entropy_branches roots are
              sampled with per-token entropies and kept in the engine's cache (keep_kv);
              each finished root forks its other samples at its highest-entropy positions
              t (`entropy_cuts`): prompt + response[:t] is the fork's prompt, its token t is
              drawn again with a new seed, and the engine lends the root's keys/values to
              it (`NativeEngine.branch_kv`) so the prefix is not computed again. Every token
              is a policy sample: a fork's trajectory is the root's prefix (its log-probs
              and versions) + the fork's continuation. With `entropy_fork_after` m, a root
              forks once it has m tokens, at its highest-entropy positions among them, and
              its forks (resumed prefixes) run beside it.

Greedy and forced tokens (latr) are not samples of the behaviour policy: `forced_tokens`
'mask' gives them loss_mask 0 (the default: the loss sees only sampled tokens), 'keep'
trains them with the policy's temperature-1 log-prob recorded as the behaviour log-prob.
`share` (decaying linearly to 0 over `decay_steps` policy versions) is the fraction of
groups grown as trees; the rest are sampled as usual. Each leaf is placed with the index of
its tree within the group (an entropy root and its forks share the root's; latr's greedy
tree is 0 and each plain fill sample a tree of its own): `Trajectory.tree`, which the
`tree_grpo` advantage reads.

Imports the engine contract and its seed derivation only; the scheduler's group and slot
records are used through their fields (`ids`, `uid`, `slots[k].seed/done/finished_at/mask/tree`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from rollwise.engine.base import RequestEngine, SamplingParams
from rollwise.engine.sampling import derive_seed
from rollwise.types import Completion

MODES = ("none", "latr", "entropy")
FORCED = ("mask", "keep")
_SHARE_STREAM = 0x7EE5  # the uniforms that pick which groups grow as trees
_FORK_STREAM = 7919  # a group's j-th fork seed: derive_seed(its first seed, _FORK_STREAM + j)


@dataclass(frozen=True)
class TreeSettings:
    """The tree settings: each field's default, bounds and help text are declared here once,
    and the config's [tree] section is built from them (compose/schema.py `section_of`)."""

    mode: Literal[MODES] = field(default="none", metadata={"help": (
        "Tree rollouts inside a response (docs/rollout.md): 'latr' (greedy branches fork "
        "onto likely second candidates, near-copies are pruned at lookahead points, the full "
        "group finishes by sampling), 'entropy' (Tree-GRPO: roots fork their other samples "
        "at their highest-entropy tokens, sharing the prefix's keys/values). Native engine, "
        "schedule.strategy 'continuous'.")})
    share: float = field(default=1.0, metadata={"ge": 0, "le": 1, "help": (
        "The fraction of groups grown as trees (the rest are sampled as usual).")})
    decay_steps: int = field(default=0, metadata={"ge": 0, "help": (
        "share decays linearly to 0 over this many policy versions (0: no decay).")})
    forced_tokens: Literal[FORCED] = field(default="mask", metadata={"help": (
        "latr: tokens chosen greedily or by a fork are not policy samples: 'mask' leaves "
        "them out of the loss (loss_mask 0), 'keep' trains them with the policy's "
        "temperature-1 log-prob as their behaviour log-prob.")})
    latr_threshold: float = field(default=0.25, metadata={"gt": 0, "lt": 1, "help": (
        "latr: a branch forks onto its second candidate when that candidate's probability "
        "is at least this...")})
    latr_margin: float = field(default=0.5, metadata={"ge": 0, "le": 1, "help": (
        "latr: ...and within this fraction of the top candidate's "
        "(p1 - p2 <= latr_margin * p1).")})
    latr_lookahead: tuple[int, ...] = field(default=(20, 30, 50), metadata={
        "min_length": 1, "help": "latr: tokens after its birth at which a branch is compared "
        "with its parent over the same positions."})
    latr_similarity: float = field(default=0.9, metadata={"gt": 0, "le": 1, "help": (
        "latr: prune a branch whose ROUGE-L F1 with its parent over a lookahead span "
        "reaches this.")})
    entropy_branches: int = field(default=2, metadata={"ge": 2, "help": (
        "entropy: samples per root (the root and its forks); a group starts "
        "group_size / entropy_branches roots.")})
    entropy_fork_after: int = field(default=0, metadata={"ge": 0, "help": (
        "entropy: fork a running root once it has this many tokens, at its highest-entropy "
        "positions among them (its forks run beside it; the prefix is recomputed, not "
        "lent); 0: fork when the root finishes, on its kept cache.")})

    def __post_init__(self) -> None:
        if any(n < 1 for n in self.latr_lookahead):
            raise ValueError("latr_lookahead points are token counts >= 1, got "
                             f"{list(self.latr_lookahead)}")
        object.__setattr__(self, "latr_lookahead", tuple(sorted(set(self.latr_lookahead))))


def tree_settings(section) -> TreeSettings:
    """The TreeSettings of a [tree] section (its keys are TreeSettings' fields)."""
    return TreeSettings(**{f.name: getattr(section, f.name) for f in fields(TreeSettings)})


@dataclass
class TreeCounters:
    """Deterministic counters since the grower was made."""

    groups: int = 0  # groups grown as trees
    forks: int = 0  # branches started from another (latr forks, entropy forks)
    prunes: int = 0  # latr branches pruned at a lookahead point
    switched: int = 0  # latr branches moved from greedy to sampling when the group filled
    filled: int = 0  # latr samples drawn plainly because the tree ended short
    lent_prefixes: int = 0  # prefixes whose keys/values the engine lent (entropy forks, a
    # short latr tree's prompt to its plain samples)


# -- the rules ---------------------------------------------------------------------------------


def tree_share(settings: TreeSettings, step: int) -> float:
    """The fraction of groups grown as trees at policy version `step`: `share`, decaying
    linearly to 0 at `decay_steps` (0: no decay)."""
    if settings.decay_steps <= 0:
        return settings.share
    return settings.share * max(0.0, 1.0 - step / settings.decay_steps)


def latr_forks(p1: float, p2: float, threshold: float, margin: float) -> bool:
    """Whether a branch whose top two candidates have probabilities p1 >= p2 forks onto the
    second: it is likely in absolute terms and close to the first."""
    return p2 >= threshold and p1 - p2 <= margin * p1


def rouge_l(a: list[int], b: list[int]) -> float:
    """ROUGE-L F1 of two token lists: 2 * LCS / (len(a) + len(b)) (1 for two empty lists)."""
    if not a and not b:
        return 1.0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return 2.0 * prev[-1] / (len(a) + len(b))


def too_similar(span: list[int], parent_span: list[int], similarity: float) -> bool:
    """LATR's pruning rule: a branch that, over the same positions, repeats its parent."""
    return rouge_l(span, parent_span) >= similarity


def entropy_cuts(entropies: list[float], k: int) -> list[int]:
    """The k fork positions of a root: its highest-entropy positions (earlier first among
    equals); a response shorter than k is cycled, so several forks share a position."""
    order = sorted(range(len(entropies)), key=lambda t: (-entropies[t], t))
    return [order[j % len(order)] for j in range(k)] if order else []


def forced_mask(greedy: int, length: int, forced_tokens: str) -> list[int] | None:
    """loss_mask of a latr response whose first `greedy` tokens were greedy or forced."""
    if forced_tokens == "keep" or greedy == 0:
        return None
    return [0] * min(greedy, length) + [1] * max(0, length - greedy)


def joined(prefix: Completion, rest: Completion, t: int) -> Completion:
    """prefix's first t tokens (their log-probs and versions) followed by `rest`."""
    return Completion(prefix.prompt_index, prefix.token_ids[:t] + rest.token_ids,
                      prefix.logprobs[:t] + rest.logprobs, rest.finish_reason,
                      prefix.versions[:t] + rest.versions, rest.request_id)


# -- the grower --------------------------------------------------------------------------------


@dataclass
class _Branch:
    """One latr branch: its request, where it was born and what it has said so far."""

    rid: int
    seed: int
    parent: _Branch | None = None
    born: int = 0  # response position of its forced token (0 for the root)
    checks: list[int] = field(default_factory=list)  # lookahead points still to pass
    seen: int = 0  # positions already examined for forks
    tokens: list[int] = field(default_factory=list)  # last known response tokens
    greedy: int = -1  # tokens chosen greedily (-1: all of them, still growing)


@dataclass
class _Tree:
    group: Any  # the scheduler's pending group
    mode: str
    running: dict[int, _Branch] = field(default_factory=dict)  # latr: by request id
    live: int = 0  # latr: branches running or finished, not pruned
    growing: bool = True  # latr: still greedy (the group is not full yet)
    made: int = 0  # forks made: the next fork's seed index within the group
    roots: dict[int, int] = field(default_factory=dict)  # entropy: root rid -> its forks
    forks: dict[int, tuple[Completion | None, int, int]] = field(default_factory=dict)
    # entropy: fork rid -> (its root when finished, the cut, the root's tree)
    tree_of: dict[int, int] = field(default_factory=dict)  # entropy: root rid -> its tree
    alone: int = 0  # latr: plain samples placed so far (each a tree of its own)

    def fork_seed(self) -> int:
        """A new seed for the group's next fork (a function of the group alone)."""
        self.made += 1
        return derive_seed(self.group.slots[0].seed, _FORK_STREAM + self.made)

    def place(self, c: Completion, now: float, mask: list[int] | None = None,
              tree: int = 0) -> None:
        """Fill the group's next free slot with `c`, a leaf of tree `tree` of the group."""
        slot = next(s for s in self.group.slots if s.done is None)
        slot.done, slot.finished_at, slot.mask, slot.tree = c, now, mask, tree


class TreeGrower:
    """Grows the scheduler's groups as trees: `start` a group, hand it every finished
    request it `owns`, and call `after_step` after every engine step."""

    def __init__(self, engine: RequestEngine, params: SamplingParams,
                 settings: TreeSettings, seed: int = 0):
        if settings.mode not in MODES[1:]:
            raise ValueError(f"tree mode must be one of {', '.join(MODES[1:])}")
        if settings.forced_tokens not in FORCED:
            raise ValueError(f"forced_tokens must be one of {', '.join(FORCED)}")
        self.engine, self.params, self.settings, self.seed = engine, params, settings, seed
        self.greedy = replace(params, temperature=0.0, top_k=0, top_p=1.0, top_logprobs=2,
                              entropy=False)
        self.counters = TreeCounters()
        # the latest forks, (group uid, response position, forced token or -1 when drawn):
        # what the tests and `bench tree` read
        self.log: deque[tuple[int, int, int]] = deque(maxlen=4096)
        self._owner: dict[int, _Tree] = {}  # request id -> its tree
        self._trees: list[_Tree] = []  # latr trees still growing, entropy trees with roots
        # still to fork while running

    def takes(self, uid: int) -> bool:
        """Whether group `uid` grows as a tree at the engine's current version."""
        u = derive_seed(self.seed ^ _SHARE_STREAM, uid) / 2.0**63
        return u < tree_share(self.settings, self.engine.version)

    def owns(self, rid: int) -> bool:
        return rid in self._owner

    def start(self, g) -> None:
        """Submit the first requests of group `g` (a scheduler `_PendingGroup`)."""
        tree = _Tree(g, self.settings.mode)
        self.counters.groups += 1
        if tree.mode == "latr":
            self._branch(tree, None, g.slots[0].seed, None, 0)
            self._trees.append(tree)
            return
        n = len(g.slots)
        roots = max(1, n // self.settings.entropy_branches)
        asks = replace(self.params, entropy=True)
        for k in range(roots):
            rid = self.engine.submit(g.ids, asks, seed=g.slots[k].seed, tag=g.uid, keep_kv=True)
            self._owner[rid] = tree
            tree.roots[rid] = (n - roots) // roots + (k < (n - roots) % roots)
            tree.tree_of[rid] = k
        if self.settings.entropy_fork_after > 0:
            self._trees.append(tree)

    def finished(self, c: Completion, now: float) -> Any:
        """Take a finished request of a tree; returns its group when that is complete."""
        tree = self._owner.pop(c.request_id)
        if tree.mode == "entropy":
            self._entropy_finished(tree, c, now)
        else:
            self._latr_finished(tree, c, now)
        return tree.group if all(s.done is not None for s in tree.group.slots) else None

    def after_step(self) -> None:
        """latr: look at what each growing branch drew this step (forks, pruning), and move
        full groups to sampling; entropy with entropy_fork_after: fork the roots that are
        long enough."""
        for tree in list(self._trees):
            if tree.mode == "entropy":
                self._fork_running_roots(tree)
                if not tree.roots:
                    self._trees.remove(tree)
                continue
            for b in list(tree.running.values()):
                c = self.engine.peek(b.rid)
                self._look(tree, b, c)
            if tree.growing and not tree.running:  # its last running branches were pruned
                self._fill(tree)
            if tree.growing and tree.live >= len(tree.group.slots):
                self._switch(tree)
            if not tree.growing:
                self._trees.remove(tree)

    # -- entropy branching ---------------------------------------------------------------------

    def _entropy_finished(self, tree: _Tree, c: Completion, now: float) -> None:
        fork = tree.forks.pop(c.request_id, None)
        if fork is not None:  # a fork of a running root came back whole (resumed prefix)
            root, cut, k = fork
            tree.place(c if root is None else joined(root, c, cut), now, tree=k)
            return
        k = tree.tree_of.pop(c.request_id)
        tree.place(replace(c, entropies=None), now, tree=k)
        cuts = entropy_cuts(c.entropies or [], tree.roots.pop(c.request_id, 0))
        ids = tree.group.ids
        self._lend(ids, c, cuts)  # no cuts (forked while running): its cache is let go
        for t in cuts:
            params = replace(self.params, max_tokens=self.params.max_tokens - t)
            rid = self.engine.submit(ids + c.token_ids[:t], params, seed=tree.fork_seed(),
                                     tag=tree.group.uid)
            self._owner[rid] = tree
            tree.forks[rid] = (c, t, k)
            self.counters.forks += 1
            self.log.append((tree.group.uid, t, -1))

    def _fork_running_roots(self, tree: _Tree) -> None:
        """entropy_fork_after: a running root with that many tokens forks at its
        highest-entropy positions among them; each fork resumes the root's prefix (the
        engine shares the prompt and recomputes the prefix) and draws token t anew."""
        after = self.settings.entropy_fork_after
        for rid in list(tree.roots):  # the roots still running (finished ones forked)
            c = self.engine.peek(rid)
            if len(c.token_ids) < after:
                continue
            for t in entropy_cuts(c.entropies[:after], tree.roots.pop(rid)):
                prefix = Completion(tree.group.uid, c.token_ids[:t], c.logprobs[:t], "abort",
                                    c.versions[:t]) if t else None
                fork = self.engine.submit(tree.group.ids, self.params, seed=tree.fork_seed(),
                                          resume=prefix, tag=tree.group.uid)
                self._owner[fork] = tree
                tree.forks[fork] = (None, t, tree.tree_of[rid])
                self.counters.forks += 1
                self.log.append((tree.group.uid, t, -1))

    # -- latr ------------------------------------------------------------------------------

    def _branch(self, tree: _Tree, parent: _Branch | None, seed: int,
                resume: Completion | None, born: int) -> _Branch:
        """Submit a greedy branch (the root when `parent` is None)."""
        rid = self.engine.submit(tree.group.ids, self.greedy, seed=seed, resume=resume,
                                 tag=tree.group.uid, keep_kv=True)
        checks = sorted(self.settings.latr_lookahead) if parent is not None else []
        b = _Branch(rid, seed, parent, born, checks, seen=born + 1 if parent else 0,
                    tokens=list(resume.token_ids) if resume else [])
        tree.running[rid] = b
        tree.live += 1
        self._owner[rid] = tree
        return b

    def _look(self, tree: _Tree, b: _Branch, c: Completion, finished: bool = False) -> bool:
        """Prune running branch `b` at a lookahead point (a finished one is kept), else fork
        it where the rule says; False when pruned."""
        b.tokens = c.token_ids
        while not finished and b.checks and len(c.token_ids) >= b.born + b.checks[0]:
            end = b.born + b.checks.pop(0)
            if too_similar(c.token_ids[b.born: end], b.parent.tokens[b.born: end],
                           self.settings.latr_similarity):
                self.engine.abort(b.rid)
                self._drop(tree, b)
                tree.live -= 1
                self.counters.prunes += 1
                return False
        s = self.settings
        for pos in range(b.seen, len(c.token_ids)):
            if not tree.growing or tree.live >= len(tree.group.slots):
                break
            top = c.top_logprobs[pos]
            if (len(top) > 1 and pos + 1 < self.params.max_tokens and latr_forks(
                    math.exp(top[0][1]), math.exp(top[1][1]), s.latr_threshold, s.latr_margin)):
                resume = Completion(
                    tree.group.uid, c.token_ids[:pos] + [top[1][0]],
                    c.logprobs[:pos] + [top[1][1]], "abort", c.versions[:pos + 1],
                    top_logprobs=c.top_logprobs[:pos + 1])
                self._branch(tree, b, tree.fork_seed(), resume, pos)
                self.counters.forks += 1
                self.log.append((tree.group.uid, pos, top[1][0]))
        b.seen = len(c.token_ids)
        return True

    def _drop(self, tree: _Tree, b: _Branch) -> None:
        tree.running.pop(b.rid, None)
        self._owner.pop(b.rid, None)

    def _switch(self, tree: _Tree) -> None:
        """The group is full: every running branch continues with the rollout's sampling
        (retuned in place, or aborted and resumed by an engine that cannot retune)."""
        tree.growing = False
        retune = getattr(self.engine, "retune", None)
        for b in list(tree.running.values()):
            self.counters.switched += 1
            if retune is not None:  # b.tokens: as peeked in this after_step
                b.greedy = len(b.tokens)
                retune(b.rid, self.params)
                continue
            part = self.engine.abort(b.rid)
            self._drop(tree, b)
            b.greedy = len(part.token_ids)
            b.rid = self.engine.submit(tree.group.ids, self.params, seed=b.seed,
                                       resume=replace(part, top_logprobs=None),
                                       tag=tree.group.uid)
            tree.running[b.rid] = b
            self._owner[b.rid] = tree

    def _latr_finished(self, tree: _Tree, c: Completion, now: float) -> None:
        b = tree.running.pop(c.request_id, None)
        if b is None:  # a plain sample filling a short tree: a tree of its own
            tree.alone += 1
            tree.place(c, now, tree=tree.alone)
            return
        if tree.growing:
            self._look(tree, b, c, finished=True)  # forks at its last positions
        greedy = len(c.token_ids) if b.greedy < 0 else b.greedy
        tree.place(replace(c, top_logprobs=None),
                   now, forced_mask(greedy, len(c.token_ids), self.settings.forced_tokens))
        # branches are kept in the cache when they finish: the last one of a tree that ends
        # short lends its prompt to the plain samples that fill it; the others let go
        last = tree.growing and not tree.running
        self._lend(tree.group.ids, c, [0] if last else [])
        if last:
            self._fill(tree)

    def _lend(self, ids: list[int], c: Completion, cuts: list[int]) -> None:
        """Lend a finished keep_kv request's keys/values to requests whose prompts are
        ids + its tokens[:t], t in `cuts` (none: just let them go), when the engine can."""
        branch_kv = getattr(self.engine, "branch_kv", None)
        if branch_kv is not None and branch_kv(ids, c.token_ids, cuts):
            self.counters.lent_prefixes += len(cuts)

    def _fill(self, tree: _Tree) -> None:
        """The tree ended short of the group: the remaining samples are drawn plainly."""
        tree.growing = False
        for s in tree.group.slots[tree.live:]:
            rid = self.engine.submit(tree.group.ids, self.params, seed=s.seed,
                                     tag=tree.group.uid)
            self._owner[rid] = tree
            self.counters.filled += 1
