"""Tree rollouts inside a response (rollout/trees.py) and the engine's per-token statistics
they read: top log-probs and entropies against a direct forward pass, the LATR fork and
prune rules, the decay schedule, the importance-ratio treatment of forced tokens, and
entropy branching (group size, fork positions, shared prefixes)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from rollwise.algos.advantages import tree_grpo
from rollwise.engine import NativeEngine, SamplingParams
from rollwise.engine import native as native_module
from rollwise.rollout import RolloutScheduler, trees
from rollwise.rollout.trees import (
    TreeSettings,
    entropy_cuts,
    forced_mask,
    latr_forks,
    rouge_l,
    too_similar,
    tree_share,
)
from rollwise.types import EncodedPrompt, Sample

EOS = 2
PROMPTS = [[1, 20, 30, 40, 12, 7, 9, 33], [1, 5], [1, 44, 45, 46, 47]]
EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture
def model(tiny_llama):
    """The tiny Llama with sharpened logits (final-norm gain 6): distributions far from
    uniform, so the top-k order is well separated."""
    m = tiny_llama()
    with torch.no_grad():
        m.model.norm.weight.mul_(6.0)
    return m


def _reference(model, prompt, tokens):
    """log_softmax of a direct Hugging Face forward at each response position."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    logits = logits[len(prompt) - 1: len(prompt) + len(tokens) - 1]
    return torch.log_softmax(logits, -1), logits


def _tolerance(logits: torch.Tensor) -> float:
    """Both sides compute float32 logits by different kernels: each logit is the end of
    ~7 chained 32-long dot products (2 layers x q/k/v/o/mlp + head), so the rounding error
    is bounded by about 7 * 32 * eps relative to the logit scale; log_softmax adds ~eps."""
    return 7 * 32 * EPS32 * max(1.0, float(logits.abs().max())) + 8 * EPS32


def _check_stats(model, prompt, c, k, untruncated=True):
    ref, logits = _reference(model, prompt, c.token_ids)
    tol = _tolerance(logits)
    assert len(c.top_logprobs) == len(c.entropies) == len(c.token_ids)
    want_ent = -(ref.exp() * ref).sum(-1)
    # the entropy sums 88 terms p log p, each moved by at most (1 + |log p|) times its
    # p's error: about ten times the log-prob bound for these distributions
    assert torch.allclose(torch.tensor(c.entropies), want_ent, atol=tol * 10, rtol=0)
    for t, row in enumerate(c.top_logprobs):
        assert len(row) == k
        vals, ids = torch.topk(ref[t], k)
        assert [i for i, _ in row] == ids.tolist()
        assert torch.allclose(torch.tensor([v for _, v in row]), vals, atol=tol, rtol=0)
    if untruncated:  # temperature 1 or greedy: the behaviour log-prob is of this distribution
        picked = ref.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(c.logprobs).float(), picked, atol=tol, rtol=0)


# -- engine statistics -------------------------------------------------------------------------


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 5), (0.0, 0)])
def test_top_logprobs_and_entropy_equal_a_direct_forward(model, temperature, top_k) -> None:
    """Statistics are of the untruncated temperature-1 distribution, whatever is sampled."""
    engine = NativeEngine(model, eos_token_ids=[EOS])
    params = SamplingParams(n=3, temperature=temperature, top_k=top_k, max_tokens=12,
                            seed=5, top_logprobs=4, entropy=True)
    outs = engine.generate(PROMPTS, params)
    for c in outs:
        _check_stats(model, PROMPTS[c.prompt_index], c, 4, top_k == 0 and temperature != 0.7)


