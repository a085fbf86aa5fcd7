"""Low-precision rollouts (docs/precision.md): the bfloat16 engine against float32, its
behaviour log-probs, the weight conversion at publication, the mismatch metrics of the
TIS/MIS corrections, and training with bfloat16 rollouts + TIS against float32."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from rollwise.algos import corrections, policy_losses
from rollwise.engine import NativeEngine, SamplingParams
from rollwise.learner import Learner
from rollwise.learner.batch import collate
from rollwise.types import Sample, Trajectory

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"
pytestmark = pytest.mark.precision  # run again under the AVX2 cap by `make test`


@pytest.fixture(scope="module")
def workload():
    """The warm-started tiny model and 24 of its arithmetic prompts (cached on disk)."""
    from rollwise.bench.common import load_workload

    policy, prompts = load_workload("tiny", 24)
    return policy, prompts


def _native_bf16() -> bool:
    """This CPU computes bfloat16 in hardware and torch is not capped below it."""
    from rollwise.compose.precision import cpu_flags, native_bf16

    return native_bf16(cpu_flags(), torch.backends.cpu.get_cpu_capability())


def _engine(policy, dtype, **kw) -> NativeEngine:
    return NativeEngine(policy.model, dtype=dtype, eos_token_ids=policy.stop_ids, **kw)


def _trajectories(prompts, completions) -> list[Trajectory]:
    return [Trajectory(sample=Sample(id=str(i), prompt="", answer=""),
                       prompt_ids=list(prompts[c.prompt_index]), response_ids=c.token_ids,
                       logprobs=c.logprobs, versions=c.versions, finish_reason=c.finish_reason)
            for i, c in enumerate(completions)]


def _mean_abs(a: list[torch.Tensor], b: list[list[float]]) -> float:
    diffs = torch.cat([x - torch.tensor(y, dtype=torch.double) for x, y in zip(a, b)])
    return float(diffs.abs().mean())


def test_bf16_greedy_agrees_with_float32_on_most_prompts(workload) -> None:
    policy, prompts = workload
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=24)
    want = _engine(policy, "float32").generate(prompts, greedy)
    got = _engine(policy, "bfloat16").generate(prompts, greedy)
    same = sum(a.token_ids == b.token_ids for a, b in zip(want, got)) / len(prompts)
    assert same >= 0.75, f"bfloat16 greedy equals float32 on {same:.0%} of prompts"
    # not the float32 policy run twice: the engine really computes in bfloat16
    assert _engine(policy, "bfloat16").decoder.cos.dtype == torch.bfloat16


def test_bf16_logprobs_are_those_of_the_bf16_policy(workload, teacher_logprobs) -> None:
    """The behaviour log-probs come from the precision that sampled: closer to a bfloat16
    forward pass of the same weights than to the float32 one (which the float32 engine
    matches to float32 rounding)."""
    policy, prompts = workload
    params = SamplingParams(n=4, temperature=1.0, max_tokens=24, seed=3)
    out16 = _engine(policy, "bfloat16").generate(prompts[:8], params)
    out32 = _engine(policy, "float32").generate(prompts[:8], params)
    model16 = copy.deepcopy(policy.model).to(torch.bfloat16)
    err_same = _mean_abs(teacher_logprobs(model16, prompts, out16), [c.logprobs for c in out16])
    err_other = _mean_abs(teacher_logprobs(policy.model, prompts, out16),
                          [c.logprobs for c in out16])
    err_fp32 = _mean_abs(teacher_logprobs(policy.model, prompts, out32),
                         [c.logprobs for c in out32])
    assert err_fp32 < 1e-5
    assert err_same < 0.02 and err_other < 0.05
    if not _native_bf16():
        # Emulated bfloat16 (AVX2, or the ISA capped): the reference's bfloat16 forward rounds
        # its softmax and norms to bfloat16 through kernels that differ from the engine's
        # (float32 softmax and norm statistics), so it is no closer a reference than float32:
        # what holds on every CPU is the bound above; the ordering only where bf16 is native.
        return
    assert err_same < err_other, (err_same, err_other)


def test_fused_converted_weights_compute_the_same_function(workload) -> None:
    """A float64 engine over the float32 model takes the converted path (q/k/v and gate/up
    fused into one matrix each): same greedy tokens and log-probs as the in-place one."""
    policy, prompts = workload
    greedy = SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=5)
    shared = _engine(policy, "float32")
    converted = _engine(policy, "float64")
    assert shared.decoder.shared and not converted.decoder.shared
    a, b = shared.generate(prompts[:6], greedy), converted.generate(prompts[:6], greedy)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    err = max(abs(x - y) for c, d in zip(a, b) for x, y in zip(c.logprobs, d.logprobs))
    assert err < 1e-4


def test_publish_converts_the_master_weights_and_is_timed(workload) -> None:
    policy, prompts = workload
    model = copy.deepcopy(policy.model)
    engine = NativeEngine(model, dtype="bfloat16", eos_token_ids=policy.stop_ids)
    evaluator = NativeEngine(model, eos_token_ids=policy.stop_ids, weights_from=engine)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=1)
    before = engine.generate(prompts[:4], params)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # an "optimizer step" on the float32 master copy
    stale = engine.generate(prompts[:4], params)
    assert [c.logprobs for c in stale] == [c.logprobs for c in before]  # old copy until publish
    engine.publish(1)
    assert engine.stats.publish_seconds > 0
    after = engine.generate(prompts[:4], params)
    assert [c.logprobs for c in after] != [c.logprobs for c in before]
    assert all(v == 1 for c in after for v in c.versions)
    # the evaluator's engine reads the same converted copy, refreshed by that publication
    assert evaluator.decoder is engine.decoder
    assert [c.logprobs for c in evaluator.generate(prompts[:4], params)] == \
        [c.logprobs for c in after]


def _learner(model, correction: str) -> Learner:
    return Learner(model, loss_fn=policy_losses["ppo"], loss_options={}, lr=1e-4,
                   correction_fn=corrections[correction], correction_options={"cap": 2.0},
                   skip_zero_advantage=False)


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_mismatch_metrics_vanish_at_the_same_precision(workload, correction) -> None:
    """Engine and learner in float32: KL 0, weights 1, nothing clipped. A bfloat16 engine
    against the float32 learner: the same metrics see the mismatch."""
    policy, prompts = workload
    params = SamplingParams(n=4, temperature=1.0, max_tokens=24, seed=2)
    metrics = {}
    for dtype in ("float32", "bfloat16"):
        outs = _engine(policy, dtype).generate(prompts[:6], params)
        trajs = _trajectories(prompts, outs)
        adv = torch.linspace(-1, 1, len(trajs))
        batch = collate(trajs, adv, torch.arange(len(trajs)) // 4, pad_id=0)
        metrics[dtype] = _learner(copy.deepcopy(policy.model), correction).update(batch)
    same, mixed = metrics["float32"], metrics["bfloat16"]
    # Same weights, same precision: the engine's and the learner's log-probs differ only by
    # float32 rounding (different kernels and batch shapes), so the metrics equal their
    # ideal values up to a few float32 ulps of the quantities they are computed from:
    # weights w = exp(d) with |d| ~ 1e-6, k3 = mean(w - 1 - log w), ESS = 1 / mean((w/mean w)^2)
    # are each a handful of float32 roundings (eps = 1.19e-7) away from 0 and 1.
    tol = 8 * torch.finfo(torch.float32).eps
    assert abs(same["correction_kl"]) < tol and abs(same["correction_kl_k1"]) < 1e-5
    assert same["correction_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert same["correction_weight_max"] == pytest.approx(1.0, abs=1e-5)
    assert same["correction_clipped_frac"] == 0.0
    assert same["correction_ess"] == pytest.approx(1.0, abs=tol)
    assert mixed["correction_kl"] > 100 * max(same["correction_kl"], 1e-8)
    assert abs(mixed["correction_weight_mean"] - 1.0) < 0.1  # a small mismatch
    if correction == "tis":  # token weights spread around 1 (MIS keeps them all at 1 here)
        assert mixed["correction_weight_max"] > 1.001 and mixed["correction_ess"] < 1.0


def test_rollout_dtype_config_reaches_the_engines(tmp_path) -> None:
    from rollwise.compose.config import ConfigError, load_config
    from rollwise.pipeline.build import build

    base = [f"run.output_dir='{tmp_path}'", "run.threads=1", "task.num_eval=8"]
    stages = build(load_config(CONFIG, [*base, "engine.dtype='bfloat16'"]))
    assert stages.engine.dtype == torch.bfloat16
    assert stages.evaluator.engine.decoder is stages.engine.decoder
    with pytest.raises(ConfigError, match="native engine"):
        build(load_config(CONFIG, [*base, "engine.dtype='bfloat16'", "engine.name='hf'"]))
    with pytest.raises(Exception, match="engine.dtype") as bad:
        load_config(CONFIG, [*base, "engine.dtype='int4'"])
    assert all(name in str(bad.value) for name in ("auto", "float32", "bfloat16", "int8"))


@pytest.mark.slow
def test_bf16_rollouts_with_tis_train_like_float32(tmp_path) -> None:
    """60 steps of the tiny config: bfloat16 rollouts + bfloat16 learner + TIS raise the
    reward and reach the float32 run's level (same seed), with the mismatch reported."""
    from rollwise.compose.config import load_config, to_toml
    from rollwise.pipeline.build import build
    from rollwise.pipeline.loop import train
    from rollwise.run.rundir import Run

    curves, last = {}, {}
    for name, extra in {"fp32": ["engine.dtype='float32'", "learner.precision='float32'"],
                        "bf16": ["engine.dtype='bfloat16'", "learner.precision='bf16-autocast'",
                                 "algorithm.correction='tis'"]}.items():
        cfg = load_config(CONFIG, [f"run.output_dir='{tmp_path}'", f"run.name='{name}'",
                                   "run.num_steps=60", "run.threads=1", "eval.every=0",
                                   "rollout.prompts_per_step=16", "task.num_eval=40", *extra])
        run = Run(tmp_path / name, resume=False, config_toml=to_toml(cfg), echo=lambda s: None)
        train(build(cfg), run, 60)
        records = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text()
                   .splitlines()]
        train_recs = [r for r in records if r["kind"] == "train"]
        curves[name] = [r["reward_mean"] for r in train_recs]
        last[name] = train_recs[-1]
    for name, rewards in curves.items():
        first, final = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
        assert final > first + 0.05, f"{name}: reward {first:.3f} -> {final:.3f}"
    fp32, bf16 = (sum(curves[n][-10:]) / 10 for n in ("fp32", "bf16"))
    assert bf16 > fp32 - 0.1, f"bf16+TIS final reward {bf16:.3f} vs float32 {fp32:.3f}"
    assert last["bf16"]["correction_kl"] > 0 and last["bf16"]["publish_seconds"] > 0
    assert "correction_kl" not in last["fp32"]


