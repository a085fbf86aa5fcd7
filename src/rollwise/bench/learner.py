"""The learner's update time by precision, on one fixed batch (docs/precision.md).

A batch of real rollouts (the quickstart's shape: 4 prompts x 8 samples, temperature 0.7, at
most 64 tokens, sampled once by the float32 engine) with non-zero advantages on every row, so
each variant trains the same rows and tokens. Variants alternate within each repetition (the
first rotates); each update gets a fresh optimizer over the same model, so the weights move by
one small step per update and the timings compare like with like:

- `float32`: float32 compute, no correction;
- `bf16-autocast`: bfloat16 autocast, no correction;
- `bf16-autocast+tis`: the same plus token TIS (one more forward pass without gradient to
  recompute the old log-probs), what `auto` picks on a CPU with native bfloat16;
- `float32+tis`: float32 compute with TIS, what `auto` picks with int8 rollouts (AVX2);
- `float32-unshared`: float32 with every row running its own copy of the prompt
  (`learner.share_prompts = false`); the others run each group's prompt once (the grouped
  layer pass, `learner.share_prompts = true`);
- `float32+ckpt`, `float32-unshared+ckpt`: the same two with activation checkpointing
  (default variants with `--prompt-tokens`, the long-prompt workload);
- named with `--variant` only: `bf16-autocast+tis+fused`: torch's fused AdamW kernel
  (`learner.optimizer = "adamw-fused"`); `+fp8`, `+8bit`: torchao's AdamW with float8 or
  8-bit moments; `+ckpt`: activation checkpointing (learner/optim.py, docs/performance.md);
  `bf16-master+tis`: bfloat16 weights and gradients with stochastic rounding
  (`learner.master_dtype = "bfloat16"`, float32 moments), `+bf16m` with bfloat16 moments
  (`learner.optimizer = "adamw-bf16"`), `+ckpt` with activation checkpointing too, `+comp`
  with compensated rounding instead (`learner.master_rounding = "compensated"`). They
  train a bfloat16 copy of the model, made once before the first update.

`--prompt-tokens P` makes every prompt P tokens long (filler tokens before the question) and
every response `--max-tokens` long (past the end-of-sequence token): the long-prompt
workload of docs/performance.md, `--prompt-tokens 512 --max-tokens 64`.
Each variant's FLOPs are counted once, in an update of its own after the timed ones
(torch's FLOP counter, CPU attention included: `bench.common.count_flops`); they are
deterministic, the times are not.

Memory: the peak resident set of the process in each phase (`peak_rss_mb`: sampling the
batch, scoring it, and each variant's update, the optimizer's state included), and what
the phase added to the resident set it started from (`added_rss_mb`); freed heap memory
is returned to the system before each phase, so the start is the live set.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import typer

from rollwise.bench.common import load_workload, median, print_table, save_results, say, synchronize
from rollwise.system.runtime import rss_peak, trim_heap

# name: (precision, correction, share prompts, optimizer, activation checkpointing,
#        master dtype, "+comp" when compensated)
Variant = tuple[str, str, bool, str, bool, str]
LONG_VARIANTS = ("float32-unshared", "float32", "float32-unshared+ckpt", "float32+ckpt")
VARIANTS: dict[str, Variant] = {
    "float32": ("float32", "none", True, "adamw", False, "float32"),
    "float32-unshared": ("float32", "none", False, "adamw", False, "float32"),
    "float32+tis": ("float32", "tis", True, "adamw", False, "float32"),
    "bf16-autocast": ("bf16-autocast", "none", True, "adamw", False, "float32"),
    "bf16-autocast+tis": ("bf16-autocast", "tis", True, "adamw", False, "float32"),
}
MORE_VARIANTS: dict[str, Variant] = {  # run when named (--variant)
    "float32+ckpt": ("float32", "none", True, "adamw", True, "float32"),
    "float32-unshared+ckpt": ("float32", "none", False, "adamw", True, "float32"),
    "bf16-autocast+tis+fused": ("bf16-autocast", "tis", True, "adamw-fused", False, "float32"),
    "bf16-autocast+tis+fp8": ("bf16-autocast", "tis", True, "adamw-fp8", False, "float32"),
    "bf16-autocast+tis+8bit": ("bf16-autocast", "tis", True, "adamw8bit", False, "float32"),
    "bf16-autocast+tis+ckpt": ("bf16-autocast", "tis", True, "adamw", True, "float32"),
    "bf16-master+tis": ("bf16-autocast", "tis", True, "adamw", False, "bfloat16"),
    "bf16-master+tis+bf16m": ("bf16-autocast", "tis", True, "adamw-bf16", False, "bfloat16"),
    "bf16-master+tis+bf16m+ckpt": ("bf16-autocast", "tis", True, "adamw-bf16", True,
                                   "bfloat16"),
    "bf16-master+tis+bf16m+ckpt+comp": ("bf16-autocast", "tis", True, "adamw-bf16", True,
                                        "bfloat16+comp"),
}
KNOWN = VARIANTS | MORE_VARIANTS


def _phase(peaks: dict[str, dict[str, float]], name: str):
    """Context measuring the process's peak resident set during one phase into `peaks`."""
    import contextlib

    @contextlib.contextmanager
    def measure():
        trim_heap()
        with rss_peak() as start:
            pass
        with rss_peak() as peak:
            yield
        peaks[name] = {"peak_rss_mb": max(peaks.get(name, {}).get("peak_rss_mb", 0.0),
                                          peak["mb"]),
                       "added_rss_mb": max(peaks.get(name, {}).get("added_rss_mb", 0.0),
                                           peak["mb"] - start["mb"])}
    return measure()


