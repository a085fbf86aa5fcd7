"""Speculative targets (issue 29): SPEC-RL reuse keeps drafting after its reused response is
rejected (from the prompt's previous responses and the running siblings), verifies long
drafts in windows that grow while they are accepted, and merges rows without a draft into
the verification pass of a large batch. The exact and coupled rules stay lossless: the
responses are token for token those of plain decoding with the same seeds."""

from __future__ import annotations

import random

import pytest
import torch

import test_rollout
from rollwise.engine import NativeEngine, SamplingParams
from rollwise.engine.sampling import derive_seed
from rollwise.rollout import RolloutScheduler
from rollwise.types import Sample

model = test_rollout.model  # the fixture: the tiny Llama with sharpened logits

STOPS = [2, 3, 5, 7, 11, 13]  # ~7% stop chance per token: lengths vary


def _prompts(k: int) -> list[tuple[Sample, list[int]]]:
    gen = random.Random(5)
    return [(Sample(id=f"p{i}", prompt=f"p{i}", answer=""),
             [1] + [gen.randrange(20, 88) for _ in range(gen.randrange(2, 9))])
            for i in range(k)]


def _responses(report) -> list[list[int]]:
    return [t.response_ids for g in report.groups for t in g.trajectories]


def _shift(model, scale: float = 0.02) -> None:
    """A policy change between epochs, as training makes (a small one)."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


@pytest.mark.parametrize("rule", ["exact", "coupled"])
def test_reuse_in_a_large_batch_is_lossless_and_needs_fewer_passes(model, rule) -> None:
    """24 rows (more than spec_max_batch) on the second epoch under a changed policy: the
    responses equal plain decoding with the same seeds; rows whose reused draft was rejected
    are drafted again from the group's index, and one pass per step serves all rows."""
    params = SamplingParams(n=4, temperature=1.0, max_tokens=48, stop_token_ids=STOPS)
    prompts = _prompts(6)
    engine = NativeEngine(model, eos_token_ids=[2])
    sched = RolloutScheduler(engine, params, strategy="continuous", spec_reuse=True,
                             reuse_rule=rule, seed=11)
    sched.run(prompts)
    _shift(model, 0.001)
    sched.seed = 12  # the exact rule samples afresh; coupled keeps the first epoch's seeds
    drafted = []
    drafter = sched._draft

    def spy(rows, limit):
        out = drafter(rows, limit)
        drafted.extend(d for d in out if d)
        return out

    sched._step_options["drafter"] = spy
    second = sched.run(prompts)
    plain = RolloutScheduler(NativeEngine(model, eos_token_ids=[2]), params,
                             strategy="continuous", seed=11 if rule == "coupled" else 12)
    plain.number_groups_from(0 if rule == "coupled" else 6)  # hence the same seeds
    want = plain.run(prompts)
    assert _responses(second) == _responses(want)
    assert drafted, "rows whose reused response was rejected get drafts from the index"
    assert second.figures.spec_accepted > 0
    # a small policy change: coupled seeds redraw most of the old tokens, in fewer passes;
    # fresh seeds (exact) redraw few, and the merged passes keep it near plain decoding
    if rule == "coupled":
        assert second.figures.forward_passes < want.figures.forward_passes
    else:
        assert second.figures.forward_passes <= want.figures.forward_passes + 1


@pytest.mark.parametrize("spec_max_tokens, want", [(16, [5, 9, 17, 17]), (0, [5, 5, 5, 5])])
def test_long_drafts_are_verified_in_growing_windows(model, spec_max_tokens, want) -> None:
    """Greedy, unchanged policy: a reused response is accepted whole, in windows of 4, 8,
    then 16 draft tokens (plus the one each pass's last logits verify) with spec_max_tokens
    16; by default (0) every window is spec_tokens wide."""
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    prompt = [1, 40, 41, 42]
    first = NativeEngine(model).generate([prompt], params)[0].token_ids
    engine = NativeEngine(model, spec_max_tokens=spec_max_tokens)
    widths = []
    plan = engine.passes.plan

    def spy(rows, tokens, *rest):
        widths.append(max(map(len, tokens)))
        return plan(rows, tokens, *rest)

    engine.passes.plan = spy
    engine.submit(prompt, params, seed=0, draft=first)
    out = []
    while engine.has_unfinished():
        out += engine.step()
    assert out[0].token_ids == first
    # the first token comes from the prompt's logits; each pass feeds its pending token
    # and its window, and verifies one more draft token with its last logits
    assert widths[:4] == want
    assert engine.stats.spec_accepted == 60


def test_drafter_drafts_on_a_lenient_request_use_the_exact_rule(model) -> None:
    """SPEC-RL's lenient rule applies to the reused response alone: once it is used up, a
    drafter's guesses are verified exactly, so even a drafter proposing the policy's least
    likely token leaves the rest of the response that of plain decoding."""
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompt = [1, 30, 31, 32]
    seed = derive_seed(4, 0)
    plain = NativeEngine(model)
    plain.submit(prompt, params, seed=seed)
    want = []
    while plain.has_unfinished():
        want += plain.step()
    reused = want[0].token_ids[:2]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    worst = int(logits.argmin())
    engine = NativeEngine(model, drafter=lambda rows, k: [[worst] * k for _ in rows],
                          spec_max_batch=8)
    engine.submit(prompt, params, seed=seed, draft=reused,
                  draft_logprobs=want[0].logprobs[:2], lenience=1e12)
    got = []
    while engine.has_unfinished():
        got += engine.step()
    assert got[0].token_ids == want[0].token_ids
    assert engine.stats.spec_verifies > 1  # the drafter's guesses were verified too


def test_batched_acceptance_equals_one_call_per_row() -> None:
    """The verifier accepts a whole pass's rows with one sampling call per setting: each
    row's draw and log-probs are bit for bit those of a call on that row alone."""
    from rollwise.engine.sampling import sample_and_score, sample_and_score_rows, uniforms

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(120, 300, generator=gen) * 3
    settings = [(1.0, 0, 1.0), (0.7, 20, 1.0), (1.0, 0, 0.9), (0.0, 0, 1.0)] * 30
    u = uniforms(list(range(120)), [7] * 120)
    score = torch.randint(0, 300, (120,), generator=gen)
    tok, lp, lp_score = sample_and_score_rows(logits, settings, u, score)
    for i, s in enumerate(settings):
        t, a, b = sample_and_score(logits[i: i + 1], *s, u[i: i + 1], score[i: i + 1])
        assert (tok[i], lp[i], lp_score[i]) == (t.item(), a.item(), b.item())


def test_spec_max_tokens_reaches_the_verifier(model) -> None:
    """speculation.max_tokens (default 0: no window wider than speculation.tokens) reaches
    the native engine's verifier through build_engine."""
    from types import SimpleNamespace

    from rollwise.compose.parts import build_engine
    from rollwise.compose.sections import SpeculationConfig

    assert SpeculationConfig().max_tokens == 0
    assert SpeculationConfig(max_tokens=16).max_tokens == 16
    policy = SimpleNamespace(model=model, stop_ids=[2], tokenizer=SimpleNamespace(pad_token_id=0))
    for asked, window in ((0, 4), (2, 4), (16, 16)):
        engine = build_engine("native", policy, 8, 0, spec_tokens=4, spec_max_tokens=asked)
        assert engine.verifier.verify_window == window
