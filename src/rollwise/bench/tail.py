"""B2, the long tail: rollout strategies on the same prompts and seeds.

Default workload: the tiny model warm-started on ArithChain (number of terms heavy-tailed,
so response lengths are long-tailed across prompts and similar within a group); with
`--model smollm2-135m`, two-digit addition at that model's natural lengths. Each strategy
gets a fresh engine (same weights, same slot count) and runs the same steps; the policy
version is bumped after every step so staleness is measured as in training. `spec-reuse`
is measured on a second epoch of the same prompts, after a first epoch that records the
responses and a few optimizer steps that change the policy as training would in between;
`continuous` is measured on that second epoch (same changed policy) as its reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rollwise.bench.common import load_workload, median, print_table, save_results, say
from rollwise.engine import NativeEngine, SamplingParams
from rollwise.models.tiny import teacher_forced_batch
from rollwise.rollout import RolloutFigures
from rollwise.rollout.scheduler import RolloutScheduler

SHIFT_STEPS, SHIFT_LR = 4, 2e-4  # the policy change between the epochs of spec-reuse
STRATEGIES = ("sync", "continuous", "partial", "context", "partial+context", "spec-group",
              "spec-reuse", "spec-reuse-coupled", "spec-reuse-specrl")


def _scheduler(policy, name: str, params: SamplingParams, slots: int, seed: int,
               chunk: int, lenience: float = 1.0) -> RolloutScheduler:
    engine = NativeEngine(policy.model, eos_token_ids=policy.stop_ids, max_num_seqs=slots)
    reuse = name.startswith("spec-reuse")
    base = "continuous" if reuse or name in ("spec-group", "continuous-epoch2") else name
    return RolloutScheduler(
        engine, params, strategy=base, chunk_tokens=chunk, seed=seed,
        spec_group=name == "spec-group", spec_reuse=reuse,
        reuse_rule={"spec-reuse-coupled": "coupled", "spec-reuse-specrl": "spec-rl"}.get(
            name, "exact"),
        lenience=lenience)


def _run_steps(sched: RolloutScheduler, prompts: list, steps: int,
               per_step: int) -> list[RolloutFigures]:
    cursor = steps * per_step  # over-provisioned groups come from beyond the measured steps

    def fetch(k: int) -> list:
        nonlocal cursor
        out = prompts[cursor: cursor + k]
        cursor += k
        return out

    infos = []
    for i in range(steps):
        report = sched.run(prompts[i * per_step: (i + 1) * per_step], fetch)
        infos.append(report.figures)
        sched.publish(sched.version + 1)
    return infos


def _measure(policy, name: str, prompts: list, params: SamplingParams, steps: int,
             per_step: int, slots: int, seed: int, chunk: int, lenience: float = 1.0,
             shift_steps: int = SHIFT_STEPS) -> dict[str, Any]:
    sched = _scheduler(policy, name, params, slots, seed, chunk, lenience)
    saved = None
    if name.startswith("spec-reuse") or name == "continuous-epoch2":
        if name == "continuous-epoch2":
            sched.spec_reuse = False
        _run_steps(sched, prompts, steps, per_step)  # epoch 1 records the responses
        sched.seed = seed + 1  # epoch 2 samples afresh
        saved = {k: v.clone() for k, v in policy.model.state_dict().items()}
        _shift_policy(policy, prompts[: steps * per_step], seed, shift_steps)  # training
        sched.publish(sched.version + 1)
    try:
        infos = _run_steps(sched, prompts, steps, per_step)
    finally:
        if saved is not None:
            policy.model.load_state_dict(saved)
    f = sum(infos, RolloutFigures())
    gen, span, lengths = f.generated_tokens, f.makespan_s, f.lengths
    return {
        "strategy": name, "tokens_per_s": gen / span, "makespan_s": span / steps,
        "tail_time_s": f.tail_time_s / steps,
        "forward_passes": f.forward_passes, "generated_tokens": gen,
        "forward_passes_per_token": f.forward_passes / max(gen, 1),
        "row_forwards_per_token": f.row_forwards / max(gen, 1),
        "mean_accepted_len": (1 + f.spec_accepted / f.spec_verifies
                              if f.spec_verifies else None),
        "offpolicy_token_frac": f.offpolicy_token_frac,
        "staleness_max": f.staleness_max, "stale_dropped": f.stale_dropped,
        "trained_groups": len(lengths) // params.n,
        "mean_trained_len": sum(lengths) / max(len(lengths), 1),
        "length_hist": _hist(lengths, params.max_tokens)}


def _shift_policy(policy, prompts: list, seed: int, steps: int = SHIFT_STEPS,
                  lr: float = SHIFT_LR) -> None:
    """Move the policy the way training would between two epochs: a few Adam steps of
    teacher-forced cross-entropy on reference solutions of the epoch's prompts."""
    tok = policy.tokenizer
    rows = [(ids, tok(s.reference, add_special_tokens=False)["input_ids"] + policy.stop_ids[:1])
            for s, ids in prompts if s.reference]
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(policy.model.parameters(), lr=lr)
    policy.model.train()
    for _ in range(steps):
        ids, labels = teacher_forced_batch(
            [rows[i] for i in torch.randint(len(rows), (16,), generator=gen).tolist()])
        loss = policy.model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    policy.model.eval()