def long_prompts(pairs, prompt_tokens: int):
    """Each prompt made `prompt_tokens` long: filler tokens (the batch's prompts, over and
    over) before its own."""
    filler: list[int] = []
    while len(filler) < prompt_tokens:
        filler += [t for _, ids in pairs for t in ids]
    return [(sample, filler[: max(prompt_tokens - len(ids), 0)] + list(ids))
            for sample, ids in pairs]


def _batch(policy, pairs, n: int, max_tokens: int, seed: int, peaks: dict,
           ignore_eos: bool = False):
    from rollwise.engine import NativeEngine, SamplingParams
    from rollwise.learner.batch import collate
    from rollwise.rewards.verifiers import final_number
    from rollwise.types import Trajectory

    with _phase(peaks, "rollout"):
        engine = NativeEngine(policy.model, eos_token_ids=policy.stop_ids)
        outs = engine.generate([ids for _, ids in pairs], SamplingParams(
            n=n, temperature=0.7, max_tokens=max_tokens, seed=seed, ignore_eos=ignore_eos))
        del engine
    with _phase(peaks, "reward"):
        trajs = [Trajectory(sample=pairs[c.prompt_index][0],
                            prompt_ids=list(pairs[c.prompt_index][1]), response_ids=c.token_ids,
                            logprobs=c.logprobs, versions=c.versions,
                            finish_reason=c.finish_reason) for c in outs]
        rewards = [final_number(policy.decode(t.response_ids), t.sample) for t in trajs]
    gen = torch.Generator().manual_seed(seed)
    adv = torch.randn(len(trajs), generator=gen)  # every row non-zero: all rows train
    return collate(trajs, adv, torch.arange(len(trajs)) // n,
                   pad_id=policy.tokenizer.pad_token_id), sum(rewards) / len(rewards)


def _learner(net, v: str):
    from rollwise.algos import corrections, policy_losses
    from rollwise.learner import Learner

    precision, correction, share, optimizer, ckpt, master = KNOWN[v]
    master, _, comp = master.partition("+")
    return Learner(net, loss_fn=policy_losses["ppo"],
                   loss_options={"aggregation": "token-mean"}, lr=1e-5,
                   precision=precision, skip_zero_advantage=False,
                   share_prompts=share, optimizer=optimizer,
                   activation_checkpointing=ckpt, master_dtype=master,
                   master_rounding="compensated" if comp else "stochastic",
                   correction_fn=None if correction == "none" else corrections[
                       correction], correction_options={"cap": 2.0})