def test_compare_runs_reports_mismatch_and_publication(tmp_path) -> None:
    """Two short tiny runs (float32; bfloat16 + TIS) compared side by side: the bfloat16
    run records its publication cost and the mismatch, the float32 run neither."""
    from rollwise.bench.e2e import PRECISIONS, compare_runs
    from rollwise.compose.config import load_config, to_toml
    from rollwise.pipeline.build import build
    from rollwise.pipeline.loop import train
    from rollwise.run.rundir import Run

    for name, overrides in PRECISIONS.items():
        cfg = load_config(CONFIG, [*overrides, f"run.output_dir='{tmp_path}'",
                                   f"run.name='{name}'", "run.threads=1", "eval.every=0",
                                   "rollout.prompts_per_step=4", "task.num_eval=8"])
        run = Run(tmp_path / name, resume=False, config_toml=to_toml(cfg), echo=lambda s: None)
        train(build(cfg), run, 2, eval_before=False)
    data = compare_runs([tmp_path / "float32", tmp_path / "bfloat16"])
    fp32, bf16 = data["runs"]
    assert (fp32["run"], bf16["run"], fp32["steps"], bf16["steps"]) == (
        "float32", "bfloat16", 2, 2)
    assert bf16["publish_s"] > 0 and bf16["kl"] > 0 and bf16["weight_mean"] > 0
    assert fp32["publish_s"] < bf16["publish_s"] and fp32["kl"] is None
    assert set(data["curves"]["runs: training reward vs step"]["series"]) == {
        "float32", "bfloat16"}


