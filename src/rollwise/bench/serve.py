"""`rollwise bench serve`: the OpenAI-compatible server against the engine's own `generate`.

The same prompts go through both sides in one process, alternating: the engine's
`generate` (every prompt submitted at once), and C threads each with its own `openai`
client sending one prompt at a time to the live server (token-id prompts, so both sides
decode the same ids). Reported: requests/s and tokens/s per side, the median per-repetition
ratio server / engine, and the deterministic counters (tokens, forward passes, rows per
forward pass). With `ignore_eos` (the default) both sides generate exactly max_tokens per
prompt, so the work is identical and the ratio is the server's overhead plus its smaller
batches (at most C sequences in flight).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import typer

from rollwise.bench.common import load_workload, median, print_table, save_results, say


def _server_side(url: str, name: str, prompts: list[list[int]], clients: int, max_tokens: int,
                 seed: int, ignore_eos: bool) -> tuple[float, int, list[str]]:
    """(wall seconds, tokens, errors) for `prompts` sent by `clients` concurrent clients."""
    import openai

    todo: queue.SimpleQueue = queue.SimpleQueue()
    for i, p in enumerate(prompts):
        todo.put((i, p))
    tokens, errors, lock = [0], [], threading.Lock()
    conns = [openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
             for _ in range(clients)]
    start_line = threading.Barrier(clients + 1)

    def work(client):
        start_line.wait()
        while True:
            try:
                i, p = todo.get_nowait()
            except queue.Empty:
                return
            try:
                r = client.completions.create(model=name, prompt=p, max_tokens=max_tokens,
                                              temperature=1.0, seed=seed + i,
                                              extra_body={"ignore_eos": ignore_eos})
                with lock:
                    tokens[0] += len(r.choices[0].token_ids)
            except Exception as e:  # noqa: BLE001 - counted and reported
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    start_line.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - start, tokens[0], errors


def run(model: str, *, prompts: int = 32, clients: tuple[int, ...] = (8, 32),
        max_tokens: int = 64, reps: int = 3, ignore_eos: bool = True, seed: int = 0,
        device: str = "cpu", progress: Callable[[str], None] = lambda s: None) -> dict:
    from rollwise.engine import NativeEngine, SamplingParams
    from rollwise.serve import RolloutServer

    policy, ids = load_workload(model, prompts, seed=seed, device=device)
    batch = max(max(clients), prompts)
    engine = NativeEngine(policy.model, eos_token_ids=policy.stop_ids, max_num_seqs=batch)
    reference = NativeEngine(policy.model, eos_token_ids=policy.stop_ids, max_num_seqs=batch,
                             weights_from=engine)
    server = RolloutServer(policy, engine, name=model)
    url = server.start()
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    try:
        _server_side(url, model, ids[:2], 2, 4, seed, ignore_eos)  # warm both paths up
        reference.generate(ids[:2], SamplingParams(max_tokens=4, seed=seed))
        rows, per_rep = [], {c: [] for c in clients}
        for rep in range(reps):
            s = reference.stats
            before = (s.forward_passes, s.row_forwards)
            start = time.perf_counter()
            outs = reference.generate(ids, SamplingParams(**{**params.__dict__,
                                                             "seed": seed + rep}))
            wall = time.perf_counter() - start
            eng = _row("engine", 0, rep, wall, len(ids), sum(len(o.token_ids) for o in outs),
                       s.forward_passes - before[0], s.row_forwards - before[1], [])
            rows.append(eng)
            progress(f"rep {rep}: engine {eng['tokens_per_s']:.0f} tokens/s")
            for c in clients:
                s = engine.stats
                before = (s.forward_passes, s.row_forwards)
                wall, toks, errors = _server_side(url, model, ids, c, max_tokens, seed + rep,
                                                  ignore_eos)
                srv = _row("server", c, rep, wall, len(ids), toks,
                           s.forward_passes - before[0], s.row_forwards - before[1], errors)
                rows.append(srv)
                per_rep[c].append(srv["tokens_per_s"] / eng["tokens_per_s"])
                progress(f"rep {rep}: server, {c} clients, {srv['tokens_per_s']:.0f} tokens/s"
                         f" ({len(errors)} errors)")
    finally:
        server.stop()
    summary = []
    for side, c in [("engine", 0)] + [("server", c) for c in clients]:
        mine = [r for r in rows if r["side"] == side and r["clients"] == c]
        summary.append({k: (median([r[k] for r in mine]) if isinstance(mine[0][k], float)
                            else mine[0][k]) for k in mine[0] if k not in ("rep", "errors")}
                       | {"errors": sum(len(r["errors"]) for r in mine)})
    ratios = [{"clients": c, "server_over_engine_tokens_per_s": median(v), "per_rep": v}
              for c, v in per_rep.items()]
    return {"model": model, "threads": torch.get_num_threads(), "device": device,
            "prompts": prompts,
            "max_tokens": max_tokens, "ignore_eos": ignore_eos, "reps": reps,
            "results": summary, "ratios": ratios, "per_rep": rows}


def _row(side: str, clients: int, rep: int, wall: float, requests: int, tokens: int,
         passes: int, row_forwards: int, errors: list[str]) -> dict:
    return {"side": side, "clients": clients, "rep": rep, "wall_s": wall,
            "requests_per_s": requests / wall, "tokens_per_s": tokens / wall,
            "tokens": tokens, "forward_passes": passes,
            "rows_per_pass": row_forwards / passes if passes else 0.0, "errors": errors}


def command(*, model: str, json: Path | None, prompts: int, clients: list[int] | None,
            max_tokens: int, reps: int, natural: bool, device: str, threads: int) -> None:
    """`rollwise bench serve`: run it, print the tables, write `json` (and its page)."""
    from rollwise.compose.preflight import require_device
    from rollwise.system.runtime import configure

    require_device(device)
    configure(threads)
    data = run(model, prompts=prompts, clients=tuple(clients or (8, 32)),
               max_tokens=max_tokens, reps=reps, ignore_eos=not natural, device=device,
               progress=say)
    print_table(f"serve: {model}, {prompts} prompts x {max_tokens} tokens, "
                f"{data['threads']} threads (median of {reps})", data["results"],
                ["side", "clients", "requests_per_s", "tokens_per_s", "wall_s", "tokens",
                 "forward_passes", "rows_per_pass", "errors"])
    for r in data["ratios"]:
        typer.echo(f"{r['clients']} clients: server / engine tokens/s = "
                   f"{r['server_over_engine_tokens_per_s']:.2f}x (median of {len(r['per_rep'])})")
    save_results(data, json)
