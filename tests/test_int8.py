"""int8 rollouts (engine.dtype = "int8", the low-precision lever for CPUs without native
bfloat16): the product's error against its arithmetic bound, log-probs that are those of
the int8 policy that sampled, re-quantization at each publication, and the config path."""

from __future__ import annotations

import copy

import pytest
import torch

from rollwise.engine import NativeEngine, SamplingParams, projections
from rollwise.engine.projections import Int8Dense, int8_kernel, int8_weight_levels

pytestmark = pytest.mark.precision


@pytest.fixture(scope="module")
def workload():
    from rollwise.bench.common import load_workload

    return load_workload("tiny", 16)


# every integer kernel this machine can run: the one `int8_kernel` picks, torch._int_mm
# (oneDNN's, the reference loop's) and FBGEMM's where torch has it
KERNELS = sorted({int8_kernel(), "onednn"}
                 | ({"fbgemm"} if "fbgemm" in torch.backends.quantized.supported_engines
                    else set()))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("smooth", [False, True])
def test_int8_product_within_its_rounding_bound(smooth, kernel) -> None:
    """Rounding puts each operand within half a step of its value: with steps sx_m (per row
    of x: max|x_m| times the kernel's `activation_step`, 1/127 or FBGEMM's 2/127) and sw_n
    (per row of W), |x_mk - xq_mk sx_m| <= sx_m / 2 and likewise for W, so
    |y - x W^T|_mn <= sum_k (|x_mk| sw_n + |W_nk| sx_m) / 2 + K sx_m sw_n / 4 (integer sums
    are exact; float32 scaling adds a few ulps, covered by the 1% margin)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=gen) * torch.linspace(0.1, 5, 96)  # uneven channels
    w = torch.randn(40, 96, generator=gen)
    s = torch.rand(96, generator=gen) + 0.5 if smooth else None
    lin = Int8Dense(w, None, s, kernel=kernel)
    got = lin(x)
    xs, ws = (x / s, w * s) if smooth else (x, w)
    sx = xs.abs().amax(1, keepdim=True) * lin.activation_step
    levels = 127 if kernel == "fbgemm" else int8_weight_levels()  # 63 where 8 bits saturate
    sw = ws.abs().amax(1) / levels
    bound = (xs.abs() @ torch.ones(96, 1) * sw / 2 + sx / 2 * ws.abs().sum(1)
             + 96 * sx * sw / 4)
    err = (got - x @ w.T).abs()
    assert torch.all(err <= bound * 1.01 + 1e-5), float((err / bound).max())
    assert err.max() > 0  # it really is quantized
    # a row's result does not depend on the rows beside it (per-row quantization)
    assert torch.equal(lin(x[3:4])[0], got[3])


def test_fbgemm_product_is_the_exact_integer_product() -> None:
    """FBGEMM's kernel computes what its quantized operands say: rows scaled to [-1, 1],
    step 2/127 with zero point 64 (the +1/-1 columns fix that range for every batch),
    weights per channel; int32 sums, so the result is the float64 integer product up to
    float32 rounding of the scaling."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("this torch has no FBGEMM")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 576, generator=gen) * 3
    w = torch.randn(64, 576, generator=gen)
    lin = Int8Dense(w, None, None, kernel="fbgemm")
    amax = x.abs().amax(1, keepdim=True)
    xq = torch.round((x / amax) / (2 / 127)).double()  # in [-64, 64]: never saturates
    wq = torch.round(w / (w.abs().amax(1, keepdim=True) / 127)).double()
    want = (xq @ wq.T) * (2 / 127) * amax.double() * (w.abs().amax(1).double() / 127)
    got = lin(x).double()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_int8_kernel_follows_vnni_and_the_caps(monkeypatch) -> None:
    """VNNI uncapped: oneDNN's int8 product; capped to AVX2 (either variable) or no VNNI:
    FBGEMM, as a real AVX2 CPU; neither: the reference loop; on a device: the device's."""
    for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: True)
    assert int8_kernel() == "onednn"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert int8_kernel() == "onednn"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert int8_kernel() == "fbgemm"
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert int8_kernel() == "fbgemm"
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: False)
    assert int8_kernel() == "fbgemm"
    monkeypatch.setattr(projections, "_has_fbgemm", lambda: False)
    assert int8_kernel() == "loop"
    assert int8_kernel("meta") == "device"


def test_int8_kernel_is_exact_at_the_weight_range_used() -> None:
    """torch._int_mm is exact for activations in [-127, 127] and weights within the
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
