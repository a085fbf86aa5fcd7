"""The rollout scheduler's strategies on the native engine: conservation of groups and tokens
under partial rollouts (APRIL) with random aborts, resumes and checkpoint round trips;
versions and the staleness cap; speculative decoding (Seer's grouped drafts, SPEC-RL reuse)
leaving the output unchanged; Seer's scheduling order."""

from __future__ import annotations

import json
import random

import pytest
import torch

from rollwise.engine import NativeEngine, SamplingParams
from rollwise.engine.sampling import derive_seed
from rollwise.rollout import RolloutScheduler
from rollwise.types import Sample

CHI2_CRITICAL_DF7_P1E3 = 24.3219  # P(X > 24.32) = 1e-3 for 7 degrees of freedom
STOPS = [2, 3, 5, 7, 11, 13]  # ~7% stop chance per token: lengths vary from 1 to max_tokens


@pytest.fixture
def model(tiny_llama):
    """The tiny Llama with sharpened logits (final-norm gain 4): peaked but random outputs."""
    m = tiny_llama()
    with torch.no_grad():
        m.model.norm.weight.mul_(4.0)
    return m


def _engine(model, **kw) -> NativeEngine:
    return NativeEngine(model, eos_token_ids=[2], **kw)


def _params(n=4, temperature=1.0, max_tokens=32) -> SamplingParams:
    return SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens,
                          stop_token_ids=STOPS)


def _prompts(k: int, start: int = 0) -> list[tuple[Sample, list[int]]]:
    gen = random.Random(start)
    return [(Sample(id=f"p{i}", prompt=f"p{i}", answer=""),
             [1] + [gen.randrange(20, 88) for _ in range(gen.randrange(2, 9))])
            for i in range(start, start + k)]


class _Stream:
    """The uniform prompt stream of a training run: fresh prompts on demand."""

    def __init__(self):
        self.next = 0

    def __call__(self, k: int):
        out = _prompts(k, self.next)
        self.next += k
        return out


def _reference(model, ids: list[int], params: SamplingParams, seed: int) -> list[int]:
    """The response an uninterrupted request with this seed produces."""
    engine = _engine(model)
    engine.submit(ids, params, seed=seed)
    while engine.has_unfinished():
        done = engine.step()
        if done:
            return done[0].token_ids
    raise AssertionError("request never finished")


def _spy_uids(sched: RolloutScheduler, uids: dict[str, int]) -> RolloutScheduler:
    """Record in `uids` which uid (hence which seeds) the scheduler gives each sample."""
    new = sched._new_group

    def spy(sample, ids, n):
        g = new(sample, ids, n)
        uids[sample.id] = g.uid
        return g

    sched._new_group = spy
    return sched


@pytest.mark.parametrize("strategy", ["partial", "partial+context"])
def test_partial_rollouts_conserve_groups_and_tokens(model, strategy) -> None:
    """Random step sizes, policy publications and checkpoint round trips: every group comes
    back exactly once, complete; every response equals what one uninterrupted request with the
    same seed produces (so resumed ids are byte-identical and no token is lost or repeated);
    versions record the publication that sampled each token."""
    rng = random.Random(7)
    params = _params(max_tokens=40)
    sched = RolloutScheduler(_engine(model), params, strategy=strategy, chunk_tokens=3,
                             over_provision=2.0, max_staleness=100)
    uids: dict[str, int] = {}
    _spy_uids(sched, uids)
    stream, delivered, resumed_any = _Stream(), [], 0
    for step in range(8):
        target = rng.randint(1, 3)
        report = sched.run(stream(target), stream)
        assert len(report.groups) == target
        delivered += report.groups
        resumed_any += sum(len({*t.versions}) > 1 for g in report.groups for t in g.trajectories)
        sched.publish(step + 1)
        if rng.random() < 0.5:  # a checkpoint, restored into a fresh process
            state = json.loads(json.dumps(sched.state_dict()))
            fresh = RolloutScheduler(_engine(model, version=step + 1), params,
                                     strategy=strategy, chunk_tokens=3, max_staleness=100)
            fresh.load_state_dict(state)
            sched = _spy_uids(fresh, uids)
    ids = [g.sample.id for g in delivered]
    assert len(ids) == len(set(ids)), "a group was delivered twice"
    pooled = {g.sample.id for g in sched.pool}
    assert not pooled & set(ids) and pooled | set(ids) == set(uids), "a group was lost"
    assert resumed_any > 0, "the workload never resumed a partial response across steps"
    for g in delivered:
        assert len(g.trajectories) == params.n
        for k, t in enumerate(g.trajectories):
            seed = derive_seed(0, uids[g.sample.id] * 1024 + k)
            assert t.response_ids == _reference(model, t.prompt_ids, params, seed)
            assert len(t.versions) == len(t.response_ids) == len(t.logprobs)
            assert t.versions == sorted(t.versions) and t.versions[-1] <= 8


