"""int8 rollouts (engine.dtype = "int8", the low-precision lever for CPUs without native
bfloat16): the product's error against its arithmetic bound, log-probs that are those of
the int8 policy that sampled, re-quantization at each publication, and the config path."""

from __future__ import annotations

import copy

import pytest
import torch

from rollwise.engine import NativeEngine, SamplingParams
from rollwise.engine.projections import Int8Dense, int8_weight_levels

pytestmark = pytest.mark.precision


@pytest.fixture(scope="module")
def workload():
    from rollwise.bench.common import load_workload

    return load_workload("tiny", 16)


@pytest.mark.parametrize("smooth", [False, True])
def test_int8_product_within_its_rounding_bound(smooth) -> None:
    """Symmetric rounding puts each operand within half a step of its value: with steps
    sx_m (per row of x) and sw_n (per row of W), |x_mk - xq_mk sx_m| <= sx_m / 2 and
    likewise for W, so |y - x W^T|_mn <= sum_k (|x_mk| sw_n + |W_nk| sx_m) / 2 + K sx_m sw_n / 4
    (integer sums are exact; float32 scaling adds a few ulps, covered by the 1% margin)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=gen) * torch.linspace(0.1, 5, 96)  # uneven channels
    w = torch.randn(40, 96, generator=gen)
    s = torch.rand(96, generator=gen) + 0.5 if smooth else None
    lin = Int8Dense(w, None, s)
    got = lin(x)
    xs, ws = (x / s, w * s) if smooth else (x, w)
    sx = xs.abs().amax(1, keepdim=True) / 127
    sw = ws.abs().amax(1) / int8_weight_levels()  # 127, or 63 where 8 bits would saturate
    bound = (xs.abs() @ torch.ones(96, 1) * sw / 2 + sx / 2 * ws.abs().sum(1)
             + 96 * sx * sw / 4)
    err = (got - x @ w.T).abs()
    assert torch.all(err <= bound * 1.01 + 1e-5), float((err / bound).max())
    assert err.max() > 0  # it really is quantized
    assert lin.wq.dtype == torch.int8


def test_int8_kernel_is_exact_at_the_weight_range_used() -> None:
    """The integer product is exact for activations in [-127, 127] and weights within the
    range int8_weight_levels() picked for this process (an AVX2 kernel saturates 16-bit
    pair sums beyond 64: the capped CI pass checks that case)."""
    gen = torch.Generator().manual_seed(0)
    levels = int8_weight_levels()
    assert levels in (63, 127)
    for m in (1, 5, 64):
        x = torch.randint(-127, 128, (m, 576), dtype=torch.int8, generator=gen)
        w = torch.randint(-levels, levels + 1, (96, 576), dtype=torch.int8, generator=gen)
        assert torch.equal(torch._int_mm(x, w.t()), x.int() @ w.int().t())


def _int8_reference_logprobs(teacher, model, engine: NativeEngine, prompts, completions):
    """Teacher-forced log-probs of the int8 policy: the float32 model with each quantized
    projection's output replaced by the engine's own int8 product of the same input
    (per-row quantization makes a token's result independent of the batch it is in)."""
    dec = engine.decoder
    hooks = []
    for key, lin in dec._linears.items():
        if not isinstance(lin, Int8Dense):
            continue
        mods = key if isinstance(key, tuple) else (key,)
        sizes = dec._sizes[mods]
        for i, m in enumerate(mods):
            lo, hi = sum(sizes[:i]), sum(sizes[: i + 1])
            hooks.append(m.register_forward_hook(
                lambda mod, args, out, lin=lin, lo=lo, hi=hi: lin(args[0])[..., lo:hi]))
    try:
        return teacher(model, prompts, completions)
    finally:
        for h in hooks:
            h.remove()


def _err(ref, completions) -> float:
    return float(torch.cat([r - torch.tensor(c.logprobs, dtype=torch.double)
                            for r, c in zip(ref, completions)]).abs().mean())


def test_int8_logprobs_are_those_of_the_int8_policy(workload, teacher_logprobs) -> None:
    policy, prompts = workload
    engine = NativeEngine(policy.model, dtype="int8", eos_token_ids=policy.stop_ids)
    assert engine.decoder.int8 and not engine.decoder.shared
    out = engine.generate(prompts[:8], SamplingParams(n=2, temperature=1.0, max_tokens=16,
                                                      seed=4))
    ref = _int8_reference_logprobs(teacher_logprobs, policy.model, engine, prompts, out)
    err_int8 = _err(ref, out)
    err_fp32 = _err(teacher_logprobs(policy.model, prompts, out), out)  # the float32 policy
    # Same int8 arithmetic, other kernels and batch shapes. Their float32 results differ by
    # ~1e-7 relative, which moves x / sx across a rounding boundary with probability ~1e-5
    # per element: with ~3,600 quantized inputs per token here, about one int8 step flips
    # every ten tokens, each nudging the log-prob by ~1e-3. So the int8 reference is not
    # exact, but several times closer than the float32 policy is.
    assert err_int8 < 5e-3
    assert err_int8 < err_fp32 / 2.5, (err_int8, err_fp32)
    assert err_fp32 < 0.2  # and the int8 policy is near the float32 one


def test_publish_requantizes_the_master_weights(workload) -> None:
    policy, prompts = workload
    model = copy.deepcopy(policy.model)
    engine = NativeEngine(model, dtype="int8", eos_token_ids=policy.stop_ids)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=1)
    before = engine.generate(prompts[:4], params)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate_proj.weight.mul_(-1.0)  # an "optimizer step" on an int8 projection
    assert [c.logprobs for c in engine.generate(prompts[:4], params)] == \
        [c.logprobs for c in before]  # the int8 copy holds until publication
    engine.publish(1)
    after = engine.generate(prompts[:4], params)
    assert [c.logprobs for c in after] != [c.logprobs for c in before]
    assert all(v == 1 for c in after for v in c.versions)


def test_int8_config_reaches_the_engines_with_tis(tmp_path) -> None:
    from pathlib import Path

    from rollwise.compose.config import load_config
    from rollwise.pipeline.build import build

    config = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"
    stages = build(load_config(config, [f"run.output_dir='{tmp_path}'", "run.threads=1",
                                        "task.num_eval=8", "engine.dtype='int8'"]))
    assert stages.engine.decoder.int8
    assert stages.evaluator.engine.decoder is stages.engine.decoder
    assert stages.learner.correction_fn is not None  # auto correction: tis (int8 vs float32)
    assert stages.info.precision["correction"] == "tis"
