"""Memory a run can see (rollwise.system.runtime): the process's peak resident set per step and per
phase, and thread counts that follow the cores free of other work."""

from __future__ import annotations

import sys

import pytest
import torch

from rollwise.system import runtime
from rollwise.observe.progress import format_step_line
from rollwise.run.rundir import StepTimer

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
                   lr=1e-3, logprob_chunk=4, **kw)


def test_checkpointing_gives_the_same_update(tiny_llama, random_trajectories) -> None:
    """Recomputing activations in the backward pass changes memory, not the update (float64:
    the same products in the same order)."""
    from rollwise.learner import collate

    trajs = random_trajectories(6)
    batch = collate(trajs, torch.tensor([1.0, -0.5, 0.3, -1.2, 0.8, -0.1]),
                    torch.arange(6) // 2, pad_id=0)
    plain = tiny_llama(torch.float64)
    ckpt = tiny_llama(torch.float64)
    a = _learner(plain, share_prompts=False)
    b = _learner(ckpt, activation_checkpointing=True)
    assert not b.share_prompts  # a recomputed layer cannot replay the prompt's cache
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
