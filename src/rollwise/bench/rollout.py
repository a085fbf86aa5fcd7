"""B1, rollout throughput: the native engine against Hugging Face `generate` on the same
prompts and sampling parameters, in the same process, alternating, with median ratios.

Workloads: `natural` (16 prompts x 8 samples, temperature 1, stop at EOS,
max 256 tokens) and `fixed` (64 sequences x 64 tokens, EOS ignored: a clean tokens/s and
the roofline fraction against the measured matrix-multiply peak of the same dtype).

The precision axis: one native engine per dtype (`dtypes`: float32, bfloat16, int8, or
`auto`, which is resolved to what training would pick on this machine), all against float32
`generate` and against the float32 native engine when it is among them, alternating in the
same process; `publish_seconds` is the time of one weight conversion from the float32 master
copy (0 for float32: weights in place). int8's roofline is against the int8 product's peak
(GOP/s) and its log-prob check against the float32 model (the mismatch TIS corrects).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import typer

from rollwise.bench.common import (
    dispatches_per_call,
    load_workload,
    matmul_peak_gflops,
    median,
    percentile,
    print_table,
    save_results,
    say,
)
from rollwise.engine import NativeEngine, SamplingParams
from rollwise.engine.hf import HFEngine


def _run_native(engine: NativeEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    before = replace(engine.stats)
    start = time.perf_counter()
    latencies = []
    tokens = 0
    for i, p in enumerate(prompts):
        for k in range(params.n):
            engine.submit(p, replace(params, n=1), seed=params.seed * 1000 + i * params.n + k,
                          tag=i)
    while engine.has_unfinished():
        for c in engine.step():
            latencies.append(time.perf_counter() - start)
            tokens += len(c.token_ids)
    wall = time.perf_counter() - start
    s = engine.stats
    decode_tokens = s.decode_tokens - before.decode_tokens
    decode_passes = s.decode_passes - before.decode_passes
    return {"wall_s": wall, "generated_tokens": tokens,
            "forward_passes": s.forward_passes - before.forward_passes,
            "latencies": latencies, "slot_waste": 0.0,
            "processed_tokens": decode_tokens + (s.prefill_tokens - before.prefill_tokens)
            + (s.recompute_tokens - before.recompute_tokens),
            "decode_tokens": decode_tokens, "decode_passes": decode_passes,
            "decode_s": s.decode_seconds - before.decode_seconds}


def _run_hf(engine: HFEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """`generate` in batches of engine.batch_size sequences, each batch timed."""
    per_call = max(1, engine.batch_size // params.n)
    start = time.perf_counter()
    latencies, tokens, slots, passes = [], 0, 0, engine.forward_passes
    for i in range(0, len(prompts), per_call):
        outs = engine.generate(prompts[i: i + per_call], params)
        done = time.perf_counter() - start
        lengths = [len(c.token_ids) for c in outs]
        latencies += [done] * len(outs)
        tokens += sum(lengths)
        slots += len(outs) * max(lengths)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "generated_tokens": tokens,
            "forward_passes": engine.forward_passes - passes, "latencies": latencies,
            "slot_waste": 1 - tokens / max(slots, 1),
            "processed_tokens": tokens + sum(len(p) for p in prompts) * params.n}


def _summarise(name: str, workload: str, runs: list[dict], params_count: int,
               peak: float) -> dict[str, Any]:
    tps = [r["generated_tokens"] / r["wall_s"] for r in runs]
    lat = [x for r in runs for x in r["latencies"]]
    row = {"workload": workload, "engine": name, "tokens_per_s": median(tps),
           "wall_s": median([r["wall_s"] for r in runs]),
           "generated_tokens": runs[0]["generated_tokens"],
           "forward_passes": runs[0]["forward_passes"],
           "latency_p50_s": percentile(lat, 0.5), "latency_p99_s": percentile(lat, 0.99),
           "slot_waste": median([r["slot_waste"] for r in runs]),
           "roofline": median([2 * params_count * r["processed_tokens"] / r["wall_s"] / 1e9
                               for r in runs]) / peak}
    if runs[0].get("decode_passes"):
        row["decode_step_ms"] = median([1e3 * r["decode_s"] / r["decode_passes"] for r in runs])
    if "decode_s" in runs[0]:
        row["decode_roofline"] = median([2 * params_count * r["decode_tokens"] / r["decode_s"]
                                         / 1e9 for r in runs]) / peak
    return row


def _decode_dispatches(engine: NativeEngine, prompts: list[list[int]],
                       params: SamplingParams, steps: int = 4) -> tuple[float, str, float]:
    """Kernels (GPU) or aten ops (CPU) dispatched per decode step, from the profiler, with
    every row decoding (after two warm-up steps: admission, prefill, graph capture), and
    the GPU's busy fraction over those steps (NaN on a CPU)."""
    ids = [engine.submit(p, replace(params, n=1, max_tokens=steps + 4), seed=i, tag=i)
           for i, p in enumerate(prompts) for _ in range(params.n)]
    engine.step()
    engine.step()
    count = dispatches_per_call(engine.step, steps, engine.decoder.device)
    for rid in ids:
        if rid in engine.admission.requests:
            engine.abort(rid)
    return count