def test_partial_stops_at_the_target_and_reports_off_policy_tokens(model) -> None:
    params = _params(max_tokens=40)
    sched = RolloutScheduler(_engine(model), params, strategy="partial", max_staleness=100)
    stream = _Stream()
    first = sched.run(stream(4), stream)
    assert len(first.groups) == 4 and first.figures.pool_groups == 4  # 2x over-provisioned
    assert first.figures.offpolicy_token_frac == 0.0
    sched.publish(1)
    second = sched.run(stream(4), stream)
    carried = [t for g in second.groups for t in g.trajectories if t.versions and
               t.versions[0] == 0]
    assert carried, "pooled responses begun under version 0 should be delivered first"
    old = sum(v == 0 for g in second.groups for t in g.trajectories for v in t.versions)
    tokens = sum(len(t.response_ids) for g in second.groups for t in g.trajectories)
    assert second.figures.offpolicy_token_frac == pytest.approx(old / tokens)
    assert second.figures.staleness_max == 1
    summary = (first.figures + second.figures).metrics()
    assert summary["staleness_max"] == 1 and summary["pool_groups"] == second.figures.pool_groups


def test_staleness_cap_restarts_old_partials_and_counts_them(model) -> None:
    params = _params(max_tokens=40)
    sched = RolloutScheduler(_engine(model), params, strategy="partial", max_staleness=2)
    stream = _Stream()
    sched.run(stream(4), stream)
    partial_tokens = sum(len((s.partial or s.done).token_ids) for g in sched.pool
                         for s in g.slots if s.partial or s.done)
    assert partial_tokens > 0
    sched.publish(3)  # three versions later: every pooled partial is too old
    report = sched.run(stream(4), stream)
    assert report.figures.stale_dropped_tokens == partial_tokens
    assert report.figures.stale_dropped > 0
    for g in report.groups:
        for t in g.trajectories:
            assert all(v == 3 for v in t.versions), "a stale token reached the learner"


def test_sync_strategy_runs_one_static_batch_with_the_same_outputs(model) -> None:
    """`sync` (the static-batch baseline): the scheduler asks the engine for static batching
    per step; every sequence is what continuous batching samples with the same seeds, but
    finished rows keep occupying (and computing in) the batch until its longest ends."""
    params = _params(n=4, temperature=1.0, max_tokens=24)
    prompts = _prompts(4)
    cont = RolloutScheduler(_engine(model), params, strategy="continuous").run(prompts)
    static = RolloutScheduler(_engine(model), params, strategy="sync").run(prompts)
    got = [[t.response_ids for t in g.trajectories] for g in static.groups]
    assert got == [[t.response_ids for t in g.trajectories] for g in cont.groups]
    lengths = [len(t) for g in got for t in g]
    assert len(set(lengths)) > 1  # lengths differ, so a static batch wastes rows
    # the first token of each comes from its prompt's prefill; then one batch of all 16
    # rows computes until the longest ends, where continuous batching computes each row
    # only while it runs
    assert static.figures.row_forwards == 16 * (max(lengths) - 1)
    assert cont.figures.row_forwards == sum(n - 1 for n in lengths) < static.figures.row_forwards


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_grouped_speculation_leaves_outputs_unchanged(model, temperature) -> None:
    """Drafts from siblings are verified with the coupled exact rule: the responses are those
    of plain decoding with the same seeds, token for token, in fewer forward passes when
    greedy (greedy siblings are identical, so their drafts are always right). Sampling at
    0.7: at 1.0 this random model's siblings share no 3-token context, so nothing drafts."""
    params = _params(n=6, temperature=temperature, max_tokens=32)
    prompts = _prompts(5)
    plain = RolloutScheduler(_engine(model), params, strategy="continuous").run(prompts)
    engine = _engine(model, spec_max_batch=64, spec_tokens=4)
    spec = RolloutScheduler(engine, params, strategy="continuous", spec_group=True).run(prompts)
    got = [[t.response_ids for t in g.trajectories] for g in spec.groups]
    want = [[t.response_ids for t in g.trajectories] for g in plain.groups]
    assert got == want
    for g, h in zip(spec.groups, plain.groups):
        for a, b in zip(g.trajectories, h.trajectories):
            torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-4)
    assert spec.figures.spec_verifies > 0
    if temperature == 0.0:
        assert spec.figures.forward_passes < plain.figures.forward_passes
        assert 1 + spec.figures.spec_accepted / spec.figures.spec_verifies > 2.0


