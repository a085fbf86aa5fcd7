"""The native engine keeps a conversation's keys/values across turns (`keep_kv`): the next
turn (history + sampled tokens + observation) is prefilled only from where the retained
cache ends, with the same tokens and log-probs as a full prefill; publication and budget
pressure drop what is retained, before any running row is parked."""

from __future__ import annotations

import pytest
import torch

from rollwise.engine import NativeEngine, SamplingParams
from rollwise.engine.sampling import derive_seed

EOS = 2
FIRST = [[1, 20, 30, 40, 12, 7, 9, 33], [1, 5], [1, 44, 45, 46, 47], [1, 60, 61]]
TURNS = 3
# float32 log-probs of the same tokens computed with a different split of the prompt (one
# pass vs. cached keys + suffix) differ by rounding only: each of the tiny model's sums is
# over at most a few hundred terms, so the relative error is of order 1e2 * 6e-8 per layer
# and stays far below 1e-4 after the logits (|log p| < 10); a wrong cache (a shifted
# position, a missing token) moves log-probs by O(0.1) or changes the sampled ids.
LOGPROB_TOL = 1e-4


@pytest.fixture
def model(tiny_llama):
    m = tiny_llama()
    with torch.no_grad():
        m.model.norm.weight.mul_(6.0)
    return m


def _observation(c: int, turn: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 * c + turn)
    return torch.randint(3, 80, (2 + (c + turn) % 4,), generator=g).tolist()


def _run(engine: NativeEngine, rids: list[int]) -> dict[int, object]:
    done = {}
    while engine.has_unfinished():
        for c in engine.step():
            done[c.request_id] = c
    return {r: done[r] for r in rids}


def _converse(engine: NativeEngine, keep: bool, publish_between: bool = False):
    """TURNS turns of every conversation, all conversations concurrent; returns each turn's
    completions per conversation and the prompts submitted."""
    params = SamplingParams(temperature=1.0, max_tokens=6)
    histories = [list(p) for p in FIRST]
    outs, prompts = [], []
    for turn in range(TURNS):
        rids = [engine.submit(h, params, seed=derive_seed(7 + c, turn), keep_kv=keep)
                for c, h in enumerate(histories)]
        prompts.append([list(h) for h in histories])
        got = _run(engine, rids)
        outs.append([got[r] for r in rids])
        for c, h in enumerate(histories):
            h += got[rids[c]].token_ids + _observation(c, turn)
        if publish_between:
            engine.publish(engine.version + 1)
    return outs, prompts


def test_reused_turns_match_full_prefill_and_skip_the_history(model) -> None:
    reuse = NativeEngine(model, eos_token_ids=[EOS])
    outs, prompts = _converse(reuse, keep=True)
    # reference: every turn's prompt into a fresh engine, prefilled from scratch
    for turn in range(TURNS):
        for c, prompt in enumerate(prompts[turn]):
            fresh = NativeEngine(model, eos_token_ids=[EOS])
            rid = fresh.submit(prompt, SamplingParams(temperature=1.0, max_tokens=6),
                               seed=derive_seed(7 + c, turn))
            ref = _run(fresh, [rid])[rid]
            got = outs[turn][c]
            assert got.token_ids == ref.token_ids, (turn, c)
            diff = max(abs(a - b) for a, b in zip(got.logprobs, ref.logprobs))
            assert diff < LOGPROB_TOL, (turn, c, diff)
    # the history each later turn reused: the previous prompt and the previous turn's
    # cached tokens (all but its last, which was never fed back)
    expect = sum(len(prompts[t - 1][c]) + len(outs[t - 1][c].token_ids) - 1
                 for t in range(1, TURNS) for c in range(len(FIRST)))
    plain = NativeEngine(model, eos_token_ids=[EOS])
    outs_plain, _ = _converse(plain, keep=False)
    assert [[o.token_ids for o in t] for t in outs_plain] == [[o.token_ids for o in t]
                                                              for t in outs]
    assert reuse.stats.reused_tokens == expect > 0
    assert plain.stats.reused_tokens == 0
    assert reuse.stats.prefill_tokens == plain.stats.prefill_tokens - expect
    assert plain.stats.prefill_tokens == sum(len(p) for t in prompts for p in t)
    assert reuse.stats.retained == TURNS * len(FIRST)