def _checks(policy, engines: dict[str, NativeEngine], hf: HFEngine,
            prompts: list[list[int]]) -> dict:
    """Per engine dtype: greedy identity with float32 `generate`, and sampled log-probs
    against a full forward pass of the model at the same precision (mean and max error)."""
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=48)
    want = hf.generate(prompts, greedy)
    out: dict[str, Any] = {"greedy_prompts": len(prompts)}
    for dtype, engine in engines.items():
        got = engine.generate(prompts, greedy)
        out[f"greedy_identical_{dtype}"] = sum(
            x.token_ids == y.token_ids for x, y in zip(want, got)) / len(prompts)
        sampled = engine.generate(prompts[:4], SamplingParams(n=2, temperature=1.0,
                                                              max_tokens=48, seed=1))
        model = policy.model
        if dtype not in ("int8", str(next(model.parameters()).dtype).split(".")[-1]):
            model = copy.deepcopy(model).to(getattr(torch, dtype))
        errs = []
        with torch.no_grad():
            for c in sampled:
                p = prompts[c.prompt_index]
                ids = torch.tensor([p + c.token_ids], device=policy.device)
                logits = model(input_ids=ids).logits[0, len(p) - 1: -1].float()
                ref = torch.log_softmax(logits, -1).gather(
                    -1, torch.tensor(c.token_ids, device=ids.device)[:, None])[:, 0].cpu()
                errs.append((ref - torch.tensor(c.logprobs)).abs())
        err = torch.cat(errs)
        out[f"max_logprob_error_{dtype}"] = float(err.max())
        out[f"mean_logprob_error_{dtype}"] = float(err.mean())
    # the first dtype under the historical names (B1's float32 checks)
    first = next(iter(engines))
    out["greedy_identical"] = out[f"greedy_identical_{first}"]
    out["max_logprob_error"] = out[f"max_logprob_error_{first}"]
    return out


