"""`rollwise bench sync`: where the time of one weight sync to a `rollwise serve` process
goes (`engine.name = "remote"`, docs/remote.md), phase by phase, over many syncs.

For each server precision asked (`--dtype`) a server for the config's model starts
(bench/servers.py: the config's threads, batch and KV budget), and the trainer's side
publishes versions in a row as a remote training run does: `WeightsPublisher.publish`
(learner/files.py), the folder in the precision the server asks for (`--file-dtype
server`) or float32 whatever it samples in (`--file-dtype float32`: publications before
they followed the server's precision), then the rollwise dialect has the server load it
(`POST /v1/weights/update`, mode `engine.remote_sync`). Between versions every float
tensor is scaled by 1.01 or back (outside the timing), so each version's bytes differ.
The first publication (a run's version 0: the whole model, in the precision the server
said before it, as `compose.parts.place_remote` asks) is reported apart.

Per sync: the trainer's phases (gather, convert, write: learner/files.py), the server's
(read, pause, write, publish = conversion + cached prompts dropped, resume: its answer),
the round trip, and the total: the trainer's publish plus the round trip, what a step
records as `publish_seconds`. Per variant: median, p90 and max of each, the syncs over 1 s.
Deterministic: bytes per version, and whether the server's greedy tokens after the last
sync equal those of the in-process engine in the same precision on the trainer's weights.

Imports the config loader, the model loader, the engine, learner/files.py, the rollwise
dialect and bench/servers.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import typer

from rollwise.bench.common import median, percentile, print_table, save_results, say

TRAINER = ("gather_s", "convert_s", "write_s")
SERVER = ("read_s", "pause_s", "write_s", "publish_s", "resume_s")
COLUMNS = ["trainer_s"] + [f"trainer_{k}" for k in TRAINER] + ["http_s"] + [
    f"server_{k}" for k in SERVER] + ["total_s"]


@torch.no_grad()
def _nudge(model, k: int) -> None:
    """Every float tensor scaled by 1.01 (odd k) or back (even k): a new version's bytes."""
    factor = 1.01 if k % 2 else 1 / 1.01
    for p in model.parameters():
        if p.is_floating_point():
            p.mul_(factor)


