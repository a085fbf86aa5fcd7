"""Peak memory and update time per model size, full fine-tuning and LoRA (`rollwise bench
memory`, docs/performance.md "Memory").

Each case runs in a fresh process, so that its peak resident set (the kernel's VmHWM) is its
own: a random-init model of a real shape (configs/shapes/<shape>.json; no download), float32
master weights, LoRA through peft when asked for, and `steps` learner updates on a GRPO-shaped
batch of random tokens (prompts x group rows, every row with a non-zero advantage, so every
row trains). The first update allocates the gradients and AdamW's moments; the time reported
is the median of the later ones. Random weights make the numbers of memory and speed, not of
learning.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import typer

from rollwise.bench.common import print_table, save_results, say

SHAPES_DIR = Path(__file__).resolve().parents[3] / "configs" / "shapes"  # the source checkout's


def _model(shape: str, shapes_dir: Path, lora_rank: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads((shapes_dir / f"{shape}.json").read_text()))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        from rollwise.compose.sections import ModelConfig

        model = get_peft_model(model, LoraConfig(
            r=lora_rank, lora_alpha=2 * lora_rank,
            target_modules=list(ModelConfig().lora_targets), task_type="CAUSAL_LM"))
    return model


def _batch(vocab: int, prompts: int, group: int, prompt_len: int, response_len: int):
    from rollwise.learner.batch import collate
    from rollwise.types import Sample, Trajectory

    gen = torch.Generator().manual_seed(0)
    trajs = []
    for p in range(prompts):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        for _ in range(group):
            response = torch.randint(3, vocab, (response_len,), generator=gen).tolist()
            trajs.append(Trajectory(sample=Sample(id=str(p), prompt="", answer=""),
                                    prompt_ids=prompt, response_ids=response,
                                    logprobs=[-5.0] * response_len, versions=[0] * response_len,
                                    finish_reason="length"))
    adv = torch.randn(len(trajs), generator=gen)
    return collate(trajs, adv, torch.arange(len(trajs)) // group, pad_id=0)


def case(shape: str, kind: str, *, steps: int = 2, prompts: int = 2, group: int = 4,
         prompt_len: int = 32, response_len: int = 64, precision: str = "float32",
         lora_rank: int = 16, checkpointing: bool = False, memory_budget_mb: float = 0.0,
         shapes_dir: str = str(SHAPES_DIR)) -> dict[str, Any]:
    """One case in this process: `kind` "full" or "lora"."""
    from rollwise.algos import policy_losses
    from rollwise.learner import Learner
    from rollwise.learner.memory import state_mb
    from rollwise.system.runtime import run_peak_rss_mb

    model = _model(shape, Path(shapes_dir), lora_rank if kind == "lora" else 0)
    built = run_peak_rss_mb()
    batch = _batch(int(model.config.vocab_size), prompts, group, prompt_len, response_len)
    learner = Learner(model, loss_fn=policy_losses["ppo"],
                      loss_options={"aggregation": "token-mean"}, lr=1e-5, precision=precision,
                      skip_zero_advantage=False, activation_checkpointing=checkpointing,
                      memory_budget_mb=memory_budget_mb)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        learner.update(batch)
        times.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"shape": shape, "kind": kind, "params_m": params / 1e6, "trained_m": trained / 1e6,
            "precision": precision, "checkpointing": checkpointing,
            "micro_batch_tokens": learner.micro_batch_tokens, "rows": batch.num_rows,
            "tokens": int(batch.attention_mask.sum()), "built_rss_mb": built,
            "peak_rss_mb": run_peak_rss_mb(),
            **state_mb(model),
            "update_s": statistics.median(times[1:] or times), "first_update_s": times[0]}


def params_of(shape: str, shapes_dir: Path = SHAPES_DIR) -> int:
    """Parameters of a shape, counted on the meta device (nothing allocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads((shapes_dir / f"{shape}.json").read_text()))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _available_mb() -> float:
    from rollwise.compose.memory import available_mb

    free = available_mb()
    return float("inf") if free is None else free