def test_default_path_untouched_when_no_row_asks(model, monkeypatch) -> None:
    """Asking changes no token or log-prob; not asking runs no statistics at all."""
    calls = []
    real = native_module.token_stats
    monkeypatch.setattr(native_module, "token_stats",
                        lambda *a: calls.append(1) or real(*a))
    plain = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=3)
    a = NativeEngine(model, eos_token_ids=[EOS]).generate(PROMPTS, plain)
    assert not calls and all(c.top_logprobs is None and c.entropies is None for c in a)
    asked = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=3, top_logprobs=2)
    b = NativeEngine(model, eos_token_ids=[EOS]).generate(PROMPTS, asked)
    assert calls
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.logprobs for c in a] == [c.logprobs for c in b]
    assert all(c.entropies is None and c.top_logprobs is not None for c in b)


def test_mixed_batch_only_asking_rows_get_statistics(model) -> None:
    engine = NativeEngine(model, eos_token_ids=[EOS])
    asks = engine.submit(PROMPTS[0], SamplingParams(max_tokens=8, entropy=True), seed=1)
    other = engine.submit(PROMPTS[0], SamplingParams(max_tokens=8), seed=2)
    done = {}
    while engine.has_unfinished():
        done.update({c.request_id: c for c in engine.step()})
    assert done[other].entropies is None and done[other].top_logprobs is None
    assert len(done[asks].entropies) == len(done[asks].token_ids)
    assert done[asks].top_logprobs is None


def test_statistics_survive_abort_resume_and_drafts(model) -> None:
    """A resumed row's first token and verified drafts come through the verifier."""
    params = SamplingParams(max_tokens=14, top_logprobs=3, entropy=True)
    engine = NativeEngine(model, eos_token_ids=[EOS], drafter=lambda rows, k: [
        [7, 9, 33][:k] for _ in rows])
    rid = engine.submit(PROMPTS[0], params, seed=11)
    for _ in range(4):
        engine.step()
    part = engine.abort(rid)
    assert len(part.entropies) == len(part.token_ids) > 0
    engine.submit(PROMPTS[0], params, seed=11, resume=part)
    out = []
    while engine.has_unfinished():
        out += engine.step()
    assert engine.stats.spec_verifies > 0
    _check_stats(model, PROMPTS[0], out[0], 3)
    with pytest.raises(ValueError, match="does not carry them"):
        engine.submit(PROMPTS[0], params, seed=1, resume=part.__class__(
            0, part.token_ids, part.logprobs, "abort", part.versions))


# -- the rules -----------------------------------------------------------------------------------


def test_latr_fork_rule_on_given_probabilities() -> None:
    # second candidate likely enough (>= 0.25) and within half of the first: fork
    assert latr_forks(0.45, 0.40, 0.25, 0.5)
    assert latr_forks(0.50, 0.25, 0.25, 0.5)  # both bounds are inclusive
    assert not latr_forks(0.50, 0.24, 0.25, 0.5)  # too unlikely in absolute terms
    assert not latr_forks(0.70, 0.30, 0.25, 0.5)  # likely, but far from the first (0.4 > 0.35)
    assert latr_forks(0.70, 0.30, 0.25, 0.6)  # a wider margin admits it