def test_speculation_keeps_the_sampling_distribution(model) -> None:
    """A chi-square test on the second token when every request is handed the same draft
    after its first (one likely and one unlikely token): its frequencies match the policy's exact
    marginal sum_a p(a) p(b | a), computed from full forward passes."""
    prompt, n = [1, 30, 31, 32], 3000
    with torch.no_grad():
        p1 = model(input_ids=torch.tensor([prompt])).logits[0, -1].softmax(-1)
        rows = torch.tensor([prompt + [a] for a in range(p1.numel())])
        p2 = model(input_ids=rows).logits[:, -1].softmax(-1)
    marginal = (p1[:, None] * p2).sum(0)
    likely, unlikely = int(marginal.argmax()), int(marginal.argmin())
    engine = _engine(model, spec_max_batch=10**6, spec_tokens=2,  # drafts the 2nd and 3rd
                     drafter=lambda rows, k: [[likely, unlikely] for _ in rows])
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    for i in range(n):
        engine.submit(prompt, params, seed=derive_seed(99, i))
    seconds = []
    while engine.has_unfinished():
        seconds += [c.token_ids[1] for c in engine.step()]
    assert engine.stats.spec_verifies > 0 and engine.stats.spec_accepted > 0
    counts = torch.bincount(torch.tensor(seconds), minlength=marginal.numel()).double()
    top = marginal.argsort(descending=True)[:7]
    expected = torch.cat([marginal[top], (1 - marginal[top].sum())[None]]) * n
    observed = torch.cat([counts[top], (n - counts[top].sum())[None]])
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_CRITICAL_DF7_P1E3, f"chi2={chi2:.1f}"


def test_spec_reuse_drafts_from_the_previous_epoch(model) -> None:
    """Greedy, unchanged policy: the second epoch's drafts are all accepted, so it needs far
    fewer forward passes than the first for the same responses; with sampling (exact rule)
    the responses equal plain decoding with the same seeds."""
    for temperature in (0.0, 1.0):
        params = _params(n=4, temperature=temperature, max_tokens=32)
        prompts = _prompts(6)
        reuse = RolloutScheduler(_engine(model, spec_max_batch=64, spec_tokens=8), params,
                                 strategy="continuous", spec_reuse=True)
        plain = RolloutScheduler(_engine(model), params, strategy="continuous")
        epochs = [(reuse.run(prompts), plain.run(prompts)) for _ in range(2)]
        (r1, _), (r2, p2) = epochs
        assert [[t.response_ids for t in g.trajectories] for g in r2.groups] == \
            [[t.response_ids for t in g.trajectories] for g in p2.groups]
        assert r1.figures.spec_verifies == 0 and r2.figures.spec_verifies > 0
        if temperature == 0.0:
            assert r2.figures.forward_passes <= 0.5 * p2.figures.forward_passes


def test_spec_rl_rule_accepts_everything_under_an_unchanged_policy(model) -> None:
    """SPEC-RL's rule with the old log-probs: ratio 1 under the same policy, so every draft
    token is accepted and the second epoch reproduces the first exactly."""
    params = _params(n=4, temperature=1.0, max_tokens=24)
    prompts = _prompts(4)
    sched = RolloutScheduler(_engine(model, spec_max_batch=64, spec_tokens=8), params,
                             strategy="continuous", spec_reuse=True, reuse_rule="spec-rl")
    first = sched.run(prompts)
    second = sched.run(prompts)
    assert [[t.response_ids for t in g.trajectories] for g in second.groups] == \
        [[t.response_ids for t in g.trajectories] for g in first.groups]


