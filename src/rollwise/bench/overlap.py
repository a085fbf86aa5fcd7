"""`rollwise bench async`: synchronous against asynchronous training (bounded staleness).

Variants of one training config, same seed, same steps (so the same number of
trajectories), trained through the real driver one after another:

    local-sync    run.backend='local' (one process): the reference of the Ray overhead
    ray-sync      run.backend='ray', mode 'sync': rollout worker and learner as actors,
                  one after the other; its rollout and train phases are the stages
                  'measured alone with the same split'
    ray-async-1   mode 'async', max_staleness 1: step k+1 rolls out while step k trains
    ray-async-2   mode 'async', max_staleness 2

Per variant: median wall time per step (warm-up steps dropped), the rollout and learner
busy fractions (phase time over step time; in async the rollout phase is the producer's,
overlapped), the share of trained trajectories at least one version stale, the held-out
greedy accuracy after the last step, and the deterministic counters (trajectories, tokens).
Derived: `async1_over_larger_stage` (async S=1 step time over the larger of ray-sync's
rollout(+reward) and train(+publish) medians: 1.0 is a perfect overlap) and
`ray_overhead` (ray-sync step over local-sync step).

Whole runs cannot alternate step by step (the asynchronous producer runs ahead), so the
variants run in sequence: wall times are exposed to the machine's load; counters are not.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from rollwise.bench.common import print_table, save_results, say
from rollwise.bench.sides import variant_config

VARIANTS: dict[str, tuple[str, ...]] = {
    "local-sync": ("run.backend='local'", "schedule.mode='sync'"),
    "ray-sync": ("run.backend='ray'", "schedule.mode='sync'"),
    "ray-async-1": ("run.backend='ray'", "schedule.mode='async'", "schedule.max_staleness=1"),
    "ray-async-2": ("run.backend='ray'", "schedule.mode='async'", "schedule.max_staleness=2"),
}


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def run_variant(path: Path, name: str, overrides: tuple[str, ...], out: Path, steps: int,
                warmup: int, extra: list[str]) -> dict[str, Any]:
    from rollwise.pipeline.build import build, run_steps
    from rollwise.pipeline.loop import train
    from rollwise.run.rundir import Run

    cfg = variant_config(path, name, overrides, out, extra, num_steps=steps,
                         checkpoint_every=0, checkpoint_minutes=0)
    cfg.eval.every = 0
    cfg.eval.before = False
    stages = build(cfg)
    root = Path(cfg.run.output_dir) / cfg.run.name
    run = Run(root, resume=False, echo=lambda s: None)
    start = time.perf_counter()
    try:
        summary = train(stages, run, steps, eval_before=False, steps=run_steps(cfg))
    finally:
        stages.close()
    total = time.perf_counter() - start
    records = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    trains = [r for r in records if r["kind"] == "train"]
    walls = [r["wall_time"] for r in trains]
    step_s = [b - a for a, b in zip([0.0, *walls], walls)][warmup:]
    kept = trains[warmup:]

    def med(key: str) -> float:
        return _median([float(r.get(key, 0.0)) for r in kept])

    stale = [1 - r["staleness_hist_0"] / max(r["traj_trained"], 1) for r in kept]
    return {
        "variant": name, "step_s": _median(step_s),
        "rollout_s": med("time_rollout") + med("time_reward"),
        "train_s": med("time_train") + med("publish_seconds"),
        "wait_s": med("time_wait"),
        "rollout_busy": med("rollout_busy_time_frac"), "learner_busy": med("learner_busy_time_frac"),
        "stale_frac": statistics.fmean(stale) if stale else 0.0,
        "staleness_max": max((r.get("staleness_max", 0) for r in kept), default=0),
        "stale_dropped": sum(r["traj_stale_dropped"] for r in trains),
        "trajectories": sum(r["traj_trained"] + r["traj_filtered"] for r in trains),
        "tokens": sum(r["step_tokens"] for r in trains),
        "accuracy": summary["eval_after"]["accuracy"],
        "run_seconds": total, "steps": len(trains), "measured_steps": len(kept),
        "per_step_s": step_s,
    }


def run(configs: list[Path], *, variants: dict[str, tuple[str, ...]] | None = None,
        steps: int = 6, warmup: int = 1, extra: list[str] | None = None,
        num_cpus: int | None = None,
        progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    import os

    from rollwise.bench.e2e import machine
    from rollwise.distributed.cluster import connect

    variants = variants or VARIANTS
    num_cpus = num_cpus or len(os.sched_getaffinity(0))
    # on a shared machine Ray's OOM killer reacts to other programs' memory too
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    ray, started = connect(None, num_cpus=num_cpus)
    out = Path(tempfile.mkdtemp(prefix="rollwise-bench-async-"))
    results = []
    try:
        for path in configs:
            rows = []
            for name, overrides in variants.items():
                progress(f"{Path(path).name}: {name} ({steps} steps)")
                rows.append(run_variant(Path(path), name, overrides, out, steps, warmup,
                                        list(extra or [])))
            by = {r["variant"]: r for r in rows}
            derived: dict[str, float] = {}
            if "ray-sync" in by:
                larger = max(by["ray-sync"]["rollout_s"], by["ray-sync"]["train_s"])
                derived["larger_stage_s"] = larger
                for s in ("ray-async-1", "ray-async-2"):
                    if s in by:
                        derived[f"{s}_over_larger_stage"] = by[s]["step_s"] / larger
                if "local-sync" in by:
                    derived["ray_overhead"] = by["ray-sync"]["step_s"] / by["local-sync"]["step_s"]
            if "local-sync" in by:
                for s in by:
                    derived[f"{s}_accuracy_minus_sync"] = by[s]["accuracy"] - by["local-sync"][
                        "accuracy"]
            results.append({"config": str(path), "variants": rows, "derived": derived})
    finally:
        if started:
            ray.shutdown()
    return {"benchmark": "async", "steps": steps, "warmup": warmup, "extra": list(extra or []),
            "machine": machine(), "ray_cpus": num_cpus,
            "cores_allowed": sorted(os.sched_getaffinity(0)), "results": results}


def scaling_table(rollout_s: float, train_s: float, weight_bytes: float, *,
                  workers: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
                  bandwidth_bytes_s: float = 1.25e9, trajectories: int = 32,
                  max_staleness: int = 1) -> list[dict[str, float]]:
    """ECHO-2's capacity model from measured stage costs (docs/scaling.md).

    One rollout worker takes `rollout_s` for a step's `trajectories`; N workers split them
    evenly (rollout time rollout_s / N: each worker keeps its own batch efficiency, no
    stragglers). The learner takes `train_s` per step whatever N. Each version's weights
    (`weight_bytes`) leave the learner's node once per worker node at `bandwidth_bytes_s`
    (N copies through one link: the pessimistic case; Ray may relay between nodes).
    Synchronous: step = rollout + dissemination + train. Asynchronous (S >= 1): rollout
    and dissemination of later steps overlap the update, step = max(train, rollout +
    dissemination). Throughput: trajectories per second; learner utilisation: train / step.
    """
    rows = []
    for n in workers:
        rollout = rollout_s / n
        dissemination = n * weight_bytes / bandwidth_bytes_s
        sync = rollout + dissemination + train_s
        overlapped = max(train_s, rollout + dissemination) if max_staleness >= 1 else sync
        rows.append({"workers": n, "rollout_s": rollout, "dissemination_s": dissemination,
                     "sync_step_s": sync, "async_step_s": overlapped,
                     "sync_traj_per_s": trajectories / sync,
                     "async_traj_per_s": trajectories / overlapped,
                     "sync_learner_util": train_s / sync,
                     "async_learner_util": train_s / overlapped})
    return rows


def command(*, configs: list[Path] | None, json: Path | None, steps: int, warmup: int,
            variant: list[str] | None, cpus: int, set_: list[str] | None) -> None:
    """`rollwise bench async`: run it, print the tables, write `json` (and its page)."""
    names = tuple(variant or VARIANTS)
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise typer.BadParameter(f"unknown variant {bad[0]!r}; known: "
                                 f"{', '.join(VARIANTS)}")
    paths = configs or [Path("configs/tiny_arith.toml"), Path("configs/quickstart.toml")]
    data = run(paths, variants={n: VARIANTS[n] for n in names}, steps=steps,
               warmup=warmup, extra=list(set_ or []), num_cpus=cpus or None,
               progress=say)
    for r in data["results"]:
        print_table(f"async: {r['config']} ({steps} steps, {warmup} warm-up)", r["variants"],
                    ["variant", "step_s", "rollout_s", "train_s", "wait_s", "rollout_busy",
                     "learner_busy", "stale_frac", "stale_dropped", "trajectories", "tokens",
                     "accuracy"])
        typer.echo(", ".join(f"{k} {v:.3f}" for k, v in r["derived"].items()))
    save_results(data, json)