def run(model: str = "tiny", *, prompts: int = 16, n: int = 8, max_tokens: int = 256,
        fixed_batch: int = 64, fixed_tokens: int = 64, reps: int = 3,
        dtypes: tuple[str, ...] = ("float32",), hf_batch: int = 64, device: str = "cpu",
        seed: int = 0, workloads: tuple[str, ...] = ("natural", "fixed"),
        step_modes: tuple[str, ...] = ("auto",), baseline: bool = True,
        progress=None) -> dict[str, Any]:
    """Each native engine dtype (the precision axis) and decode step mode (engine/step.py)
    against float32 `generate`; sides alternate within a repetition (the first rotates);
    every roofline is against the matrix-multiply peak of its own dtype, measured in this
    run. Beside tokens/s: the decode step's time and its kernels (GPU) or aten ops (CPU)
    per step, counted by the profiler on the fixed workload's batch. `baseline` False
    leaves `generate` out of the timed sides (it is still the greedy reference)."""
    policy, ids = load_workload(model, max(prompts, fixed_batch), seed, device)
    auto = None
    if "auto" in dtypes:  # what training would pick here (rollwise.compose.precision)
        from rollwise.compose.precision import ModelShapes, resolve

        auto = resolve("auto", "float32", "none", shapes=ModelShapes.of(policy.model),
                       device=device).rollout
        dtypes = tuple(dict.fromkeys(auto if d == "auto" else d for d in dtypes))
    natives = _native_engines(policy, dtypes, step_modes, device, max(prompts * n, fixed_batch))
    hf = HFEngine(policy.model, pad_token_id=policy.tokenizer.pad_token_id,
                  eos_token_ids=policy.stop_ids, batch_size=hf_batch)
    params_count = sum(p.numel() for p in policy.model.parameters())
    specs = {  # the natural workload: its prompts, EOS ends; the fixed one: exact lengths
        "natural": (ids[:prompts], SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens,
                                                  seed=seed)),
        "fixed": (ids[: max(1, fixed_batch // n)],
                  SamplingParams(n=n, temperature=1.0, max_tokens=fixed_tokens,
                                 ignore_eos=True, seed=seed))}
    peaks = {d: matmul_peak_gflops(getattr(torch, d), device=device)
             for d in dict.fromkeys(("float32", *dtypes))}
    for _, _, engine in natives.values():  # untimed: graph capture, compilation, caches
        prompt_ids, params = specs[workloads[0]]
        engine.generate(prompt_ids, replace(params, max_tokens=min(params.max_tokens, 8)))
    sides = ["hf", *natives] if baseline else list(natives)
    rows, ratios = [], []
    for w in workloads:
        prompt_ids, params = specs[w]
        engines = {"hf": hf} | {side: e for side, (_, _, e) in natives.items()}
        runs = _alternate(engines, sides, prompt_ids, params, reps, seed,
                          lambda msg, w=w: progress and progress(f"{w} {msg}"))
        if baseline:
            rows.append(_summarise("hf", w, runs["hf"], params_count, peaks["float32"]))
        for side, (d, _m, engine) in natives.items():
            row = _summarise(side, w, runs[side], params_count, peaks[d]) | {
                "dtype": d, "step_mode": engine.decode_step.mode}
            if w == "fixed":
                row |= _dispatch_figures(engine, *specs["fixed"])
            rows.append(row)
            ratios.append({"workload": w} | _side_ratios(side, natives, runs, baseline))
    by_dtype = {d: e for _, (d, _, e) in reversed(natives.items())}  # first mode of each
    return {"benchmark": "rollout", "model": model, "dtypes": list(dtypes), "device": device,
            "auto_dtype": auto, "step_modes": list(step_modes),
            "threads": torch.get_num_threads(), "parameters": params_count, "reps": reps,
            "matmul_peak_gflops": peaks, "results": rows, "ratios": ratios,
            "publish_seconds": {d: e.decoder.refresh() for d, e in by_dtype.items()},
            "checks": _checks(policy, by_dtype, hf, ids[:8])}



def _dispatch_figures(engine: NativeEngine, prompt_ids, params: SamplingParams) -> dict:
    """The decode step's kernels (GPU) or aten ops (CPU) per step, and the GPU's busy
    fraction where it was measured."""
    count, what, busy = _decode_dispatches(engine, prompt_ids, params)
    row = {"dispatches_per_step": count, "dispatches": what}
    if not math.isnan(busy):  # measured (GPU)
        row["device_busy_frac"] = busy
    return row


def _native_engines(policy, dtypes: tuple[str, ...], step_modes: tuple[str, ...], device: str,
                    max_num_seqs: int) -> dict[str, tuple[str, str, NativeEngine]]:
    """One native engine per dtype and step mode: side name -> (dtype, mode, engine)."""
    natives = {}
    for d in dtypes:
        for m in step_modes:
            side = f"native-{d}" if len(step_modes) == 1 else f"native-{d}-{m}"
            natives[side] = (d, m, NativeEngine(
                policy.model, dtype=getattr(torch, d), device=device, step_mode=m,
                eos_token_ids=policy.stop_ids, max_num_seqs=max_num_seqs))
    return natives

def _alternate(engines: dict, sides: list[str], prompt_ids, params: SamplingParams, reps: int,
               seed: int, progress) -> dict[str, list[dict]]:
    """Each side's results over `reps` repetitions, sides alternating (the first rotates)."""
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for rep in range(reps):
        for side in sides[rep % len(sides):] + sides[: rep % len(sides)]:
            run_side = _run_hf if side == "hf" else _run_native
            result = run_side(engines[side], prompt_ids, replace(params, seed=seed + rep))
            runs[side].append(result)
            progress(f"rep {rep + 1}/{reps} {side}: "
                     f"{result['generated_tokens'] / result['wall_s']:.0f} tok/s")
    return runs


def _side_ratios(side: str, natives: dict, runs: dict, baseline: bool) -> dict:
    """A native side's median tokens/s ratios: over `generate`, over the float32 side of
    the same step mode, and over the first step mode of the same dtype."""
    d, m, _ = natives[side]
    out = {"engine": side, "dtype": d, "step_mode": m}
    if baseline:
        out |= _ratio(runs["hf"], runs[side], "native_over_hf_tokens_per_s", "per_rep")
    base32 = next((s for s, (d2, m2, _) in natives.items() if d2 == "float32" and m2 == m),
                  None)
    if base32 and d != "float32":
        out |= _ratio(runs[base32], runs[side], "over_native_float32",
                      "over_native_float32_per_rep")
    first = next(s for s, (d2, _, _) in natives.items() if d2 == d)
    if first != side:
        mode = natives[first][1]
        out |= _ratio(runs[first], runs[side], f"over_{mode}_mode", f"over_{mode}_mode_per_rep")
    return out


def _ratio(base: list[dict], side: list[dict], name: str, per_rep_name: str) -> dict:
    """Median over repetitions of side tokens/s over base tokens/s (same repetition)."""
    per_rep = [(b["generated_tokens"] / b["wall_s"]) / (a["generated_tokens"] / a["wall_s"])
               for a, b in zip(base, side)]
    return {name: median(per_rep), per_rep_name: per_rep}


def command(*, model: str, json: Path | None, prompts: int, n: int, max_tokens: int,
            fixed_batch: int, fixed_tokens: int, reps: int, dtype: list[str] | None,
            workload: list[str] | None, device: str, step_mode: list[str] | None, baseline: bool,
            threads: int) -> None:
    """`rollwise bench rollout`: run it, print the tables, write `json` (and its page)."""
    from rollwise.compose.preflight import require_device
    from rollwise.system.runtime import configure

    require_device(device)
    configure(threads)
    data = run(model, prompts=prompts, n=n, max_tokens=max_tokens, fixed_batch=fixed_batch,
               fixed_tokens=fixed_tokens, reps=reps, dtypes=tuple(dtype or ("float32",)),
               device=device, step_modes=tuple(step_mode or ("auto",)), baseline=baseline,
               workloads=tuple(workload or ("natural", "fixed")), progress=say)
    print_table(f"B1 rollout throughput: {model}, {data['threads']} threads", data["results"],
                ["workload", "engine", "tokens_per_s", "wall_s", "generated_tokens",
                 "forward_passes", "decode_step_ms", "dispatches_per_step", "latency_p50_s",
                 "latency_p99_s", "slot_waste", "roofline", "decode_roofline"])
    if data.get("auto_dtype"):
        typer.echo(f"auto = {data['auto_dtype']} on this machine")
    for r in data["results"]:
        if r.get("dispatches"):
            busy = (f"; GPU busy {r['device_busy_frac']:.0%}" if "device_busy_frac" in r
                    else "")
            typer.echo(f"{r['engine']}: {r['dispatches_per_step']:.0f} {r['dispatches']} per "
                       f"decode step at batch {fixed_batch}; {r['decode_step_ms']:.2f} ms a "
                       f"step{busy}")
    for r in data["ratios"]:
        vs32 = (f"; / native float32 = {r['over_native_float32']:.2f}x"
                if "over_native_float32" in r else "")
        vs32 += "".join(f"; / {k[5:-5]} mode = {v:.2f}x" for k, v in r.items()
                        if k.startswith("over_") and k.endswith("_mode"))
        vs_hf = (f" / hf tokens/s = {r['native_over_hf_tokens_per_s']:.2f}x"
                 if "native_over_hf_tokens_per_s" in r else "")
        typer.echo(f"{r['workload']}: {r['engine']}{vs_hf}{vs32} (median of {reps})")
    c = data["checks"]
    for d in data["dtypes"]:
        typer.echo(f"checks {d}: greedy identical to float32 generate on "
                   f"{c[f'greedy_identical_{d}']:.0%} of {c['greedy_prompts']} prompts; |log-prob "
                   f"error| vs a {'float32' if d == 'int8' else d} forward: "
                   f"max {c[f'max_logprob_error_{d}']:.2e}, mean "
                   f"{c[f'mean_logprob_error_{d}']:.2e}; publish {data['publish_seconds'][d]:.3f}s")
    save_results(data, json)