def test_similarity_pruning_rule() -> None:
    assert rouge_l([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert rouge_l([1, 2, 3, 4], [5, 6, 7, 8]) == 0.0
    assert rouge_l([1, 2, 3, 4], [1, 9, 3, 4]) == pytest.approx(2 * 3 / 8)  # LCS 1 3 4
    assert rouge_l([], []) == 1.0 and rouge_l([1], []) == 0.0
    # a branch that differs from its parent in its forced token only is a near-copy
    assert too_similar([7, 2, 3, 4, 5], [6, 2, 3, 4, 5], 0.75)
    assert not too_similar([7, 8, 3, 9, 5], [6, 2, 3, 4, 5], 0.75)


def test_share_decays_linearly_to_zero() -> None:
    s = TreeSettings(mode="latr", share=0.8, decay_steps=10)
    assert [tree_share(s, k) for k in (0, 5, 10, 20)] == pytest.approx([0.8, 0.4, 0.0, 0.0])
    assert tree_share(TreeSettings(mode="latr", share=0.3), 1000) == 0.3  # no decay


def test_entropy_cuts_and_forced_mask() -> None:
    assert entropy_cuts([0.1, 0.9, 0.5, 0.9], 3) == [1, 3, 2]
    assert entropy_cuts([0.2, 0.1], 3) == [0, 1, 0]  # short response: cycled
    assert forced_mask(3, 5, "mask") == [0, 0, 0, 1, 1]
    assert forced_mask(3, 5, "keep") is None and forced_mask(0, 5, "mask") is None


# -- LATR through the scheduler ----------------------------------------------------------------


def _groups(k: int, seed: int = 0) -> list[EncodedPrompt]:
    gen = random.Random(seed)
    return [EncodedPrompt(Sample(id=f"p{i}", prompt="", answer=""),
                          [1] + [gen.randrange(20, 88) for _ in range(gen.randrange(3, 7))])
            for i in range(k)]


def _latr(model, n=4, temperature=1.0, max_tokens=12, **tree):
    engine = NativeEngine(model, eos_token_ids=[EOS])
    params = SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens)
    settings = TreeSettings(mode=tree.pop("mode", "latr"), **tree)
    return engine, RolloutScheduler(engine, params, tree=settings, seed=3)


def _greedy_second(model, ids, max_tokens):
    """Along the greedy path from `ids`: (tokens, p1, p2, second token) per position."""
    tokens, p1, p2, second = [], [], [], []
    for _ in range(max_tokens):
        with torch.no_grad():
            probs = model(input_ids=torch.tensor([ids + tokens])).logits[0, -1].softmax(-1)
        v, i = torch.topk(probs, 2)
        p1.append(float(v[0]))
        p2.append(float(v[1]))
        second.append(int(i[1]))
        tokens.append(int(i[0]))
        if tokens[-1] == EOS:
            break
    return tokens, p1, p2, second


def test_latr_forks_where_the_rule_says(model) -> None:
    """The threshold is set between the largest second-candidate probability on the
    root's greedy path and every earlier one: the root's first fork is there, onto that
    second candidate (a fork needs a token after it: not at the last position)."""
    prompt = _groups(1)[0]
    tokens, p1, p2, second = _greedy_second(model, prompt.ids, 12)
    at = max(range(len(p2) - 1), key=lambda t: p2[t])
    threshold = (p2[at] + max(p2[:at])) / 2 if at else p2[at] * 0.999
    engine, sched = _latr(model, n=2, latr_threshold=threshold, latr_margin=1.0,
                          forced_tokens="keep")
    group = sched.run([prompt]).groups[0]
    assert len(group.trajectories) == 2
    assert sched.trees.log[0] == (0, at, second[at])
    child = next(t for t in group.trajectories if len(t.response_ids) > at
                 and t.response_ids[at] == second[at])
    assert child.response_ids[:at] == tokens[:at]
    assert child.logprobs[at] == pytest.approx(math.log(p2[at]), abs=1e-4)  # 'keep'
    assert child.loss_mask is None


def test_latr_keeps_group_size_and_treats_forced_tokens_by_config(model) -> None:
    """Forks everywhere (threshold 0.02): the group fills fast, then samples at T=0.7.
    'mask' zeroes the greedy/forced tokens; 'keep' records their temperature-1 log-probs."""
    prompts = _groups(3)
    for forced in ("mask", "keep"):
        engine, sched = _latr(model, temperature=0.7, latr_threshold=0.02, latr_margin=1.0,
                              forced_tokens=forced)
        groups = sched.run(prompts).groups
        assert [len(g.trajectories) for g in groups] == [4, 4, 4]
        assert sched.trees.counters.forks >= 3 * 3 and sched.trees.counters.switched > 0
        for g in groups:
            for t in g.trajectories:
                ref, _ = _reference(model, g.trajectories[0].prompt_ids, t.response_ids)
                temp1 = ref.gather(-1, torch.tensor(t.response_ids)[:, None])[:, 0]
                if forced == "mask":
                    assert t.loss_mask is not None and t.loss_mask[0] == 0
                    greedy = t.loss_mask.index(1) if 1 in t.loss_mask else len(t.loss_mask)
                    assert t.loss_mask == [0] * greedy + [1] * (len(t.loss_mask) - greedy)
                else:
                    assert t.loss_mask is None
                    greedy = next(k for k, (lp, r) in enumerate(zip(t.logprobs, temp1))
                                  if abs(lp - float(r)) > 1e-3) if any(
                        abs(lp - float(r)) > 1e-3 for lp, r in zip(t.logprobs, temp1)) else 0
                # greedy/forced tokens carry the policy's temperature-1 log-prob
                assert t.logprobs[:greedy] == pytest.approx(temp1[:greedy].tolist(), abs=1e-4)


def test_latr_prunes_near_copies_and_still_fills_the_group(model, monkeypatch) -> None:
    """The random tiny model copies its last token, so its branches never repeat their
    parents (the rule itself is tested above on given spans): the first two comparisons are
    made to prune, and each compares the child's span over [born, born + L) with its
    parent's over the same positions; the pruned branches leave the group, which still fills."""
    seen = []

    def prune_first_two(span, parent_span, similarity):
        seen.append((list(span), list(parent_span)))
        return len(seen) <= 2

    monkeypatch.setattr(trees, "too_similar", prune_first_two)
    engine, sched = _latr(model, max_tokens=16, latr_threshold=0.035, latr_margin=1.0,
                          latr_lookahead=(1, 2), latr_similarity=0.3)
    groups = sched.run(_groups(2)).groups
    assert sched.trees.counters.prunes == 2
    assert [len(g.trajectories) for g in groups] == [4, 4]
    forced = {tok for _, _, tok in sched.trees.log}
    for span, parent_span in seen:
        assert len(span) == len(parent_span) in (1, 2)
        assert span[0] in forced and span[0] != parent_span[0]


def test_a_tree_whose_last_running_branches_are_pruned_still_fills(model, monkeypatch) -> None:
    """The random tiny model copies its last token, so a prompt ending in EOS gets a greedy
    root that ends at once. It forks at that last position (the fork rule made to fire
    once), and the child is pruned at its first lookahead point: the tree loses its last
    running branch while it still grows. It is filled with plain samples at once, so the
    group completes in its round (none is left over to start again as a second tree over
    the same slots)."""
    asked = []
    monkeypatch.setattr(trees, "latr_forks", lambda *_: asked.append(1) or len(asked) == 1)
    monkeypatch.setattr(trees, "too_similar", lambda *_: True)
    engine, sched = _latr(model, max_tokens=16, latr_lookahead=(1,))
    prompt = EncodedPrompt(Sample(id="eos", prompt="", answer=""), [1, 30, EOS])
    groups = sched.run([prompt]).groups
    c = sched.trees.counters
    assert (c.forks, c.prunes, c.filled) == (1, 1, 3)
    assert len(groups) == 1 and not sched.pool and not engine.has_unfinished()
    root = groups[0].trajectories[0]
    assert root.response_ids == [EOS] and sched.trees.log[0][1] == 0
    # the root is tree 0, each plain sample a tree of its own
    assert [t.tree for t in groups[0].trajectories] == [0, 1, 2, 3]


def test_share_picks_groups_and_decay_turns_trees_off(model) -> None:
    engine, sched = _latr(model, share=0.5)
    hits = sum(sched.trees.takes(uid) for uid in range(400))
    assert 160 < hits < 240  # binomial(400, 0.5): 4 standard deviations
    engine, sched = _latr(model, decay_steps=2)
    engine.publish(2)  # version 2: share decayed to 0
    groups = sched.run(_groups(2)).groups
    assert sched.trees.counters.groups == 0 and all(len(g.trajectories) == 4 for g in groups)


# -- entropy branching -------------------------------------------------------------------------


def test_entropy_branching_forks_at_the_most_uncertain_tokens(model) -> None:
    prompts = _groups(3, seed=1)
    engine, sched = _latr(model, mode="entropy", max_tokens=16, entropy_branches=4)
    groups = sched.run(prompts).groups
    assert [len(g.trajectories) for g in groups] == [4, 4, 4]
    assert engine.stats.reused_tokens > 0 and sched.trees.counters.lent_prefixes == 9
    cuts_by_group: dict[int, list[int]] = {}
    for uid, t, _ in sched.trees.log:
        cuts_by_group.setdefault(uid, []).append(t)
    forks_prefill = 0
    for uid, g in enumerate(groups):
        root = g.trajectories[0]  # the root finishes before its forks start
        ref, _ = _reference(model, root.prompt_ids, root.response_ids)
        entropy = -(ref.exp() * ref).sum(-1)
        want = entropy_cuts(entropy.tolist(), 3)
        assert sorted(cuts_by_group[uid]) == sorted(want)
        for fork in g.trajectories[1:]:
            t = max(c for c in want if fork.response_ids[:c] == root.response_ids[:c])
            assert fork.logprobs[:t] == root.logprobs[:t]
            assert fork.versions[:t] == root.versions[:t]
            assert fork.loss_mask is None
        forks_prefill += len(set(want))
    # each fork computed one token of its prefix; the rest came from the root's cache
    assert engine.stats.prefill_tokens == sum(len(p.ids) for p in prompts) + forks_prefill


def test_entropy_leaves_are_labelled_with_their_roots_tree(model) -> None:
    """Two roots of four leaves each: every leaf carries its root's tree index, which
    tree_grpo reads. A root's forks are its own: each shares the root's response and
    log-probs up to a distinct one of the root's three highest-entropy positions (checked
    as a matching of forks to cuts, so a fork labelled with the other root fails)."""
    prompts = _groups(2, seed=4)
    _, sched = _latr(model, n=8, mode="entropy", max_tokens=16, entropy_branches=4)
    for g in sched.run(prompts).groups:
        labels = [t.tree for t in g.trajectories]
        assert sorted(labels) == [0, 0, 0, 0, 1, 1, 1, 1]
        roots = {k: g.trajectories[labels.index(k)] for k in (0, 1)}  # placed first
        assert roots[0].response_ids[0] != roots[1].response_ids[0]
        for k, root in roots.items():
            ref, _ = _reference(model, root.prompt_ids, root.response_ids)
            want = entropy_cuts((-(ref.exp() * ref).sum(-1)).tolist(), 3)
            assert sum(c > 0 for c in want) >= 2
            forks = [t for t in g.trajectories if t.tree == k and t is not root]
            fits = [{c for c in want if f.response_ids[:c] == root.response_ids[:c]
                     and f.logprobs[:c] == root.logprobs[:c]} for f in forks]
            assert any(all(c in fit for c, fit in zip(order, fits))
                       for order in itertools.permutations(want)), (want, fits)
    # tree 0: one success of four; tree 1: four of four. The lone success weighs more.
    first = [labels.index(0), labels.index(1)]
    rewards = torch.tensor([float((k == 0) == (i == first[0])) for i, k in enumerate(labels)])
    advantages = tree_grpo(rewards, torch.zeros(8), trees=torch.tensor(labels))
    assert advantages[first[0]] > advantages[first[1]] + 1.0


def test_short_latr_tree_fills_with_plain_samples_on_its_kept_prompt(model) -> None:
    """No fork (threshold 0.99): the greedy root ends alone, 3 plain samples fill the group
    with the root's seeds' siblings, and the root's kept cache lends them the prompt."""
    prompts = _groups(2)
    engine, sched = _latr(model, latr_threshold=0.99)
    groups = sched.run(prompts).groups
    c = sched.trees.counters
    assert (c.forks, c.filled, c.lent_prefixes) == (0, 6, 2)
    assert [len(g.trajectories) for g in groups] == [4, 4]
    # the greedy tree is tree 0; each plain sample is a tree of its own (tree_grpo)
    assert [[t.tree for t in g.trajectories] for g in groups] == [[0, 1, 2, 3]] * 2
    assert engine.stats.prefill_tokens == sum(len(p.ids) + 1 for p in prompts)
    assert engine.stats.reused_tokens == sum(len(p.ids) - 1 for p in prompts)
    plain = RolloutScheduler(NativeEngine(model, eos_token_ids=[EOS]), SamplingParams(
        n=4, max_tokens=12), seed=3).run(prompts).groups
    for g, p in zip(groups, plain):  # the fill samples are plain slots 1..3, seed for seed
        assert sorted(t.response_ids for t in g.trajectories[1:]) == sorted(
            t.response_ids for t in p.trajectories[1:])


@pytest.mark.slow
def test_bench_tree_counts_every_side() -> None:
    """`rollwise bench tree` on the tiny arithmetic config (its warm start is cached)."""
    from rollwise.bench.tree import run

    data = run(None, rounds=1, prompts=3, fork_after=2, progress=lambda *_: None,
               overrides=["run.threads=1", "rollout.group_size=4"])
    rows = {r["side"]: r for r in data["sides"]}
    assert set(rows) == {"plain", "latr", "entropy", "entropy-running"}
    for r in rows.values():
        assert (r["groups"], r["responses"]) == (3, 12)
        assert r["distinct_correct"] <= r["distinct"] <= r["responses"]
    assert rows["plain"]["forks"] == rows["plain"]["reused_tokens"] == 0
    assert rows["entropy"]["forks"] == 6 and rows["entropy"]["reused_tokens"] > 0
    assert rows["entropy"]["masked_tokens"] == 0
    assert rows["entropy-running"]["forks"] == 6
    assert data["median_entropy_over_plain_seconds"] > 0


def test_latr_switch_in_place_equals_abort_and_resume(model, monkeypatch) -> None:
    """Retuning a greedy branch to sampling gives the tokens an abort + resume with the same
    seed gives (draws are a function of seed and position), without the recomputation."""
    prompts = _groups(3)
    settings = dict(temperature=0.7, latr_threshold=0.02, latr_margin=1.0)
    engine, sched = _latr(model, **settings)
    retuned = sched.run(prompts).groups
    monkeypatch.delattr(NativeEngine, "retune")
    engine2, sched2 = _latr(model, **settings)
    resumed = sched2.run(prompts).groups
    assert sched.trees.counters.switched == sched2.trees.counters.switched > 0
    for a, b in zip(retuned, resumed):
        key = sorted((t.response_ids, t.loss_mask) for t in a.trajectories)
        assert key == sorted((t.response_ids, t.loss_mask) for t in b.trajectories)
    assert engine.stats.recompute_tokens < engine2.stats.recompute_tokens


def test_entropy_forks_running_roots_after_a_few_tokens(model) -> None:
    """entropy_fork_after = 4: each root forks at its highest-entropy position among its first
    4 tokens while it runs on; the fork carries the root's prefix (log-probs, versions)."""
    prompts = _groups(3, seed=1)
    engine, sched = _latr(model, mode="entropy", max_tokens=16, entropy_branches=2,
                          entropy_fork_after=4)
    groups = sched.run(prompts).groups
    assert [len(g.trajectories) for g in groups] == [4, 4, 4]
    assert sched.trees.counters.forks == 6 and engine.stats.recompute_tokens > 0
    for uid, g in enumerate(groups):
        cuts = [t for u, t, _ in sched.trees.log if u == uid]
        assert len(cuts) == 2 and all(0 <= t < 4 for t in cuts)
        first_cut = {}  # response -> its argmax-entropy position among its first 4 tokens
        for t in g.trajectories:
            ref, _ = _reference(model, t.prompt_ids, t.response_ids)
            entropy = -(ref.exp() * ref).sum(-1)[:4]
            first_cut[id(t)] = entropy_cuts(entropy.tolist(), 1)[0]
        for c in cuts:  # a root whose cut it is, and its fork: same prefix and log-probs
            assert any(r is not f and first_cut[id(r)] == c
                       and f.response_ids[:c] == r.response_ids[:c]
                       and f.logprobs[:c] == r.logprobs[:c]
                       for r in g.trajectories for f in g.trajectories)
    _, finished = _latr(model, mode="entropy", max_tokens=16, entropy_branches=2)
    finished.run(prompts)
    assert engine.stats.forward_passes < finished.engine.stats.forward_passes


def test_trees_leave_no_kept_cache_behind(model) -> None:
    """Roots and branches are submitted with keep_kv; each is lent or let go when done."""
    for mode in ("latr", "entropy"):
        engine, sched = _latr(model, mode=mode, temperature=0.7, latr_threshold=0.02,
                              latr_margin=1.0)
        sched.run(_groups(3))
        assert engine.stats.retained > 0 and not engine.admission.retained


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize("sets,message", [
    (["tree.mode=latr", "schedule.strategy=partial"], "'partial' keeps unfinished"),
    (["tree.mode=entropy", "schedule.strategy=sync"], "admits requests only into an empty"),
    (["tree.mode=latr", "speculation.reuse=true"], "turn one off"),
    (["tree.mode=entropy", "tree.entropy_branches=3"], "not a multiple"),
    (["tree.mode=latr", "rollout.group_size=1", "algorithm.advantage=reinforce_pp"],
     "no room for a branch"),
])
def test_preflight_refuses_what_a_tree_cannot_grow_under(sets, message) -> None:
    from rollwise.compose.config import ConfigError, load_config
    from rollwise.compose.preflight import check_config

    with pytest.raises(ConfigError, match=message):
        check_config(load_config("configs/tiny_arith.toml", sets))
    check_config(load_config("configs/tiny_arith.toml", ["tree.mode=entropy"]))


def test_tree_keys_are_validated_and_reach_the_scheduler() -> None:
    from rollwise.compose.config import ConfigError, load_config
    from rollwise.rollout.trees import tree_settings

    with pytest.raises(ConfigError, match="latr_lookahead"):
        load_config("configs/tiny_arith.toml", ["tree.latr_lookahead=[0]"])
    with pytest.raises(ConfigError, match="latr_threshold"):
        load_config("configs/tiny_arith.toml", ["tree.latr_threshold=1.5"])
    cfg = load_config("configs/tiny_arith.toml", [
        "tree.mode=latr", "tree.latr_lookahead=[30,4,4]", "tree.share=0.5"])
    s = tree_settings(cfg.tree)
    assert (s.mode, s.latr_lookahead, s.share) == ("latr", (4, 30), 0.5)


def test_a_rounds_tree_counters_reach_the_step_record(model) -> None:
    """Each round's forks, prunes and tree groups are that round's (not cumulative) and
    appear in the step's rollout metrics; a plain round has none of the keys."""
    _, sched = _latr(model, mode="entropy", max_tokens=16, entropy_branches=4)
    first = sched.run(_groups(3, seed=1)).figures.metrics()
    assert first["tree_groups"] == 3 and first["tree_forks"] == 9  # 3 forks per group of 4
    second = sched.run(_groups(2, seed=2)).figures.metrics()
    assert second["tree_groups"] == 2 and second["tree_forks"] == 6
    assert sched.trees.counters.forks == 15
    plain = RolloutScheduler(NativeEngine(model, eos_token_ids=[EOS]),
                             SamplingParams(n=4, max_tokens=8), seed=3)
    assert "tree_forks" not in plain.run(_groups(1)).figures.metrics()