def test_eval_of_a_bf16_run_reads_its_trained_weights(tmp_path) -> None:
    """`rollwise eval RUN_DIR` loads the checkpoint into the float32 master copy and must
    publish it to the bfloat16 engine: it reproduces the run's final evaluation."""
    from typer.testing import CliRunner

    from rollwise.cli import app
    from rollwise.compose.config import load_config, to_toml
    from rollwise.pipeline.build import build
    from rollwise.pipeline.loop import train
    from rollwise.run.rundir import Run

    cfg = load_config(CONFIG, [f"run.output_dir='{tmp_path}'", "run.name='b'", "run.threads=1",
                               "eval.every=0", "rollout.prompts_per_step=16", "learner.lr=1e-2",
                               "task.num_eval=40", "engine.dtype='bfloat16'"])
    run = Run(tmp_path / "b", resume=False, config_toml=to_toml(cfg), echo=lambda s: None)
    summary = train(build(cfg), run, 3)
    before, after = summary["eval_before"], summary["eval_after"]
    assert (before["accuracy"], before["mean_response_len"]) != (
        after["accuracy"], after["mean_response_len"])  # the update changed greedy outputs
    out = CliRunner().invoke(app, ["eval", str(tmp_path / "b"), "--set", "run.threads=1"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.output[out.output.index("{"):])
    assert result["accuracy"] == after["accuracy"]
    assert result["mean_response_len"] == after["mean_response_len"]


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "lora"])
def test_converted_path_covers_biases_qk_norms_and_lora(kind, tiny_llama) -> None:
    """The fused, converted weights (a float64 engine over a float32 model) compute what the
    in-place path does for Qwen2's q/k/v biases, Qwen3's q/k norms, and merged LoRA
    adapters; bfloat16 over the same models stays close to it."""
    from test_engine_native import PROMPTS, _family_model

    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8,
                                                        target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)  # adapters that change the output
    else:
        model = _family_model(kind)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=4)
    outs = {d: NativeEngine(model, dtype=d, eos_token_ids=[2]).generate(PROMPTS, params)
            for d in ("float32", "float64", "bfloat16")}
    assert [c.token_ids for c in outs["float64"]] == [c.token_ids for c in outs["float32"]]
    err = max(abs(x - y) for c, d in zip(outs["float32"], outs["float64"])
              for x, y in zip(c.logprobs, d.logprobs))
    assert err < 1e-4
    pairs = [(c, d) for c, d in zip(outs["bfloat16"], outs["float32"])
             if c.token_ids == d.token_ids]
    assert len(pairs) >= len(outs["float32"]) // 2  # same seeds: mostly the same draws
    diff = torch.tensor([x - y for c, d in pairs for x, y in zip(c.logprobs, d.logprobs)])
    assert 0 < float(diff.abs().mean()) < 0.05  # bfloat16 rounding, not another function


