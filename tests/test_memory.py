"""Memory a run can see (rollwise.system.runtime): the process's peak resident set per step and per
phase, and thread counts that follow the cores free of other work."""

from __future__ import annotations

import sys

import pytest
import torch

from rollwise.observe.progress import format_step_line
from rollwise.run.rundir import StepTimer
from rollwise.system import runtime

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")


@linux
def test_peaks_are_per_interval_not_per_process() -> None:
    """A 400 MiB tensor freed inside a block shows in that block's peak and the step's, but
    not in the next step's (the kernel's high-water mark is reset at each reading)."""
    runtime.trim_heap()  # freed memory an earlier test left resident would be reused unseen
    runtime.device_memory()
    with runtime.rss_peak() as quiet:
        pass
    with runtime.rss_peak() as busy:
        x = torch.ones(100 * 2**20)  # 400 MiB, touched
        del x
    assert busy["mb"] > quiet["mb"] + 350
    runtime.trim_heap()  # what tune_allocator keeps resident for reuse is given back
    step = runtime.device_memory()["peak_rss_mb"]
    assert step >= busy["mb"] - 1
    assert runtime.device_memory()["peak_rss_mb"] < busy["mb"] - 350
    assert runtime.run_peak_rss_mb() >= busy["mb"] - 1


@linux
def test_step_timer_records_each_phase_peak() -> None:
    runtime.trim_heap()
    timer = StepTimer()
    with timer("rollout"):
        x = torch.ones(50 * 2**20)  # 200 MiB
        del x
        runtime.trim_heap()
    with timer("train"):
        pass
    assert timer.peaks["rollout"] > timer.peaks["train"] + 150
    assert set(timer.phases) == set(timer.peaks) == {"rollout", "train"}


FRAGMENT = """
import sys, torch
from rollwise.system import runtime
print(runtime.tune_allocator(sys.argv[1]))
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))
base = rss()
bigs, smalls = [], []
for _ in range(48):  # 8 MiB tensors, each followed by a small one that stays alive
    bigs.append(torch.ones(2**21))
    smalls.append(torch.ones(64))
del bigs  # 384 MiB freed between live small blocks
if sys.argv[2:] == ["trim"]:
    runtime.trim_heap()
print((rss() - base) // 1024)
"""


@linux
def test_compact_allocator_returns_what_reuse_keeps() -> None:
    """Freed 8 MiB tensors interleaved with live small ones: under `reuse` they stay in the
    heap (holes below live blocks cannot be trimmed), under `compact` each was mapped on its
    own and is returned at once. Each mode in a fresh process (mallopt is process-wide)."""
    import subprocess

    def kept_mb(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", FRAGMENT, mode], capture_output=True,
                             text=True, check=True)
        return int(out.stdout.split()[-1])

    if runtime.tune_allocator("reuse") != "reuse":
        pytest.skip("not glibc, jemalloc preloaded, or ROLLWISE_NO_MALLOPT set")
    assert kept_mb("reuse") > 300  # 384 MiB freed, still resident
    assert kept_mb("compact") < 50
    with pytest.raises(ValueError, match="run.allocator"):
        runtime.tune_allocator("tcmalloc")


def test_step_line_shows_the_peak() -> None:
    line = format_step_line({"step": 2, "num_steps": 5, "peak_rss_mb": 2150.0})
    assert line == "step 2/5 | rss 2.1 GB"


def test_threads_follow_the_free_cores(monkeypatch) -> None:
    """With other work on one of two cores, threads=0 means 1 thread, not 2."""
    samples = iter([{0: (100, 1000), 1: (100, 1000)},  # (idle, total) jiffies per core
                    {0: (190, 1100), 1: (105, 1100)}])  # core 0: 90% idle; core 1: 5%
    monkeypatch.setattr(runtime, "_cpu_times", lambda: next(samples))
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    before = torch.get_num_threads()
    try:
        assert runtime.configure(0) == 1 and torch.get_num_threads() == 1
        assert runtime.configure(2) == 2  # an explicit count wins
    finally:
        torch.set_num_threads(before)
    idle = iter([{0: (0, 0), 1: (0, 0)}, {0: (100, 100), 1: (80, 100)}])
    monkeypatch.setattr(runtime, "_cpu_times", lambda: next(idle))
    assert runtime.free_cores(0) == 2