def run(model: str = "smollm2-135m", *, prompts: int = 4, n: int = 8, max_tokens: int = 64,
        reps: int = 3, variants: tuple[str, ...] = tuple(VARIANTS), seed: int = 0,
        device: str = "cpu", prompt_tokens: int = 0, flops: bool = True,
        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    from rollwise.bench.common import count_flops
    from rollwise.learner.memory import disable_checkpointing

    policy, pairs = load_workload(model, prompts, seed, device, split="pairs")
    if prompt_tokens:
        pairs = long_prompts(pairs, prompt_tokens)
    peaks: dict[str, dict[str, float]] = {}
    # long prompts of filler: the model would stop at once; the workload's responses are
    # max_tokens long
    batch, reward = _batch(policy, pairs, n, max_tokens, seed, peaks,
                           ignore_eos=bool(prompt_tokens))
    models = {"float32": policy.model}
    if any(KNOWN[v][5].startswith("bfloat16") for v in variants):
        import copy

        models["bfloat16"] = copy.deepcopy(policy.model).to(torch.bfloat16)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for rep in range(reps):
        order = list(variants[rep % len(variants):] + variants[: rep % len(variants)])
        for v in order:
            ckpt, net = KNOWN[v][4], models[KNOWN[v][5].partition("+")[0]]
            learner = _learner(net, v)
            with _phase(peaks, f"learner {v}"):
                synchronize(device)
                start = time.perf_counter()
                learner.update(batch)
                synchronize(device)
                times[v].append(time.perf_counter() - start)
                del learner
            if ckpt:  # the model is shared by every variant
                disable_checkpointing(net)
            if progress:
                progress(f"rep {rep + 1}/{reps} {v}: {times[v][-1]:.2f}s")
    counted: dict[str, int] = {}
    for v in variants if flops else ():
        net = models[KNOWN[v][5].partition("+")[0]]
        learner = _learner(net, v)
        counted[v] = count_flops(lambda learner=learner: learner.update(batch))[1]
        if KNOWN[v][4]:
            disable_checkpointing(net)
        del learner
    first = variants[0]
    rows = [{"variant": v, "update_s": median(t), "min_s": min(t), "max_s": max(t),
             # per repetition: the first variant's time over this one's, then the median
             f"speedup_vs_{first}": median([a / b for a, b in zip(times[first], t)])}
            | ({"gflop": counted[v] / 1e9, f"flop_ratio_vs_{first}": counted[first] / counted[v]}
               if counted else {}) | peaks[f"learner {v}"]
            for v, t in times.items()]
    phases = [{"phase": k, **m} for k, m in peaks.items() if not k.startswith("learner ")]
    return {"benchmark": "learner precision", "model": model, "rows": batch.num_rows,
            "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
            "tokens": int(batch.attention_mask.sum()),
            "response_tokens": int(batch.loss_mask.sum()), "reps": reps,
            "threads": torch.get_num_threads(), "device": device, "variants": rows,
            "phases": phases, "reward_mean": reward, "per_rep": times}


def command(*, model: str, json: Path | None, reps: int, threads: int, variant: list[str] | None,
            device: str, prompt_tokens: int = 0, max_tokens: int = 64, flops: bool = True,
            prompts: int = 4) -> None:
    """`rollwise bench learner`: run it, print the tables, write `json` (and its page)."""
    from rollwise.compose.preflight import require_device
    from rollwise.system.runtime import configure

    require_device(device)
    configure(threads)
    variants = tuple(variant or (LONG_VARIANTS if prompt_tokens else VARIANTS))
    bad = [v for v in variants if v not in KNOWN]
    if bad:
        raise typer.BadParameter(f"unknown variant(s) {bad}; known: {', '.join(KNOWN)}")
    data = run(model, prompts=prompts, reps=reps, variants=variants, device=device,
               progress=say, prompt_tokens=prompt_tokens, max_tokens=max_tokens, flops=flops)
    print_table(f"learner update: {model}, {data['rows']} rows, {data['tokens']} tokens, "
                f"{data['threads']} threads", data["variants"],
                ["variant", "update_s", "min_s", "max_s", f"speedup_vs_{variants[0]}",
                 *(["gflop", f"flop_ratio_vs_{variants[0]}"] if flops else []),
                 "peak_rss_mb", "added_rss_mb"])
    print_table("peak resident set per phase (MiB)", data["phases"],
                ["phase", "peak_rss_mb", "added_rss_mb"])
    save_results(data, json)
