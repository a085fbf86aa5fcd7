"""The static-shape decode step (engine/step.py) against the general chunk pass it replaces
for single-token decoding (`step_mode="rows"`), and against Hugging Face.

Modes: `eager` (exact sizes), `padded` (the bucketed shapes a CUDA graph replays, run
eagerly: how the CPU checks what a GPU captures), `graph` where the test device is CUDA.
Tokens must be identical. Log-probs: eager computes the same products in the same order as
the chunk pass (bit-identical in practice); padded attention also sums exact zeros over the
keys beyond each row's length and runs the projections on more rows, which may regroup the
float32 sums of a matrix kernel: a few ulps of logits of magnitude < 30, so 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from rollwise.engine import NativeEngine, SamplingParams
from rollwise.engine.decoder import Decoder
from rollwise.engine.hf import HFEngine
from rollwise.engine.layers import Layers
from rollwise.engine.sampling import sample_tokens, uniforms
from rollwise.engine.step import DecodeStep, row_bucket, sample_on_device

EOS = 2
PROMPTS = [[1, 20, 30, 40, 12, 7, 9, 33], [1, 5], [1, 44, 45, 46, 47], [1, 9, 9]]


@pytest.fixture
def model(tiny_llama):
    m = tiny_llama()
    with torch.no_grad():
        m.model.norm.weight.mul_(6.0)  # sharp logits: well-separated greedy paths
    return m


def _modes(device: torch.device) -> list[str]:
    return ["eager", "padded"] + (["graph"] if device.type == "cuda" else [])


def _run(model, mode, device, submits, *, steps_before_abort=None, abort=(), **kw):
    """Submit (prompt, params, seed) triples, optionally abort some ids after a few steps,
    run to the end; {request id: (tokens, log-probs, finish reason)} and the stats."""
    engine = NativeEngine(model, eos_token_ids=[EOS], device=device, step_mode=mode, **kw)
    ids = [engine.submit(p, params, seed=seed) for p, params, seed in submits]
    out, steps = {}, 0
    while engine.has_unfinished():
        if steps == steps_before_abort:
            for i in abort:
                c = engine.abort(ids[i])
                out[c.request_id] = (c.token_ids, c.logprobs, c.finish_reason)
        for c in engine.step():
            out[c.request_id] = (c.token_ids, c.logprobs, c.finish_reason)
        steps += 1
    assert (engine.decode_step.calls > 0) == (mode != "rows")
    return out, engine.stats


def _same(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid][0] == b[rid][0], rid
        assert a[rid][2] == b[rid][2], rid
        diff = max((abs(x - y) for x, y in zip(a[rid][1], b[rid][1])), default=0.0)
        assert diff <= tol, (rid, diff)


def test_sample_on_device_matches_sample_tokens() -> None:
    """Per-row temperatures (greedy among them) give each row exactly what the host-side
    sampler gives it alone: same token, same log-prob bits."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=gen) * 4
    temps = [0.0, 1.0, 0.7, 1.3, 0.0, 1.0]
    u = uniforms([11, 12, 13, 14, 15, 16], [0, 3, 5, 7, 9, 2])
    tok, lp = sample_on_device(logits, torch.tensor(temps, dtype=torch.float64), u)
    for i, t in enumerate(temps):
        want_tok, want_lp = sample_tokens(logits[i: i + 1], t, 0, 1.0, u[i: i + 1])
        assert int(tok[i]) == int(want_tok[0])
        assert float(lp[i]) == float(want_lp[0])


@pytest.mark.parametrize("kind,temp", [("plain", 1.0), ("greedy", 0.0)])
def test_uniform_batches_take_the_short_draw_with_the_same_result(kind, temp) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 200, generator=gen) * 3
    u = uniforms([1, 2, 3, 4, 5], [0, 1, 2, 3, 4])
    temps = torch.full((5,), temp, dtype=torch.float64)
    short = sample_on_device(logits, temps, u, kind)
    full = sample_on_device(logits, temps, u, "scaled")
    assert torch.equal(short[0], full[0]) and torch.equal(short[1], full[1])


def test_row_buckets_cover_every_batch_with_little_padding() -> None:
    for n in range(1, 300):
        b = row_bucket(n)
        assert b >= n and (b - n < 32) and b <= 2 * n
    assert len({row_bucket(n) for n in range(1, 257)}) <= 14  # graphs to capture


@pytest.mark.device
def test_static_step_equals_chunk_pass(model, test_device) -> None:
    """Groups of different sizes and prompt lengths, per-request temperatures (greedy
    among them) and ignore_eos rows, with aborts mid-way: the same tokens, log-probs and
    finish reasons as the general chunk pass, one forward per step either way."""
    model = model.to(test_device)
    submits = []
    for g, prompt in enumerate(PROMPTS):
        for k in range(3 + g):  # 3, 4, 5, 6 samples: the group layout's nmax varies
            temp = [1.0, 0.0, 0.8][k % 3]
            params = SamplingParams(temperature=temp, max_tokens=12 + 3 * k,
                                    ignore_eos=(k == 2))
            submits.append((prompt, params, 100 * g + k))
    ref, ref_stats = _run(model, "rows", test_device, submits, steps_before_abort=4,
                          abort=(1, 7))
    assert sum(r[2] == "abort" for r in ref.values()) == 2
    for mode in _modes(test_device):
        got, stats = _run(model, mode, test_device, submits, steps_before_abort=4,
                          abort=(1, 7))
        _same(ref, got, 0.0 if mode == "eager" and test_device.type == "cpu" else 1e-5)
        assert stats.forward_passes == ref_stats.forward_passes
        assert stats.generated_tokens == ref_stats.generated_tokens