# -- the learner's memory options --------------------------------------------------------------


def _learner(model, **kw):
    from rollwise.algos import policy_losses
    from rollwise.learner import Learner

    return Learner(model, loss_fn=policy_losses["ppo"], loss_options={"aggregation": "token-mean"},
                   **({"lr": 1e-3, "logprob_chunk": 4} | kw))


def test_checkpointing_gives_the_same_update(tiny_llama, random_trajectories) -> None:
    """Recomputing activations in the backward pass changes memory, not the update (float64:
    the same products in the same order), with prompts shared too: a recomputed layer
    recomputes the grouped attention from its input (tests/test_learner_shared_prompts.py
    checks it against the per-row pass)."""
    from rollwise.learner import collate

    trajs = random_trajectories(6)
    batch = collate(trajs, torch.tensor([1.0, -0.5, 0.3, -1.2, 0.8, -0.1]),
                    torch.arange(6) // 2, pad_id=0)
    plain = tiny_llama(torch.float64)
    ckpt = tiny_llama(torch.float64)
    for trajectory in trajs[1::2]:  # pairs of rows with one prompt: sharing has work to do
        trajectory.prompt_ids = list(trajs[trajs.index(trajectory) - 1].prompt_ids)
    batch = collate(trajs, torch.tensor([1.0, -0.5, 0.3, -1.2, 0.8, -0.1]),
                    torch.arange(6) // 2, pad_id=0)
    a = _learner(plain, share_prompts=True)
    b = _learner(ckpt, activation_checkpointing=True, share_prompts=True)
    assert b._shares(batch)
    ma, mb = a.update(batch), b.update(batch)
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-12)
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-12)
    assert ckpt.model.layers[0].gradient_checkpointing


def test_memory_budget_sizes_micro_batches_and_chunks(tiny_llama) -> None:
    from rollwise.learner import memory

    model = tiny_llama()  # 2 layers, hidden 32, MLP 64 (build_model's), vocabulary 88
    per_token = memory.activation_mb_per_token(model, "float32")
    cfg = model.config
    assert per_token == pytest.approx(2 * (memory.ACT_HIDDEN["float32"] * 32
                                           + memory.ACT_MLP["float32"] * cfg.intermediate_size)
                                      / 2**20)
    assert memory.activation_mb_per_token(model, "float32", checkpointing=True) < per_token
    budget = 1000 * per_token + memory.logits_mb(model, 4)
    tokens, chunk = memory.fit_budget(model, budget, precision="float32", checkpointing=False,
                                      micro_batch_tokens=4096, logprob_chunk=4)
    assert (tokens, chunk) == (1000, 4)
    # never above the configured sizes, never below MIN_TOKENS
    assert memory.fit_budget(model, 1e6, precision="float32", checkpointing=False,
                             micro_batch_tokens=512, logprob_chunk=4) == (512, 4)
    tokens, chunk = memory.fit_budget(model, 1e-3, precision="float32", checkpointing=False,
                                      micro_batch_tokens=4096, logprob_chunk=1024)
    assert tokens == memory.MIN_TOKENS and chunk == 1
    learner = _learner(model, micro_batch_tokens=4096, memory_budget_mb=budget)
    assert (learner.micro_batch_tokens, learner.logprob_chunk) == (1000, 4)


def test_state_of_full_and_lora_training(tiny_llama) -> None:
    from rollwise.learner import memory

    model = tiny_llama()
    size = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    assert memory.state_mb(model) == pytest.approx(
        {"weights_mb": size, "grads_mb": size, "adamw_mb": 2 * size})
    values = sum(p.numel() for p in model.parameters())
    # 8-bit moments: one byte each plus a float32 scale per block of 256 values
    assert memory.state_mb(model, "adamw8bit")["adamw_mb"] == pytest.approx(
        values * 2 * (1 + 4 / 256) / 2**20)
    model.requires_grad_(False)
    assert memory.state_mb(model)["adamw_mb"] == 0