def _hist(lengths: list[int], max_tokens: int, bins: int = 8) -> list[int]:
    width = max(1, -(-max_tokens // bins))
    out = [0] * bins
    for n in lengths:
        out[min(bins - 1, n // width)] += 1
    return out


def run(model: str = "tiny", *, groups: int = 32, n: int = 8, steps: int = 3, slots: int = 64,
        max_tokens: int | None = None, chunk_tokens: int = 16, reps: int = 1, seed: int = 0,
        strategies: tuple[str, ...] = STRATEGIES, lenience: float = 1.0,
        shift_steps: int = SHIFT_STEPS, device: str = "cpu", progress=None) -> dict[str, Any]:
    tiny = model == "tiny"
    want = groups * steps * 3
    if tiny:
        policy, prompts = load_workload("tiny", want, seed, device, task="arith_chain",
                                        split="pairs",
                                        p=0.12, max_terms=48)
    else:
        policy, prompts = load_workload(model, want, seed, device, split="pairs")
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
                               seed + rep, chunk_tokens, lenience, shift_steps)
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
            "chunk_tokens": chunk_tokens, "reps": reps,
            "epoch2_policy_shift": f"{shift_steps} Adam steps of SFT at lr {SHIFT_LR}",
            "lenience": lenience, "threads": torch.get_num_threads(), "device": device,
            "strategies": rows}


def _median_row(rows: list[dict]) -> dict:
    out = dict(rows[0])
    for k, v in rows[0].items():
        if isinstance(v, float) and len(rows) > 1:
            out[k] = median([r[k] for r in rows if r[k] is not None])
    return replace_none(out)


def replace_none(row: dict) -> dict:
    return {k: v for k, v in row.items() if v is not None}


def command(*, model: str, json: Path | None, groups: int, n: int, steps: int, slots: int,
            chunk_tokens: int, reps: int, strategy: list[str] | None, lenience: float,
            shift_steps: int, device: str, threads: int) -> None:
    """`rollwise bench tail`: run it, print the tables, write `json` (and its page)."""
    from rollwise.compose.preflight import require_device
    from rollwise.system.runtime import configure

    require_device(device)
    configure(threads)
    data = run(model, groups=groups, n=n, steps=steps, slots=slots,
               chunk_tokens=chunk_tokens, reps=reps,
               strategies=tuple(strategy or STRATEGIES), lenience=lenience,
               shift_steps=shift_steps, device=device, progress=say)
    print_table(f"B2 long tail: {model}, {groups} groups x {n} per step, {slots} slots",
                data["strategies"],
                ["strategy", "tokens_per_s", "makespan_s", "tail_time_s", "tail_vs_sync",
                 "tokens_per_s_vs_sync", "forward_passes_per_token", "row_forwards_per_token",
                 "mean_accepted_len", "offpolicy_token_frac", "mean_trained_len"])
    save_results(data, json)