def test_context_scheduling_serves_one_probe_per_group_first(model) -> None:
    """Seer: with one slot, the first request of every group runs before any sibling; then
    siblings go longest-predicted-first."""
    params = _params(n=3, temperature=1.0, max_tokens=24)
    engine = _engine(model, max_num_seqs=1)
    order: list[int] = []
    submit = engine.submit

    def spy(prompt, p, **kw):
        rid = submit(prompt, p, **kw)
        order.append(kw["tag"])
        return rid

    engine.submit = spy
    started: list[int] = []
    step = engine.step

    def watch(**options):
        out = step(**options)
        for r in engine.admission.rows:
            if r.id not in started:
                started.append(r.id)
        return out

    engine.step = watch
    sched = RolloutScheduler(engine, params, strategy="context", chunk_tokens=1000)
    report = sched.run(_prompts(4))
    assert len(report.groups) == 4
    tags = {rid: tag for rid, tag in enumerate(order)}
    first_four = [tags[r] for r in started[:4]]
    assert sorted(first_four) == [0, 1, 2, 3], "probes of all groups should run first"


def test_unknown_strategy_is_refused(model) -> None:
    with pytest.raises(ValueError, match="unknown rollout strategy 'fast'"):
        RolloutScheduler(_engine(model), _params(), strategy="fast")


def test_coupled_reuse_keeps_seeds_and_reproduces_an_unchanged_policy(model) -> None:
    """Rule 'coupled': each sample keeps its seed from the last epoch, so under an unchanged
    policy every draft token is what the policy redraws: all accepted, same responses, in
    fewer forward passes; under a changed policy the output is plain decoding with those
    seeds (exact rule), token for token."""
    params = _params(n=4, temperature=1.0, max_tokens=32)
    prompts = _prompts(6)
    sched = RolloutScheduler(_engine(model, spec_max_batch=64, spec_tokens=8), params,
                             strategy="continuous", spec_reuse=True, reuse_rule="coupled")
    first = sched.run(prompts)
    second = sched.run(prompts)
    responses = [[t.response_ids for t in g.trajectories] for g in first.groups]
    assert [[t.response_ids for t in g.trajectories] for g in second.groups] == responses
    assert second.figures.spec_accepted == sum(len(r) for g in responses for r in g)
    assert second.figures.forward_passes < first.figures.forward_passes
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    third = sched.run(prompts)
    plain = RolloutScheduler(_engine(model), params, strategy="continuous")
    seeds = [derive_seed(0, g * 1024 + k) for g in range(6) for k in range(4)]
    want = [_reference(model, t.prompt_ids, params, seed)
            for t, seed in zip([t for g in third.groups for t in g.trajectories], seeds)]
    assert [t.response_ids for g in third.groups for t in g.trajectories] == want
    assert plain.run(prompts).groups  # the same engine settings decode without drafts


def test_rollout_figures_of_rounds_add_with_ratios_weighted():
    """Two rounds' figures add like RewardStats: counts sum, ratios weighted by their own
    denominators (not averaged), the maximum kept, the pool the later round's."""
    from rollwise.rollout import RolloutFigures

    a = RolloutFigures(makespan_s=1.0, generated_tokens=10, trained_tokens=10,
                       offpolicy_tokens=0, staleness_sum=0, staleness_count=2,
                       pool_groups=3, lengths=[4, 6])
    b = RolloutFigures(makespan_s=3.0, generated_tokens=30, trained_tokens=30,
                       offpolicy_tokens=15, staleness_sum=6, staleness_count=4,
                       staleness_max=2, spec_verifies=2, spec_accepted=3, pool_groups=1,
                       lengths=[5, 5, 10, 10])
    m = (a + b).metrics()
    assert m["offpolicy_token_frac"] == 15 / 40 and m["staleness_mean"] == 1.0
    assert m["staleness_max"] == 2 and m["pool_groups"] == 1
    assert m["rollout_makespan_s"] == 4.0 and m["spec_accepted_len"] == 2.5
    assert (a + b).lengths == [4, 6, 5, 5, 10, 10] and (a + b).tokens_per_s == 10.0
    assert "spec_accepted_len" not in a.metrics()