def test_a_kept_request_that_ends_on_its_first_token_keeps_its_prompt(model) -> None:
    """The tiny model copies its last token: a prompt ending in EOS ends at once, the token
    drawn from the prompt's logits and no row computed. Its prompt's keys/values are kept
    all the same, and the next turn on it computes only what it adds, with the same tokens
    and log-probs as a full prefill."""
    prompt, more = [1, 30, EOS], [40, 41]
    engine = NativeEngine(model, eos_token_ids=[EOS])
    first = engine.submit(prompt, SamplingParams(temperature=0.0, max_tokens=6), keep_kv=True)
    assert _run(engine, [first])[first].token_ids == [EOS]
    assert engine.stats.retained == 1
    params = SamplingParams(temperature=1.0, max_tokens=6)
    rid = engine.submit(prompt + more, params, seed=5)
    got = _run(engine, [rid])[rid]
    fresh = NativeEngine(model, eos_token_ids=[EOS])
    ref_rid = fresh.submit(prompt + more, params, seed=5)
    ref = _run(fresh, [ref_rid])[ref_rid]
    assert got.token_ids == ref.token_ids
    assert max(abs(a - b) for a, b in zip(got.logprobs, ref.logprobs)) < LOGPROB_TOL
    assert engine.stats.reused_tokens == len(prompt)


def test_publish_drops_retained_kv(model) -> None:
    engine = NativeEngine(model, eos_token_ids=[EOS])
    _, prompts = _converse(engine, keep=True, publish_between=True)
    assert engine.stats.reused_tokens == 0
    assert engine.stats.prefill_tokens == sum(len(p) for t in prompts for p in t)
    assert engine.kv_tokens() == 0


def test_an_engine_reading_anothers_weights_drops_kept_kv_when_that_one_publishes(model) -> None:
    """The evaluator's engine reads the rollout engine's weights and is never published
    itself: its kept conversations must still go when the weights change."""
    rollout = NativeEngine(model, eos_token_ids=[EOS], dtype="bfloat16")
    evaluator = NativeEngine(model, eos_token_ids=[EOS], dtype="bfloat16", weights_from=rollout)
    params = SamplingParams(temperature=1.0, max_tokens=6)
    first = [evaluator.submit(p, params, seed=c, keep_kv=True) for c, p in enumerate(FIRST)]
    got = _run(evaluator, first)
    nxt = [p + got[r].token_ids + [50, 51] for p, r in zip(FIRST, first)]
    rollout.publish(1)
    _run(evaluator, [evaluator.submit(p, params, seed=c) for c, p in enumerate(nxt)])
    assert evaluator.stats.retained == len(FIRST) and evaluator.stats.reused_tokens == 0
    assert evaluator.stats.prefill_tokens == sum(map(len, FIRST)) + sum(map(len, nxt))


def test_budget_pressure_evicts_retained_before_parking(model) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=6)
    engine = NativeEngine(model, eos_token_ids=[EOS], kv_budget_tokens=48)
    rids = [engine.submit(p, params, seed=c, keep_kv=True) for c, p in enumerate(FIRST)]
    _run(engine, rids)
    held = engine.kv_tokens()
    assert held > 0 and engine.stats.retained == len(FIRST)  # retained tokens count
    # unrelated requests that need the whole budget: retained conversations go first
    other = [[1, 70 + i, 71, 72, 73, 74, 75, 76, 77, 78] for i in range(3)]
    rids = [engine.submit(p, params, seed=10 + i) for i, p in enumerate(other)]
    got = _run(engine, rids)
    assert engine.stats.retained_evictions == len(FIRST)
    assert engine.stats.preemptions == 0 and engine.stats.reused_tokens == 0
    ref = NativeEngine(model, eos_token_ids=[EOS], kv_budget_tokens=48)
    ids = [ref.submit(p, params, seed=10 + i) for i, p in enumerate(other)]
    want = _run(ref, ids)
    assert [got[r].token_ids for r in rids] == [want[r].token_ids for r in ids]


@pytest.mark.precision
def test_bfloat16_kept_cache_stays_within_the_engines_bfloat16_error(model) -> None:
    """In bfloat16 the kept keys/values (computed while decoding) and a full prefill round
    differently, so sampled episodes may part ways at a near-tie; what must hold is that a
    kept-cache turn's log-probs are as close to a float32 forward of the same tokens as the
    bfloat16 engine's always are (the 0.05 mean bound of tests/test_precision.py), and
    that the cache was really reused."""
    from rollwise.learner.logprobs import token_logprobs

    engine = NativeEngine(model, eos_token_ids=[EOS], dtype="bfloat16")
    outs, prompts = _converse(engine, keep=True)
    assert engine.stats.reused_tokens > 0
    errors = []
    for turn in range(1, TURNS):
        for c, prompt in enumerate(prompts[turn]):
            got = outs[turn][c]
            ids = torch.tensor([prompt + got.token_ids])
            mask = torch.zeros(ids.shape)
            mask[0, len(prompt):] = 1
            with torch.no_grad():
                ref = token_logprobs(model, ids, torch.ones_like(ids), mask)[0, len(prompt):]
            errors += (ref.double() - torch.tensor(got.logprobs, dtype=torch.double)).abs().tolist()
    assert sum(errors) / len(errors) < 0.05
