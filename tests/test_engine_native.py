"""The native engine against Hugging Face: greedy parity with `generate`, behaviour log-probs
against a full forward pass, sampling statistics, abort/resume, the token budget, prefix
sharing, in-place weight updates, versions, other Llama-family architectures and LoRA."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from rollwise.engine import Engine, NativeEngine, SamplingParams, UnsupportedModel, make_engine
from rollwise.engine.hf import HFEngine, warp_logits
from rollwise.engine.sampling import derive_seed
from rollwise.types import Completion

EOS = 2
PROMPTS = [[1, 20, 30, 40, 12, 7, 9, 33], [1, 5], [1, 44, 45, 46, 47]]  # lengths 8, 2, 5
CHI2_CRITICAL_DF7_P1E3 = 24.3219  # P(X > 24.32) = 1e-3 for 7 degrees of freedom


@pytest.fixture
def model(tiny_llama):
    """The tiny Llama with sharpened logits (final-norm gain 6), so that greedy paths are
    well separated and sampled distributions far from uniform."""
    m = tiny_llama()
    with torch.no_grad():
        m.model.norm.weight.mul_(6.0)
    return m


def _native(model, **kw) -> NativeEngine:
    return NativeEngine(model, eos_token_ids=[EOS], **kw)


def _hf(model) -> HFEngine:
    return HFEngine(model, pad_token_id=0, eos_token_ids=[EOS], batch_size=64)


def _full_forward_logprobs(model, prompt, tokens, temperature=1.0, top_k=0, top_p=1.0):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0]
    logits = logits[len(prompt) - 1: len(prompt) + len(tokens) - 1]
    logp = warp_logits(logits, temperature, top_k, top_p)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


# -- parity with Hugging Face ----------------------------------------------------------------


def test_engine_protocol_and_empty_call(model) -> None:
    engine = _native(model)
    assert isinstance(engine, Engine)
    assert engine.generate([], SamplingParams()) == []
    engine.publish(4)
    assert engine.version == 4


def test_greedy_identical_to_hf_generate(model) -> None:
    params = SamplingParams(n=2, temperature=0.0, max_tokens=24)
    want = _hf(model).generate(PROMPTS, params)
    got = _native(model).generate(PROMPTS, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    assert [c.prompt_index for c in got] == [0, 0, 1, 1, 2, 2]


def test_greedy_identical_on_the_warm_started_tiny_model() -> None:
    """The tiny model the configs train, on its arithmetic prompts: most responses stop at
    EOS early, so rows leave the batch at different steps."""
    from rollwise.bench.common import load_workload

    policy, prompts = load_workload("tiny", 24)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    hf = HFEngine(policy.model, pad_token_id=0, eos_token_ids=policy.stop_ids)
    want = hf.generate(prompts, params)
    got = NativeEngine(policy.model, eos_token_ids=policy.stop_ids, max_num_seqs=7).generate(
        prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert {c.finish_reason for c in got} == {"stop"}


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.9), (0.7, 5, 0.9)])
def test_sampled_logprobs_equal_full_forward(model, temperature, top_k, top_p) -> None:
    params = SamplingParams(n=3, temperature=temperature, top_k=top_k, top_p=top_p,
                            max_tokens=12, seed=0)
    for c in _native(model).generate(PROMPTS, params):
        ref = _full_forward_logprobs(model, PROMPTS[c.prompt_index], c.token_ids,
                                     temperature, top_k, top_p)
        assert torch.isfinite(ref).all(), "sampled a token outside the truncated support"
        assert (ref - torch.tensor(c.logprobs)).abs().max() < 1e-4


def test_first_tokens_follow_the_model_distribution(model) -> None:
    """Chi-square goodness of fit of 4000 first tokens against softmax(logits / 0.8)."""
    prompt = PROMPTS[0]
    outs = _native(model, max_num_seqs=512).generate(
        [prompt], SamplingParams(n=4000, temperature=0.8, max_tokens=1, seed=5))
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].double()
                              / 0.8, -1)
    top = probs.argsort(descending=True)[:7].tolist()  # 7 cells + the rest: df = 7
    counts = [0] * 8
    for c in outs:
        t = c.token_ids[0]
        counts[top.index(t) if t in top else 7] += 1
    expected = [float(probs[t]) * 4000 for t in top] + [float(1 - probs[top].sum()) * 4000]
    assert min(expected) > 5, "cells too small for the chi-square approximation"
    chi2 = sum((o - e) ** 2 / e for o, e in zip(counts, expected))
    assert chi2 < CHI2_CRITICAL_DF7_P1E3, (counts, expected)


def test_same_seed_same_output_whatever_the_batch(model) -> None:
    params = SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=9)
    a = _native(model).generate(PROMPTS, params)
    b = _native(model, max_num_seqs=3).generate(PROMPTS, params)
    c = _native(model).generate(PROMPTS, SamplingParams(n=4, max_tokens=10, seed=10))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


# -- abort / resume, budget, sharing ---------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_abort_then_resume_continues_exactly(model, temperature) -> None:
    params = SamplingParams(temperature=temperature, max_tokens=20, ignore_eos=True)
    whole = _native(model)
    rid = whole.submit(PROMPTS[0], params, seed=3)
    while whole.has_unfinished():
        done = whole.step()
    want = done[0]
    engine = _native(model)
    rid = engine.submit(PROMPTS[0], params, seed=3)
    other = engine.submit(PROMPTS[1], params, seed=4)  # a neighbour in the batch
    for _ in range(7):
        engine.step()
    part = engine.abort(rid)
    assert part.finish_reason == "abort" and 0 < len(part.token_ids) < 20
    assert part.token_ids == want.token_ids[: len(part.token_ids)]
    assert max(abs(a - b) for a, b in zip(part.logprobs, want.logprobs)) < 1e-5
    engine.publish(1)  # the continuation is sampled under a new version
    rid2 = engine.submit(PROMPTS[0], params, seed=3, resume=part)
    finished = {}
    while engine.has_unfinished():
        finished.update({c.request_id: c for c in engine.step()})
    got = finished[rid2]
    assert other in finished
    assert got.token_ids == want.token_ids
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-5
    k = len(part.token_ids)
    assert got.versions == [0] * k + [1] * (20 - k)


def test_released_cache_is_freed_and_regrown_with_the_same_outputs(model) -> None:
    """`release_cache` frees the key/value regions only while nothing waits or runs; the
    next call grows them again and samples exactly what a fresh engine samples."""
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=5)
    want = _native(model).generate(PROMPTS, params)
    engine = _native(model)
    first = engine.generate(PROMPTS, params)
    assert engine.cache.nbytes() > 0
    rid = engine.submit(PROMPTS[0], params, seed=1)
    engine.step()
    held = engine.cache.nbytes()
    assert engine.release_cache() == 0 and engine.cache.nbytes() == held  # busy: kept
    engine.abort(rid)
    assert engine.release_cache() == held
    assert engine.cache.nbytes() == 0 and engine.kv_tokens() == 0
    epoch = engine.cache.epoch
    again = engine.generate(PROMPTS, params)
    assert engine.cache.epoch == epoch + 2  # each region allocated once, at its former size
    for got in (first, again):
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        assert [c.logprobs for c in got] == [c.logprobs for c in want]  # the same arithmetic


def test_token_budget_never_exceeded_and_overload_completes(model) -> None:
    params = SamplingParams(n=5, temperature=1.0, max_tokens=30, seed=1, ignore_eos=True)
    want = _native(model).generate(PROMPTS, params)
    engine = _native(model, kv_budget_tokens=64)  # 15 sequences need up to ~500 tokens
    for i, p in enumerate(PROMPTS):
        for k in range(5):
            engine.submit(p, SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),
                          seed=derive_seed(1, i * 5 + k), tag=i * 5 + k)  # as generate()
    done: dict[int, Completion] = {}
    while engine.has_unfinished():
        for c in engine.step():
            done[c.prompt_index] = c
        assert engine.kv_tokens() <= 64
    assert engine.stats.peak_kv_tokens <= 64
    assert engine.stats.preemptions > 0 and engine.stats.parks > 0
    assert [done[j].token_ids for j in range(15)] == [c.token_ids for c in want]
    for j in range(15):
        assert max(abs(a - b) for a, b in zip(done[j].logprobs, want[j].logprobs)) < 1e-4


def test_request_larger_than_budget_is_refused_clearly(model) -> None:
    with pytest.raises(ValueError, match="kv_budget_tokens"):
        _native(model, kv_budget_tokens=20).submit(PROMPTS[0], SamplingParams(max_tokens=16))


def test_prefix_sharing_same_outputs_and_prompt_prefilled_once(model) -> None:
    params = SamplingParams(n=6, temperature=1.0, max_tokens=12, seed=4)
    shared, alone = _native(model), _native(model, share_prefix=False)
    a, b = shared.generate(PROMPTS, params), alone.generate(PROMPTS, params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    for x, y in zip(a, b):
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-5
    lengths = sum(len(p) for p in PROMPTS)
    assert shared.stats.prefill_tokens == lengths
    assert alone.stats.prefill_tokens == 6 * lengths


# -- weights, versions -----------------------------------------------------------------------


def test_optimizer_step_is_visible_without_transfer(model) -> None:
    engine = _native(model)
    params = SamplingParams(n=1, temperature=0.0, max_tokens=12)
    before = engine.generate(PROMPTS, params)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = model(input_ids=torch.tensor([PROMPTS[0]]), labels=torch.tensor([PROMPTS[0]])).loss
    loss.backward()
    opt.step()
    engine.publish(1)
    after = engine.generate(PROMPTS, params)
    assert [c.token_ids for c in after] == [c.token_ids for c in _hf(model).generate(PROMPTS,
                                                                                    params)]
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert all(c.versions == [1] * len(c.token_ids) for c in after)


def test_versions_record_the_policy_that_sampled_each_token(model) -> None:
    engine = _native(model)
    rid = engine.submit(PROMPTS[1], SamplingParams(max_tokens=9, ignore_eos=True), seed=0)
    for _ in range(3):
        engine.step()
    engine.publish(5)
    while engine.has_unfinished():
        out = engine.step()
    assert out[0].request_id == rid
    assert out[0].versions == [0, 0, 0, 0] + [5] * 5  # admission samples the first token


# -- other architectures, LoRA, fallback -----------------------------------------------------


def _family_model(kind: str):
    from transformers import (
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 128, "eos_token_id": EOS}
    torch.manual_seed(0)
    if kind == "qwen2":
        m = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    elif kind == "qwen3":
        m = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, tie_word_embeddings=True))
    else:
        m = MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1 and p.shape[0] == 32:  # norms: sharpen, as the fixture does
                p.mul_(4.0)
            elif p.dim() == 1:
                p.normal_(0, 0.5)  # q/k/v biases (Qwen2)
    return m.eval()


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "mistral"])
def test_llama_family_parity(kind) -> None:
    m = _family_model(kind)
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=16)
    want = _hf(m).generate(PROMPTS, greedy)
    engine = _native(m)
    assert [c.token_ids for c in engine.generate(PROMPTS, greedy)] == [
        c.token_ids for c in want]
    for c in engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=10, seed=1)):
        ref = _full_forward_logprobs(m, PROMPTS[c.prompt_index], c.token_ids)
        assert (ref - torch.tensor(c.logprobs)).abs().max() < 1e-4


def test_lora_adapters_are_read_live(model) -> None:
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8,
                                                  target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # B starts at zero: make the adapter matter
    params = SamplingParams(temperature=0.0, max_tokens=12)
    engine = _native(peft_model)
    want = _hf(peft_model).generate(PROMPTS, params)
    assert [c.token_ids for c in engine.generate(PROMPTS, params)] == [c.token_ids for c in want]
    with peft_model.disable_adapter():
        base = _hf(peft_model).generate(PROMPTS, params)
    assert [c.token_ids for c in want] != [c.token_ids for c in base]


def test_other_architectures_fall_back_to_hf_with_a_message() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2)).eval()
    with pytest.raises(UnsupportedModel, match="gpt2"):
        NativeEngine(gpt2, eos_token_ids=[EOS])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = make_engine("native", gpt2, eos_token_ids=[EOS], pad_token_id=0)
    assert isinstance(engine, HFEngine)
    assert any("falling back to the 'hf' engine" in str(w.message) for w in caught)


# -- smollm2 (slow) --------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_greedy_identical_and_logprobs_exact() -> None:
    from rollwise.bench.common import load_workload

    torch.set_num_threads(2)
    policy, prompts = load_workload("smollm2-135m", 6)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    hf = HFEngine(policy.model, pad_token_id=policy.tokenizer.pad_token_id,
                  eos_token_ids=policy.stop_ids)
    engine = NativeEngine(policy.model, eos_token_ids=policy.stop_ids)
    want = hf.generate(prompts, params)
    assert [c.token_ids for c in engine.generate(prompts, params)] == [c.token_ids for c in want]
    for c in engine.generate(prompts[:2], SamplingParams(n=2, max_tokens=24, seed=0)):
        ref = _full_forward_logprobs(policy.model, prompts[c.prompt_index], c.token_ids)
        assert (ref - torch.tensor(c.logprobs)).abs().max() < 1e-4
    assert math.isfinite(sum(c.logprobs[0] for c in want))


def test_a_request_finished_by_its_first_token_stops_there(model) -> None:
    """The first token (drawn when the prompt is admitted) can end a request: a stop id, or
    max_tokens=1; it gets no second token from the same step's decode."""
    engine = _native(model)
    free = engine.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True, seed=4))
    one = engine.generate(PROMPTS, SamplingParams(max_tokens=1, seed=4))
    assert [c.token_ids for c in one] == [c.token_ids[:1] for c in free]
    assert all(c.finish_reason == "length" for c in one)
    first = free[0].token_ids[0]
    (stopped,) = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=6, seed=4,
                                                             stop_token_ids=(first,)))
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