# -- bigger models: rollwise bench memory ------------------------------------------------------

TINY_SHAPE = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 512, "tie_word_embeddings": True, "max_position_embeddings": 256}


@pytest.mark.slow  # `make test` stays within 8 minutes on 2 cores
def test_bench_memory_full_and_lora(tmp_path, monkeypatch) -> None:
    import json

    from rollwise.bench import memory as bm

    (tmp_path / "mini.json").write_text(json.dumps(TINY_SHAPE))
    full, lora = (bm.case("mini", kind, shapes_dir=str(tmp_path), prompt_len=8, response_len=8)
                  for kind in ("full", "lora"))
    assert full["trained_m"] == pytest.approx(full["params_m"])
    assert 0 < lora["trained_m"] < 0.2 * lora["params_m"]  # adapters only
    assert lora["adamw_mb"] < 0.2 * full["adamw_mb"]
    assert full["tokens"] == 2 * 4 * 16 and full["update_s"] > 0
    assert full["peak_rss_mb"] >= full["built_rss_mb"] > 0
    # each case of `run` is a process of its own; one that fails is a row with its error
    missing = bm.run(("no-such-shape",), ("full",), shapes_dir=str(tmp_path))["rows"][0]
    assert "no-such-shape" in missing["error"]
    compact = bm.run(("mini",), ("lora",), shapes_dir=str(tmp_path), prompt_len=8,
                     response_len=8, allocator="compact")["rows"][0]
    assert compact["allocator"] == "compact" and compact["tokens"] == full["tokens"]
    # a full fine-tune that cannot fit the memory available is not started
    assert bm.params_of("mini", tmp_path) == pytest.approx(full["params_m"] * 1e6)
    monkeypatch.setattr(bm, "_available_mb", lambda: 0.01)
    row = bm.run(("mini",), ("full",), shapes_dir=str(tmp_path))["rows"][0]
    assert row["error"].startswith("not run: needs over")


def _shape_case(shape: str, kind: str) -> dict:
    from rollwise.bench import memory as bm

    row = bm.run((shape,), (kind,), threads=runtime.free_cores())["rows"][0]
    assert "error" not in row, row
    return row


@pytest.mark.slow
def test_a_half_billion_qwen2_trains_full_within_12_gb() -> None:
    """Qwen2.5-0.5B's shape, random init, full fine-tuning with AdamW: two updates."""
    row = _shape_case("qwen2-0.5b", "full")
    assert 400 < row["params_m"] < 600 and row["trained_m"] == pytest.approx(row["params_m"])
    assert row["peak_rss_mb"] < 12 * 1024


@pytest.mark.slow
def test_a_one_and_a_half_billion_qwen2_trains_lora_within_12_gb() -> None:
    """Qwen2.5-1.5B's shape, random init, LoRA rank 16 on every projection: two updates."""
    row = _shape_case("qwen2-1.5b", "lora")
    assert 1400 < row["params_m"] < 1700 and row["trained_m"] < 0.02 * row["params_m"]
    assert row["peak_rss_mb"] < 12 * 1024


