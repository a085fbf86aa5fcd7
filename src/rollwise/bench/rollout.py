"""B1, rollout throughput: the native engine against Hugging Face `generate` on the same
prompts and sampling parameters, in the same process, alternating, with median ratios.

Workloads (BENCHMARKS.md): `natural` (16 prompts x 8 samples, temperature 1, stop at EOS,
max 256 tokens) and `fixed` (64 sequences x 64 tokens, EOS ignored: a clean tokens/s and
the roofline fraction against the measured matrix-multiply peak of the same dtype).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from rollwise.bench.common import load_workload, matmul_peak_gflops, median, percentile
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
    return {"wall_s": wall, "generated_tokens": tokens,
            "forward_passes": s.forward_passes - before.forward_passes,
            "latencies": latencies, "slot_waste": 0.0,
            "processed_tokens": decode_tokens + (s.prefill_tokens - before.prefill_tokens)
            + (s.recompute_tokens - before.recompute_tokens),
            "decode_tokens": decode_tokens,
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
    if "decode_s" in runs[0]:
        row["decode_roofline"] = median([2 * params_count * r["decode_tokens"] / r["decode_s"]
                                         / 1e9 for r in runs]) / peak
    return row


def _checks(policy, engine: NativeEngine, hf: HFEngine, prompts: list[list[int]]) -> dict:
    """Greedy identity with `generate`, and sampled log-probs against a full forward."""
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=48)
    a, b = hf.generate(prompts, greedy), engine.generate(prompts, greedy)
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b))
    sampled = engine.generate(prompts[:4], SamplingParams(n=2, temperature=1.0, max_tokens=48,
                                                          seed=1))
    err = 0.0
    model = policy.model
    with torch.no_grad():
        for c in sampled:
            p = prompts[c.prompt_index]
            ids = torch.tensor([p + c.token_ids], device=policy.device)
            logits = model(input_ids=ids).logits[0, len(p) - 1: -1].float()
            ref = torch.log_softmax(logits, -1).gather(
                -1, torch.tensor(c.token_ids, device=ids.device)[:, None])[:, 0].cpu()
            err = max(err, float((ref - torch.tensor(c.logprobs)).abs().max()))
    return {"greedy_identical": same / len(prompts), "greedy_prompts": len(prompts),
            "max_logprob_error": err}


def run(model: str = "tiny", *, prompts: int = 16, n: int = 8, max_tokens: int = 256,
        fixed_batch: int = 64, fixed_tokens: int = 64, reps: int = 3, dtype: str = "float32",
        hf_batch: int = 64, device: str = "cpu", seed: int = 0,
        workloads: tuple[str, ...] = ("natural", "fixed"), progress=None) -> dict[str, Any]:
    policy, ids = load_workload(model, max(prompts, fixed_batch), seed, device)
    torch_dtype = getattr(torch, dtype)
    native = NativeEngine(policy.model, dtype=torch_dtype, eos_token_ids=policy.stop_ids,
                          max_num_seqs=max(prompts * n, fixed_batch), device=device)
    hf = HFEngine(policy.model, pad_token_id=policy.tokenizer.pad_token_id,
                  eos_token_ids=policy.stop_ids, batch_size=hf_batch)
    params_count = sum(p.numel() for p in policy.model.parameters())
    specs = {
        "natural": (ids[:prompts], SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens,
                                                  seed=seed)),
        "fixed": (ids[: max(1, fixed_batch // n)],
                  SamplingParams(n=n, temperature=1.0, max_tokens=fixed_tokens,
                                 ignore_eos=True, seed=seed)),
    }
    peaks = {dtype: matmul_peak_gflops(torch_dtype, device=device),
             "float32": matmul_peak_gflops(torch.float32, device=device)}
    rows, ratios = [], []
    for w in workloads:
        prompt_ids, params = specs[w]
        runs: dict[str, list[dict]] = {"hf": [], "native": []}
        for rep in range(reps):
            order = ["hf", "native"] if rep % 2 == 0 else ["native", "hf"]
            for side in order:
                fn = _run_hf if side == "hf" else _run_native
                runs[side].append(fn(hf if side == "hf" else native, prompt_ids,
                                     replace(params, seed=seed + rep)))
                if progress:
                    progress(f"{w} rep {rep + 1}/{reps} {side}: "
                             f"{runs[side][-1]['generated_tokens'] / runs[side][-1]['wall_s']:.0f} tok/s")
        rows.append(_summarise("hf", w, runs["hf"], params_count, peaks["float32"]))
        rows.append(_summarise(f"native-{dtype}", w, runs["native"], params_count, peaks[dtype]))
        per_rep = [(b["generated_tokens"] / b["wall_s"]) / (a["generated_tokens"] / a["wall_s"])
                   for a, b in zip(runs["hf"], runs["native"])]
        ratios.append({"workload": w, "native_over_hf_tokens_per_s": median(per_rep),
                       "per_rep": per_rep})
    return {"benchmark": "rollout", "model": model, "dtype": dtype, "device": device,
            "threads": torch.get_num_threads(), "parameters": params_count, "reps": reps,
            "matmul_peak_gflops": peaks, "results": rows, "ratios": ratios,
            "checks": _checks(policy, native, hf, ids[:8])}