@pytest.mark.device
def test_static_step_under_parking_and_prefix_eviction(model, test_device) -> None:
    """A budget too small for every row: rows are parked and restored, prefixes leave and
    come back, rows move between cache slots; the static step still equals the chunk pass."""
    model = model.to(test_device)
    params = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    submits = [(p, params, 7 * i + k) for i, p in enumerate(PROMPTS) for k in range(4)]
    ref, ref_stats = _run(model, "rows", test_device, submits, kv_budget_tokens=260)
    assert ref_stats.preemptions > 0
    for mode in _modes(test_device):
        got, stats = _run(model, mode, test_device, submits, kv_budget_tokens=260)
        _same(ref, got, 1e-5)
        assert stats.preemptions == ref_stats.preemptions


@pytest.mark.device
def test_truncated_sampling_rows_are_drawn_from_returned_logits(model, test_device) -> None:
    """top-k / top-p rows take the host draw on the step's logits: same results."""
    model = model.to(test_device)
    submits = [(p, SamplingParams(temperature=0.9, top_k=5, top_p=0.9, max_tokens=10), i)
               for i, p in enumerate(PROMPTS)]
    ref, _ = _run(model, "rows", test_device, submits)
    for mode in _modes(test_device):
        got, _ = _run(model, mode, test_device, submits)
        _same(ref, got, 1e-5)


@pytest.mark.device
def test_padded_step_greedy_parity_with_generate(model, test_device) -> None:
    """The bucketed (graph-shaped) step decodes greedily what Hugging Face generate does."""
    model = model.to(test_device)
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=16)
    hf = HFEngine(model, pad_token_id=0, eos_token_ids=[EOS], batch_size=64)
    want = [c.token_ids for c in hf.generate(PROMPTS, greedy)]
    for mode in _modes(test_device):
        engine = NativeEngine(model, eos_token_ids=[EOS], device=test_device, step_mode=mode)
        assert [c.token_ids for c in engine.generate(PROMPTS, greedy)] == want


def test_converted_weights_are_refreshed_in_place(tiny_llama) -> None:
    """A converted copy (float64 here; bfloat16 on a GPU) keeps its storage across
    publications, so a captured graph reads the new weights; the values follow the model."""
    model = tiny_llama()
    dec = Decoder(model, dtype=torch.float64)
    assert not dec.shared
    q = model.model.layers[0].self_attn.q_proj
    fused = dec._linears[(q, model.model.layers[0].self_attn.k_proj,
                          model.model.layers[0].self_attn.v_proj)]
    norm = dec._tensors[model.model.norm]
    ptrs = (fused.w.data_ptr(), norm.data_ptr())
    with torch.no_grad():
        q.weight.add_(1.0)
        model.model.norm.weight.mul_(2.0)
    dec.refresh()
    fused2 = dec._linears[(q, model.model.layers[0].self_attn.k_proj,
                           model.model.layers[0].self_attn.v_proj)]
    assert (fused2.w.data_ptr(), dec._tensors[model.model.norm].data_ptr()) == ptrs
    torch.testing.assert_close(fused2.w[: q.weight.shape[0]], q.weight.double())
    torch.testing.assert_close(dec._tensors[model.model.norm], model.model.norm.weight.double())


def test_graph_mode_needs_cuda_and_modes_are_checked(tiny_llama) -> None:
    dec = Decoder(tiny_llama())
    from rollwise.engine.kvcache import KVCache

    cache = KVCache(2, dec.kv_heads, dec.head_dim, dec.dtype, dec.device)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        DecodeStep(Layers(dec), cache, "graph")
    with pytest.raises(ValueError, match="not one of"):
        DecodeStep(Layers(dec), cache, "fast")
    assert DecodeStep(Layers(dec), cache, "auto").mode == "eager"


def test_cache_growth_is_counted(tiny_llama) -> None:
    """Reallocation bumps the epoch that captured graphs are keyed on."""
    from rollwise.engine.kvcache import KVCache

    cache = KVCache(2, 1, 16, torch.float32, torch.device("cpu"))
    e = cache.epoch
    cache.ensure_rows(4, 10)
    assert cache.epoch == e + 1
    cache.ensure_rows(4, 10)  # fits: no reallocation
    assert cache.epoch == e + 1


@pytest.mark.slow
def test_compiled_step_equals_eager(model) -> None:
    """torch.compile'd step (symbolic sizes: one compilation serves every batch) decodes
    the same tokens; inductor may fuse and reorder float32 sums, so log-probs to 1e-4."""
    submits = [(p, SamplingParams(temperature=[1.0, 0.0][k % 2], max_tokens=10 + k), 9 * i + k)
               for i, p in enumerate(PROMPTS) for k in range(3)]
    ref, _ = _run(model, "eager", torch.device("cpu"), submits, steps_before_abort=3,
                  abort=(2,))
    got, _ = _run(model, "compile", torch.device("cpu"), submits, steps_before_abort=3,
                  abort=(2,))
    _same(ref, got, 1e-4)


@pytest.mark.precision
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_static_step_equals_chunk_pass_in_converted_precisions(model, dtype) -> None:
    """bfloat16 and int8 engines (converted weights, fused projections; int8's kernel
    differs under the AVX2 cap, which `make test` also runs): the eager step computes the
    chunk pass's products on the same shapes, so tokens and log-probs are identical."""
    submits = [(p, SamplingParams(temperature=1.0, max_tokens=16), 5 * i + k)
               for i, p in enumerate(PROMPTS) for k in range(3)]
    ref, _ = _run(model, "rows", torch.device("cpu"), submits, dtype=dtype)
    got, _ = _run(model, "eager", torch.device("cpu"), submits, dtype=dtype)
    _same(ref, got, 0.0)