def _variant(model, servers, dialect, *, want: str, syncs: int, first_version: int,
             root: str, sync: str, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """`syncs` + 1 publications of `model` loaded by the server in `want` ('server': the
    precision it says); one row each, the first marked."""
    from rollwise.learner.files import WeightsPublisher

    publisher = WeightsPublisher(model, root)
    asked = dialect.weights_dtype(servers, 0) if want == "server" else want  # asked once,
    rows = []  # as RemoteRollout asks each server once
    publisher.expect([asked])  # known before the first publication, as in a run
    try:
        for k in range(syncs + 1):
            if k:
                _nudge(model, k)
            version = first_version + k
            start = time.perf_counter()
            published = publisher.publish(version)
            folder = published.handle.folder(asked)  # what RemoteRollout.publish asks
            written = time.perf_counter()
            phases, http_s = dialect.load(servers, 0, folder, version, sync)
            total = time.perf_counter() - start
            files = sorted(Path(folder).iterdir())
            rows.append({"first": k == 0, "version": version, "file_dtype": asked,
                         "bytes": sum(f.stat().st_size for f in files),
                         "trainer_s": written - start, "http_s": http_s, "total_s": total}
                        | {f"trainer_{n}": publisher.seconds.get(n, 0.0) for n in TRAINER}
                        | {f"server_{n}": float(phases.get(n, 0.0)) for n in SERVER})
            progress(f"v{version} ({asked}): total {total:.3f}s, trainer {written - start:.3f}s,"
                     f" server round trip {http_s:.3f}s")
    finally:
        publisher.close()
    return rows


def _greedy_match(model, policy, servers, dtype: str, cfg) -> dict[str, Any]:
    """The server's greedy tokens for one prompt against the in-process engine's in
    `dtype` over `model` (same batch and KV settings as the server's)."""
    from rollwise.engine import NativeEngine, SamplingParams

    ids = policy.encode("What is 12 + 34? Put the final answer after ####.")
    answer, _ = servers.post("/v1/generate", {"prompt_token_ids": ids, "temperature": 0,
                                              "max_tokens": 16, "ignore_eos": True},
                             first=0, spread=False)
    served = answer["choices"][0]["token_ids"]
    engine = NativeEngine(model, eos_token_ids=policy.stop_ids, dtype=dtype,
                          max_num_seqs=cfg.engine.batch_size,
                          kv_budget_tokens=cfg.engine.kv_budget_tokens)
    local = engine.generate([ids], SamplingParams(temperature=0, max_tokens=16,
                                                  ignore_eos=True))[0].token_ids
    return {"greedy_tokens": len(served), "greedy_match": list(served) == list(local)}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, p90 and max of every phase over the rows after the first; syncs over 1 s."""
    steady = [r for r in rows if not r["first"]] or rows
    out: dict[str, Any] = {"syncs": len(steady), "bytes": steady[-1]["bytes"],
                           "over_1s": sum(r["total_s"] > 1.0 for r in steady),
                           "first_total_s": rows[0]["total_s"]}
    for c in COLUMNS:
        values = [r[c] for r in steady]
        out |= {c: median(values), f"{c}_p90": percentile(values, 0.9),
                f"{c}_max": max(values)}
    return out


def run(cfg, *, dtypes: list[str], file_dtypes: list[str], syncs: int, log_dir: Path,
        progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Every (server dtype, file dtype) variant: rows, summaries and the greedy check."""
    from rollwise.bench.servers import serve_for
    from rollwise.models import load_policy
    from rollwise.rollout.dialects import make_dialect
    from rollwise.rollout.servers import Servers

    policy = load_policy(cfg.model.name)
    dialect = make_dialect("rollwise")
    variants, version = [], 1
    for dtype in dtypes:
        with serve_for(cfg, dtype=dtype, log=log_dir / f"serve-{dtype}.log") as url:
            servers = Servers([url], timeout_s=cfg.engine.remote_timeout_s, retries=0)
            try:
                says = dialect.weights_dtype(servers, 0)
                # 'server' and 'float32' are one variant on a float32 server: run it once
                for want in dict.fromkeys(says if w == "server" else w for w in file_dtypes):
                    progress(f"server {dtype}, files {want}")
                    rows = _variant(policy.model, servers, dialect, want=want, syncs=syncs,
                                    first_version=version, root=cfg.engine.remote_weights_dir,
                                    sync=cfg.engine.remote_sync, progress=progress)
                    version += len(rows)
                    check = _greedy_match(policy.model, policy, servers, dtype, cfg)
                    variants.append({"server_dtype": dtype, "file_dtype": rows[-1]["file_dtype"],
                                     **check, **summarize(rows), "rows": rows})
            finally:
                servers.close()
    return {"model": cfg.model.name, "threads": torch.get_num_threads(),
            "sync_mode": cfg.engine.remote_sync, "syncs": syncs, "variants": variants}


def command(*, config: Path | None, json: Path | None, dtype: list[str] | None,
            file_dtype: list[str] | None, syncs: int, set_: list[str] | None) -> None:
    """`rollwise bench sync`: run it, print the tables, write `json` (and its page)."""
    from rollwise.compose.config import load_config
    from rollwise.system.runtime import configure

    bad = [d for d in file_dtype or [] if d not in ("server", "float32")]
    if bad:
        raise typer.BadParameter(f"--file-dtype {bad[0]!r}: 'server' or 'float32'")
    cfg = load_config(config or Path("configs/quickstart.toml"), list(set_ or []))
    configure(cfg.run.threads)
    log_dir = Path(json).parent if json else Path("runs/bench-sync")
    data = run(cfg, dtypes=list(dtype or ["bfloat16"]), file_dtypes=list(file_dtype or ["server"]),
               syncs=syncs, log_dir=log_dir, progress=say)
    for v in data["variants"]:
        rows = [{"phase": c, "median": v[c], "p90": v[f"{c}_p90"], "max": v[f"{c}_max"]}
                for c in COLUMNS]
        print_table(f"sync: {data['model']}, {v['server_dtype']} server, {v['file_dtype']} "
                    f"files ({v['bytes'] / 1e6:.0f} MB), {v['syncs']} syncs, "
                    f"{data['threads']} thread(s)", rows, ["phase", "median", "p90", "max"])
        typer.echo(f"syncs over 1 s: {v['over_1s']} of {v['syncs']}; first publication "
                   f"{v['first_total_s']:.2f} s; greedy tokens equal to the in-process "
                   f"engine's: {v['greedy_match']}")
    save_results(data, json)
