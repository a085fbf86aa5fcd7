"""B2, the long tail: rollout strategies on the same prompts and seeds.

Default workload: the tiny model warm-started on ArithChain (number of terms heavy-tailed,
so response lengths are long-tailed across prompts and similar within a group); with
`--model smollm2-135m`, two-digit addition at that model's natural lengths. Each strategy
gets a fresh engine (same weights, same slot count) and runs the same steps; the policy
version is bumped after every step so staleness is measured as in training. `spec-reuse`
is measured on a second epoch of the same prompts, after a first epoch that records the
responses; `continuous` is measured on that second epoch too as its reference.
"""

from __future__ import annotations

from typing import Any

import torch

from rollwise.bench.common import load_workload, median
from rollwise.engine import NativeEngine, SamplingParams
from rollwise.rollout.scheduler import RolloutScheduler

STRATEGIES = ("sync", "continuous", "partial", "context", "partial+context", "spec-group",
              "spec-reuse", "spec-reuse-specrl")


def _scheduler(policy, name: str, params: SamplingParams, slots: int, seed: int,
               chunk: int) -> RolloutScheduler:
    engine = NativeEngine(policy.model, eos_token_ids=policy.stop_ids, max_num_seqs=slots)
    base = {"spec-group": "continuous", "spec-reuse": "continuous",
            "spec-reuse-specrl": "continuous", "continuous-epoch2": "continuous"}.get(name, name)
    return RolloutScheduler(
        engine, params, strategy=base, chunk_tokens=chunk, seed=seed,
        spec_group=name == "spec-group", spec_reuse=name.startswith("spec-reuse"),
        reuse_rule="spec-rl" if name == "spec-reuse-specrl" else "exact")


def _run_steps(sched: RolloutScheduler, prompts: list, steps: int, per_step: int) -> list[dict]:
    cursor = steps * per_step  # over-provisioned groups come from beyond the measured steps

    def fetch(k: int) -> list:
        nonlocal cursor
        out = prompts[cursor: cursor + k]
        cursor += k
        return out

    infos = []
    for i in range(steps):
        report = sched.run(prompts[i * per_step: (i + 1) * per_step], fetch)
        infos.append(report.info)
        sched.publish(sched.version + 1)
    return infos


def _measure(policy, name: str, prompts: list, params: SamplingParams, steps: int,
             per_step: int, slots: int, seed: int, chunk: int) -> dict[str, Any]:
    sched = _scheduler(policy, name, params, slots, seed, chunk)
    if name.startswith("spec-reuse") or name == "continuous-epoch2":
        if name == "continuous-epoch2":
            sched.spec_reuse = False
        _run_steps(sched, prompts, steps, per_step)  # epoch 1 records the responses
        sched.seed = seed + 1  # epoch 2 samples afresh
    infos = _run_steps(sched, prompts, steps, per_step)
    gen = sum(i["generated_tokens"] for i in infos)
    span = sum(i["makespan_s"] for i in infos)
    verifies = sum(i["spec_verifies"] for i in infos)
    lengths = [n for i in infos for n in i["lengths"]]
    return {
        "strategy": name, "tokens_per_s": gen / span, "makespan_s": span / steps,
        "tail_time_s": sum(i["tail_time_s"] for i in infos) / steps,
        "forward_passes": sum(i["forward_passes"] for i in infos), "generated_tokens": gen,
        "forward_passes_per_token": sum(i["forward_passes"] for i in infos) / max(gen, 1),
        "row_forwards_per_token": sum(i["row_forwards"] for i in infos) / max(gen, 1),
        "mean_accepted_len": (1 + sum(i["spec_accepted"] for i in infos) / verifies
                              if verifies else None),
        "offpolicy_token_frac": sum(i["offpolicy_token_frac"] * i["trained_tokens"]
                                    for i in infos) / max(1, sum(i["trained_tokens"]
                                                                  for i in infos)),
        "staleness_max": max(i["staleness_max"] for i in infos),
        "stale_dropped": sum(i["stale_dropped"] for i in infos),
        "trained_groups": len(lengths) // params.n,
        "mean_trained_len": sum(lengths) / max(len(lengths), 1),
        "length_hist": _hist(lengths, params.max_tokens)}


def _hist(lengths: list[int], max_tokens: int, bins: int = 8) -> list[int]:
    width = max(1, -(-max_tokens // bins))
    out = [0] * bins
    for n in lengths:
        out[min(bins - 1, n // width)] += 1
    return out


def run(model: str = "tiny", *, groups: int = 32, n: int = 8, steps: int = 3, slots: int = 64,
        max_tokens: int | None = None, chunk_tokens: int = 16, reps: int = 1, seed: int = 0,
        strategies: tuple[str, ...] = STRATEGIES, progress=None) -> dict[str, Any]:
    tiny = model == "tiny"
    want = groups * steps * 3
    if tiny:
        policy, prompts = load_workload("tiny", want, seed, task="arith_chain", split="pairs",
                                        p=0.12, max_terms=48)
    else:
        policy, prompts = load_workload(model, want, seed, split="pairs")
    max_tokens = max_tokens or (192 if tiny else 256)
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens)
    names = list(strategies) + (["continuous-epoch2"] if any(
        s.startswith("spec-reuse") for s in strategies) else [])
    runs: dict[str, list[dict]] = {s: [] for s in names}
    for rep in range(reps):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            with torch.random.fork_rng():
                row = _measure(policy, name, prompts, params, steps, groups, slots,
                               seed + rep, chunk_tokens)
            runs[name].append(row)
            if progress:
                progress(f"rep {rep + 1}/{reps} {name}: {row['tokens_per_s']:.0f} tok/s, "
                         f"makespan {row['makespan_s']:.2f}s, tail {row['tail_time_s']:.2f}s")
    rows = [_median_row(runs[s]) for s in names]
    base = {r["strategy"]: r for r in rows}
    sync = base.get("sync")
    for r in rows:
        if sync:
            r["tail_vs_sync"] = r["tail_time_s"] / max(sync["tail_time_s"], 1e-9)
            r["tokens_per_s_vs_sync"] = r["tokens_per_s"] / sync["tokens_per_s"]
    ref = base.get("continuous-epoch2")
    for r in rows:
        if ref and r["strategy"].startswith("spec-reuse"):
            r["row_forwards_per_token_vs_continuous"] = (
                r["row_forwards_per_token"] / ref["row_forwards_per_token"])
            r["forward_passes_per_token_vs_continuous"] = (
                r["forward_passes_per_token"] / ref["forward_passes_per_token"])
    return {"benchmark": "tail", "model": model, "groups_per_step": groups, "group_size": n,
            "steps": steps, "slots": slots, "max_tokens": max_tokens,
            "chunk_tokens": chunk_tokens, "reps": reps, "threads": torch.get_num_threads(),
            "strategies": rows}


def _median_row(rows: list[dict]) -> dict:
    out = dict(rows[0])
    for k, v in rows[0].items():
        if isinstance(v, float) and len(rows) > 1:
            out[k] = median([r[k] for r in rows if r[k] is not None])
    return replace_none(out)


def replace_none(row: dict) -> dict:
    return {k: v for k, v in row.items() if v is not None}