def run(shapes: tuple[str, ...] = ("smollm2-135m", "qwen2-0.5b", "qwen2-1.5b"),
        kinds: tuple[str, ...] = ("full", "lora"), *, timeout_s: float = 1800,
        progress=None, **options) -> dict[str, Any]:
    """Every shape x kind, each in its own process (`case`); a case that fails or runs out
    of time is a row with its error. A full fine-tune whose float32 weights, gradients and
    AdamW moments (16 bytes a parameter) alone exceed the memory available now is not
    started (a 1.5B model needs 24 GB for them): its row says so."""
    rows = []
    shapes_dir = Path(options.get("shapes_dir", SHAPES_DIR))
    for shape in shapes:
        for kind in kinds:
            args = json.dumps({"shape": shape, "kind": kind, **options})
            need = 16 * params_of(shape, shapes_dir) / 2**20 if kind == "full" and (
                shapes_dir / f"{shape}.json").is_file() else 0.0
            if need > _available_mb():
                rows.append({"shape": shape, "kind": kind, "error": f"not run: needs over "
                             f"{need / 1024:.0f} GiB, {_available_mb() / 1024:.0f} available"})
                continue
            try:
                out = subprocess.run([sys.executable, "-m", "rollwise.bench.memory", args],
                                     capture_output=True, text=True, timeout=timeout_s,
                                     check=False, env=_case_env(options.get("allocator")))
                lines = out.stdout.strip().splitlines()
                row = json.loads(lines[-1]) if out.returncode == 0 and lines else {
                    "shape": shape, "kind": kind,
                    "error": (out.stderr.strip().splitlines() or ["failed"])[-1]}
            except subprocess.TimeoutExpired:
                row = {"shape": shape, "kind": kind, "error": f"over {timeout_s:.0f}s"}
            rows.append(row)
            if progress:
                progress(f"{shape} {kind}: " + (f"{row['peak_rss_mb'] / 1024:.1f} GiB, "
                                                f"{row['update_s']:.1f}s" if "error" not in row
                                                else row["error"]))
    return {"benchmark": "learner memory", "threads": torch.get_num_threads(),
            "options": options, "rows": rows}


if __name__ == "__main__":
    from rollwise.system.runtime import tune_allocator

    opts = json.loads(sys.argv[1])
    if opts.get("threads"):
        torch.set_num_threads(opts["threads"])
    opts.pop("threads", None)
    allocator = opts.pop("allocator", "system")
    if allocator != "system":  # "system": glibc's own settings, as tables before 2026-12-05
        allocator = tune_allocator(allocator)
    print(json.dumps(case(**opts) | {"allocator": allocator}))


def _case_env(allocator: str | None) -> dict[str, str]:
    """A case's environment: jemalloc preloaded for 'jemalloc', as the rollwise commands
    run."""
    from rollwise.system.preload import jemalloc_library, preload_env

    library = jemalloc_library() if allocator == "jemalloc" else None
    if allocator == "jemalloc" and library is None:
        raise typer.BadParameter("--allocator jemalloc: no jemalloc library found (install "
                                 "the ray extra, or set ROLLWISE_JEMALLOC)")
    return preload_env(library) if library else dict(os.environ)


def command(*, json: Path | None, shape: list[str] | None, kind: list[str] | None, precision: str,
            checkpointing: bool, response_len: int, steps: int, threads: int,
            allocator: str = "reuse") -> None:
    """`rollwise bench memory`: run it, print the tables, write `json` (and its page)."""
    from rollwise.system.runtime import ALLOCATORS, configure

    if allocator not in (*ALLOCATORS, "system"):
        raise typer.BadParameter(f"unknown allocator '{allocator}'; known: "
                                 f"{', '.join(ALLOCATORS)}, system")
    threads = configure(threads)
    bad = [k for k in kind or [] if k not in ("full", "lora")]
    if bad:
        raise typer.BadParameter(f"unknown kind(s) {bad}; known: full, lora")
    data = run(tuple(shape or ("smollm2-135m", "qwen2-0.5b", "qwen2-1.5b")),
               tuple(kind or ("full", "lora")), progress=say, precision=precision,
               checkpointing=checkpointing, response_len=response_len, steps=steps,
               threads=threads, allocator=allocator)
    for row in data["rows"]:
        row["peak_rss_gib"] = row["peak_rss_mb"] / 1024 if "peak_rss_mb" in row else None
    print_table(f"learner memory: {precision}, {threads} threads", data["rows"],
                ["shape", "kind", "params_m", "trained_m", "tokens", "peak_rss_gib",
                 "weights_mb", "grads_mb", "adamw_mb", "update_s", "error"])
    save_results(data, json)
