"""Tree rollouts inside a response (rollout/trees.py) and the engine's per-token statistics
they read: top log-probs and entropies against a direct forward pass, the LATR fork and
prune rules, the decay schedule, the importance-ratio treatment of forced tokens, and
entropy branching (group size, fork positions, shared prefixes)."""

from __future__ import annotations

import pytest
import torch

from rollwise.engine import NativeEngine, SamplingParams
from rollwise.engine import native as native_module

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