def test_reference_copy_in_bfloat16_gives_the_same_kl_under_autocast(tiny_llama) -> None:
    """Full fine-tuning with a KL term keeps a frozen reference; under bf16-autocast its
    linear layers are stored in bfloat16 (autocast rounds them so at every product): the
    reference log-probs are bitwise those of a float32 copy."""
    import copy

    from rollwise.algos import kl_estimators
    from rollwise.learner import memory, token_logprobs

    model = tiny_llama()
    model.model.layers[0].mlp.down_proj.weight.data.normal_()  # weights that round visibly
    small = memory.reference_copy(model, "bf16-autocast")
    full = copy.deepcopy(model).eval().requires_grad_(False)
    assert small.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert small.model.embed_tokens.weight.dtype == torch.float32  # tied to the output layer
    assert memory.reference_copy(model, "float32").model.layers[0].mlp.down_proj.weight.dtype \
        == torch.float32
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 88, (3, 9), generator=gen)
    attn, mask = torch.ones_like(ids), torch.zeros(3, 9)
    mask[:, 4:] = 1
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        a = token_logprobs(small, ids, attn, mask, chunk=4)
        b = token_logprobs(full, ids, attn, mask, chunk=4)
    assert torch.equal(a, b)
    learner = _learner(model, kl_coef=0.1, precision="bf16-autocast", kl_fn=kl_estimators["k3"])
    assert learner.ref_model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16


def test_checkpointing_can_be_undone(tiny_llama) -> None:
    """`rollwise bench learner` times settings in turn on one model: after its checkpointing
    variant the layers run plainly again (and hand back their key/value cache)."""
    from rollwise.learner import memory

    model = tiny_llama()
    memory.enable_checkpointing(model)
    assert model.model.layers[0].gradient_checkpointing
    memory.disable_checkpointing(model)
    assert not model.model.layers[0].gradient_checkpointing


# -- bfloat16 master weights (learner/stochastic.py) --------------------------------------------


@pytest.mark.parametrize("base", [1.0, -0.03125, 3.0e-5])
@pytest.mark.parametrize("fraction", [0.3, 0.02])
def test_stochastic_rounding_is_unbiased(base: float, fraction: float) -> None:
    """x between two bfloat16 neighbours lo and hi rounds up with probability (x - lo) / (hi
    - lo): over n roundings the fraction rounded up is within 4 binomial standard errors
    sqrt(f (1 - f) / n) of f (a false alarm about once in 16,000 cases). Round-to-nearest
    would round every one down (f < 1/2), 150+ standard errors away."""
    from rollwise.learner.stochastic import stochastic_round

    lo = torch.tensor(base, dtype=torch.bfloat16)
    # the neighbour one step away from zero: the next bit pattern (sign and magnitude)
    hi = (lo.view(torch.int16) + 1).view(torch.bfloat16)
    x = lo.float() + fraction * (hi.float() - lo.float())
    n = 200_000
    out = stochastic_round(x.expand(n).contiguous(), torch.Generator().manual_seed(7)).float()
    assert set(out.unique().tolist()) <= {lo.item(), hi.item()}
    up = float((out == hi.float()).double().mean())
    se = (fraction * (1 - fraction) / n) ** 0.5
    assert abs(up - fraction) < 4 * se, (up, fraction, se)
    assert abs(float(out.double().mean()) - float(x)) < 4 * se * abs(float(hi) - float(lo))


