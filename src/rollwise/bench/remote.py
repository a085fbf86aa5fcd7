"""`rollwise bench remote`: one training config three ways, in one command: the engine in
process, against a `rollwise serve` process, and against the real vLLM (`rollwise
serve-vllm`'s server; `make vllm`). Same steps, threads and seed each; the servers
are started by the benchmark, their start-up timed.

Per side: the median step time, rollout tokens per second (tokens generated / rollout
seconds, summed over the steps), the weight sync per version (the trainer's write and the
servers' load: `publish_seconds`; median, p90, max), the server's start-up, the accuracy
before and after, and for vLLM the loads verified and unverified. The sides run one after
the other (each is a whole run; on 2 cores two at once would measure the contention).

Imports the config loader, the run loop, the benchmark helpers and the server launchers.
"""

from __future__ import annotations

import json as jsonlib
import statistics
import time
from pathlib import Path
from typing import Any

from rollwise.bench.common import print_table
from rollwise.bench.e2e import machine
from rollwise.bench.servers import free_port, serve_for
from rollwise.compose.config import load_config

SIDES = ("in-process", "rollwise-serve", "vllm")


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _train(cfg, name: str) -> dict[str, Any]:
    from rollwise.compose.config import to_toml
    from rollwise.pipeline.build import build, run_steps
    from rollwise.pipeline.loop import train
    from rollwise.run.rundir import new_run

    cfg.run.name = name
    stages = build(cfg)
    run = new_run(Path(cfg.run.output_dir) / name, config_toml=to_toml(cfg),
                  echo=lambda s: None)
    try:
        train(stages, run, cfg.run.num_steps, eval_every=cfg.eval.every,
              checkpoint_every=cfg.run.checkpoint_every, steps=run_steps(cfg))
    finally:
        stages.close()
    return summarize(Path(cfg.run.output_dir) / name, name)


def summarize(root: Path, name: str) -> dict[str, Any]:
    """The figures of the run in `root` (its metrics.jsonl): a step's seconds are the
    difference of consecutive `wall_time`s (the first from the run's start)."""
    records = [jsonlib.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    trains = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    walls = [0.0] + [r["wall_time"] for r in trains]
    steps = [b - a for a, b in zip(walls, walls[1:])]
    syncs = [r["publish_seconds"] for r in trains if "publish_seconds" in r]
    tokens = sum(r.get("rollout_generated_tokens", 0) for r in trains)
    rollout_s = sum(r.get("time_rollout", 0.0) for r in trains)
    out = {"side": name, "steps": len(trains), "step_s": statistics.median(steps),
           "train_s_total": walls[-1],
           "rollout_tok_s": tokens / rollout_s if rollout_s else float("nan"),
           "generated_tokens": tokens,
           "sync_median_s": statistics.median(syncs) if syncs else float("nan"),
           "sync_p90_s": _quantile(syncs, 0.9), "sync_max_s": max(syncs, default=float("nan")),
           "accuracy_before": evals[0].get("eval_accuracy") if evals else None,
           "accuracy_after": evals[-1].get("eval_accuracy") if evals else None,
           "reward_mean": statistics.mean(r.get("reward_mean", 0.0) for r in trains)}
    if any("remote_weights_verified" in r for r in trains):
        out["verified"] = sum(r.get("remote_weights_verified", 0) for r in trains)
        out["unverified"] = sum(r.get("remote_weights_unverified", 0) for r in trains)
        out["probe_error_max"] = max(r.get("remote_weights_probe_error", 0) for r in trains)
        loads = [r["remote_weights_update_seconds"] for r in trains
                 if "remote_weights_update_seconds" in r]
        out["server_load_median_s"] = statistics.median(loads) if loads else float("nan")
        for loader in ("direct", "stock"):  # vLLM's full-weight loads, by its worker's loader
            if any(f"remote_weights_{loader}_loads" in r for r in trains):
                out[f"{loader}_loads"] = sum(r.get(f"remote_weights_{loader}_loads", 0)
                                             for r in trains)
    return out


def command(*, config: Path | None, json: Path | None, steps: int, sides: list[str] | None,
            set_: list[str] | None, vllm_dtype: str, out: Path) -> dict[str, Any]:
    """Run each side of `sides`; print the table, write `json`."""
    from rollwise.serve.vllm import VLLMServer, prepare_folder

    path = config or Path("configs/quickstart.toml")
    sides = sides or list(SIDES)
    out.mkdir(parents=True, exist_ok=True)
    unknown = set(sides) - set(SIDES)
    if unknown:
        raise ValueError(f"--side: {sorted(unknown)} not among {', '.join(SIDES)}")
    rows: list[dict[str, Any]] = []
    for side in sides:
        cfg = load_config(path, [*(set_ or []), f"run.num_steps={steps}",
                                 f"run.output_dir='{out}'", "run.overwrite=true"])
        dtype = "float32" if cfg.engine.dtype in ("auto", "int8") else cfg.engine.dtype
        if side == "in-process":
            rows.append(_train(cfg, side) | {"startup_s": 0.0, "dtype": cfg.engine.dtype})
            continue
        cfg.engine.name, cfg.engine.remote_kind = "remote", (
            "vllm" if side == "vllm" else "rollwise")
        if side == "rollwise-serve":
            cfg.engine.dtype = dtype
            start = time.perf_counter()
            with serve_for(cfg, dtype=dtype, log=out / "serve.log") as url:
                startup = time.perf_counter() - start
                cfg.engine.remote_urls = [url]
                rows.append(_train(cfg, side) | {"startup_s": startup, "dtype": dtype})
            continue
        cfg.engine.dtype = vllm_dtype
        folder = prepare_folder(str(cfg.model.name), None, dtype=vllm_dtype)
        server = VLLMServer(folder, free_port(), dtype=vllm_dtype, log=out / "vllm.log",
                            lora_rank=cfg.model.lora_rank)
        server.start(600)
        try:
            cfg.engine.remote_urls = [server.url]
            rows.append(_train(cfg, side) | {"startup_s": server.started_s,
                                             "dtype": vllm_dtype})
        finally:
            server.stop()
    data = {"benchmark": "remote servers", "config": str(path), "steps": steps,
            "overrides": list(set_ or []), "vllm_dtype": vllm_dtype, "sides": rows,
            "machine": machine()}
    print_table(f"{path}: {steps} steps per side", rows,
                ["side", "dtype", "step_s", "train_s_total", "rollout_tok_s", "sync_median_s",
                 "sync_p90_s", "sync_max_s", "startup_s", "accuracy_before", "accuracy_after"])
    if json:
        json.parent.mkdir(parents=True, exist_ok=True)
        json.write_text(jsonlib.dumps(data, indent=2) + "\n")
    return data