def test_bench_e2e_precision_axis_and_learner_bench(tmp_path) -> None:
    """`rollwise bench e2e --precision` steps float32 against bfloat16 + TIS and int8 + TIS
    (the latter two log their mismatch); `rollwise bench learner` times each variant on one
    batch."""
    from typer.testing import CliRunner

    from rollwise.bench import learner as bench_learner
    from rollwise.cli import app

    out = tmp_path / "b3.json"
    small = ["task.num_train=48", "task.num_eval=8", "rollout.prompts_per_step=4",
             "rollout.group_size=4", "run.threads=1"]
    result = CliRunner().invoke(app, ["bench", "e2e", str(CONFIG), "--precision", "--part",
                                      "steps", "--steps", "2", "--warmup", "0", "--json",
                                      str(out), *[x for s in small for x in ("--set", s)]])
    assert result.exit_code == 0, result.output
    split = json.loads(out.read_text())["step_split"][0]
    assert [r["variant"] for r in split["variants"]] == ["float32", "bfloat16", "int8"]
    assert set(split["ratios"]) == {"float32_over_bfloat16", "float32_over_int8"}
    data = bench_learner.run("tiny", prompts=2, n=4, max_tokens=8, reps=1)
    assert [r["variant"] for r in data["variants"]] == list(bench_learner.VARIANTS)
    assert data["rows"] == 8 and all(r["update_s"] > 0 for r in data["variants"])
    # counted FLOPs: each group's prompt once costs fewer than every row's own copy
    gflop = {r["variant"]: r["gflop"] for r in data["variants"]}
    assert gflop["float32-unshared"] > gflop["float32"] > 0


def test_packed_bf16_weights_give_the_plain_product() -> None:
    """oneDNN's packed layout (taken once at publication) is a layout, not an approximation."""
    from rollwise.engine.projections import Dense

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 40, generator=gen).to(torch.bfloat16)
    b = torch.randn(96, generator=gen).to(torch.bfloat16)
    packed, plain = Dense(w, b, pack=True), Dense(w, b)
    if packed.packed is None:
        pytest.skip("no oneDNN in this torch build")
    for shape in [(64, 1, 40), (3, 7, 40), (1, 40)]:
        x = torch.randn(*shape, generator=gen).to(torch.bfloat16)
        assert torch.equal(packed(x), plain(x))


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch's BLAS is not MKL")
def test_float32_products_do_not_depend_on_the_thread_count() -> None:
    """rollwise sets MKL's strict reproducibility mode on import: without it, MKL on an AVX2
    EPYC summed 5-11 rows against SmolLM2's 1536-wide down projection differently at 1
    and 2 threads, and a run's int8 rollouts changed with run.threads. Every row count up
    to 64 must now give the same bits at both."""
    import os

    import rollwise  # noqa: F401  (sets MKL_CBWR)

    assert os.environ["MKL_CBWR"]
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(576, 1536, generator=gen) * 0.02
    before = torch.get_num_threads()
    differing = []
    try:
        for rows in range(1, 65):
            x = torch.randn(rows, 1536, generator=gen)
            torch.set_num_threads(1)
            one = torch.nn.functional.linear(x, w)
            torch.set_num_threads(2)
            if not torch.equal(one, torch.nn.functional.linear(x, w)):
                differing.append(rows)
    finally:
        torch.set_num_threads(before)
    assert differing == []