def test_stochastic_adamw_in_float32_is_torch_adamw() -> None:
    """With float32 parameters and moments nothing is rounded: the same update as torch's."""
    from rollwise.learner.stochastic import StochasticAdamW

    gen = torch.Generator().manual_seed(0)
    a = torch.nn.Parameter(torch.randn(300, 70, generator=gen))
    b = torch.nn.Parameter(a.detach().clone())
    ours = StochasticAdamW([a], lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1)
    for _ in range(4):
        g = torch.randn(a.shape, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def _quadratic(moments: str | None, steps: int = 40) -> list[float]:
    """Losses of a bfloat16 least-squares fit whose AdamW steps (lr 1e-3) are below half a
    bfloat16 spacing of its weights (values near 1: spacing 2^-7): `moments` None is torch's
    AdamW with round-to-nearest writes, else the stochastic one with those moments."""
    from rollwise.learner.optim import build_optimizer

    gen = torch.Generator().manual_seed(3)
    target = 1.0 + 0.5 * torch.rand(64, 32, generator=gen)
    w = torch.nn.Parameter(torch.full((64, 32), 1.25).to(torch.bfloat16))
    opt = torch.optim.AdamW([w], lr=1e-3) if moments is None else build_optimizer(
        moments, [w], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, stochastic=True)
    losses = []
    for _ in range(steps):
        loss = ((w.float() - target) ** 2).mean()
        losses.append(loss.item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return losses


def test_bfloat16_updates_below_the_spacing_still_land() -> None:
    """Round-to-nearest leaves every weight where it was (the loss does not move); stochastic
    rounding lands the updates in expectation: 40 steps of 1e-3 move each weight by up to
    0.04, so the loss (mean squared distance ~0.02 + 0.0052 variance) falls clearly."""
    nearest = _quadratic(None)
    assert nearest[-1] == nearest[0]
    for moments in ("adamw", "adamw-bf16"):
        losses = _quadratic(moments)
        assert losses[-1] < 0.8 * losses[0], (moments, losses[0], losses[-1])


def _batch(random_trajectories):
    from rollwise.learner import collate

    return collate(random_trajectories(6), torch.tensor([1.0, -0.5, 0.3, -1.2, 0.8, -0.1]),
                   torch.arange(6) // 2, pad_id=0)


def test_bfloat16_learner_moves_like_the_float32_one(tiny_llama, random_trajectories) -> None:
    """One update (lr 1e-2) of the same batch from the same weights: AdamW's first step moves
    each weight by about lr times the sign of its gradient, so the two moves agree where the
    gradients' signs do; bfloat16 products flip the sign only of near-zero gradients, and
    stochastic rounding adds under one spacing (2^-8 |w|, below lr for these |w| < 1) of
    noise. Measured 0.996 (3 seeds); the bound 0.95 leaves room, a sign-random update ~0."""
    batch = _batch(random_trajectories)
    wide = tiny_llama()
    narrow = tiny_llama()
    learner32 = _learner(wide, lr=1e-2)
    learner16 = _learner(narrow, lr=1e-2, master_dtype="bfloat16")
    assert {p.dtype for p in narrow.parameters()} == {torch.bfloat16}
    before = [p.detach().float().clone() for p in narrow.parameters()]
    learner32.update(batch)
    learner16.update(batch)
    d32 = torch.cat([(p.detach() - b).flatten() for p, b in zip(wide.parameters(), before)])
    d16 = torch.cat([(p.detach().float() - b).flatten()
                     for p, b in zip(narrow.parameters(), before)])
    cosine = float(torch.nn.functional.cosine_similarity(d32, d16, dim=0))
    assert cosine > 0.95, cosine
    losses = [learner16.update(batch)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0]


def test_bfloat16_learner_resumes_bit_for_bit(tiny_llama, random_trajectories, tmp_path) -> None:
    """Three updates in a row against one, a checkpoint (weights, optimizer state with the
    rounding generator's), a fresh model and learner loading it, and two more: the same
    bits. Without the generator's state the resumed rounding would differ."""
    from rollwise.learner import collate
    from rollwise.learner.checkpoint import load_checkpoint, save_checkpoint

    batches = [collate(random_trajectories(6, seed=s), torch.tensor([1.0, -0.5, 0.3, -1.2,
                                                                     0.8, -0.1]),
                       torch.arange(6) // 2, pad_id=0) for s in range(3)]
    straight = tiny_llama()
    learner = _learner(straight, master_dtype="bfloat16", seed=5)
    for batch in batches:
        learner.update(batch)
    first = tiny_llama()
    learner = _learner(first, master_dtype="bfloat16", seed=5)
    learner.update(batches[0])
    path = save_checkpoint(tmp_path, first, learner.state_dict(), {"step": 1})
    resumed = tiny_llama(seed=1)  # other weights: the checkpoint must replace them all
    learner = _learner(resumed, master_dtype="bfloat16", seed=99)
    state, _ = load_checkpoint(path, resumed)
    learner.load_state_dict(state)
    moments = learner.optimizer.state[learner.params[0]]
    assert moments["exp_avg"].dtype == torch.float32  # not cast to the parameter's dtype
    for batch in batches[1:]:
        learner.update(batch)
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q)


def _assert_engine_follows(engine, learner, model, trajectories, publish=False) -> None:
    """After an update (and a publication, when the engine converts something) the engine's
    greedy log-probs change, and equal an engine's built afresh on the updated weights."""
    from rollwise.engine import NativeEngine, SamplingParams

    prompts = [[1, 5, 9, 14], [1, 30, 31]]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def logprobs(e):
        return [c.logprobs for c in e.generate(prompts, greedy)]

    before = logprobs(engine)
    learner.update(_batch(trajectories))
    if publish:
        engine.publish(1)
    after = logprobs(engine)
    assert after != before
    assert after == logprobs(NativeEngine(model, eos_token_ids=[2], dtype="bfloat16"))


def test_engine_reads_the_bfloat16_learner_in_place(tiny_llama, random_trajectories) -> None:
    """A bfloat16 engine over a bfloat16 learner's model takes no converted copy (`shared`,
    no converted tensors): after an update its next log-probs change, and equal those of an
    engine built afresh on the updated weights."""
    from rollwise.engine import NativeEngine

    model = tiny_llama()
    learner = _learner(model, lr=1e-2, master_dtype="bfloat16")
    engine = NativeEngine(model, eos_token_ids=[2], dtype="bfloat16")
    assert engine.decoder.shared
    assert not engine.decoder._tensors and not engine.decoder._linears
    _assert_engine_follows(engine, learner, model, random_trajectories)


def test_autocast_bfloat16_learner_keeps_a_float32_stream(tiny_llama, random_trajectories) -> None:
    """Under bf16-autocast, bfloat16 master weights keep a float32 residual stream, as over
    float32 weights: the embedding's output is cast to float32 and the norm gains stay
    float32. The engine still reads every projection and the embedding in place and converts
    only the norm gains, again at each publication: after an update its log-probs equal an
    engine's built afresh on the updated weights."""
    from rollwise.engine import NativeEngine

    model = tiny_llama()
    learner = _learner(model, lr=1e-2, master_dtype="bfloat16", precision="bf16-autocast")
    inner = model.model
    assert inner.norm.weight.dtype == inner.layers[0].input_layernorm.weight.dtype == torch.float32
    assert {p.dtype for n, p in model.named_parameters() if "norm" not in n} == {torch.bfloat16}
    assert inner.embed_tokens(torch.tensor([[1, 2]])).dtype == torch.float32  # the stream
    _learner(model, master_dtype="bfloat16", precision="bf16-autocast")  # idempotent
    assert len(inner.embed_tokens._forward_hooks) == 1
    engine = NativeEngine(model, eos_token_ids=[2], dtype="bfloat16")
    decoder = engine.decoder
    assert decoder.shared and not decoder._linears  # projections read in place
    assert set(decoder._tensors) == {m for m in model.modules() if "RMSNorm" in type(m).__name__}
    assert inner.embed_tokens not in decoder._tensors  # the bfloat16 table, read in place
    _assert_engine_follows(engine, learner, model, random_trajectories, publish=True)
    assert inner.norm.weight.dtype == torch.float32  # the update keeps the dtypes


def test_update_frees_gradients_and_can_release_the_heap(tiny_llama, random_trajectories,
                                                         monkeypatch) -> None:
    """With `release_memory` no gradient outlives its update (room for the rollouts that
    follow) and the freed heap is given back once per update; without it the gradients stay
    in .grad (as other tests read them) and nothing is trimmed."""
    from rollwise.learner import learner as learner_module

    calls = []
    monkeypatch.setattr(learner_module, "trim_heap", lambda: calls.append(1))
    for release, expected in ((False, []), (True, [1, 1])):
        model = tiny_llama()
        learner = _learner(model, master_dtype="bfloat16", release_memory=release)
        for _ in range(2):
            learner.update(_batch(random_trajectories))
        assert all((p.grad is None) == release for p in model.parameters())
        assert calls == expected
