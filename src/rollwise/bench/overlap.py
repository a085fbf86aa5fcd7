"""`rollwise bench async`: synchronous against asynchronous training (bounded staleness).

Variants of one training config, same seed, same steps (so the same number of
trajectories), trained through the real driver one after another:

    local-sync      run.backend='local' (one process): the reference of the Ray overhead
    local-async-1   one process, mode 'async', max_staleness 1: the producer thread rolls
                    out step k+1 (the engine on its own copy of the weights) while step k
                    trains; `run.threads = 0` gives each side half the free cores
    ray-sync        run.backend='ray', mode 'sync': rollout worker and learner as actors,
                    one after the other; its rollout and train phases are the stages
                    'measured alone with the same split'
    ray-async-1     mode 'async', max_staleness 1: step k+1 rolls out while step k trains
    ray-async-2     mode 'async', max_staleness 2
    remote-sync     engine.name='remote' against a `rollwise serve` process the bench starts
                    (bench/servers.py: same model, precision, threads), mode 'sync'
    remote-async-1  the same server, mode 'async', max_staleness 1

Per variant: median wall time per step (warm-up steps dropped), the rollout and learner
busy fractions (learner: the train phase over the step's wall time, per step, median; in
async the rollout phase is the producer's, overlapped), the share of trained trajectories
at least one version stale, the held-out greedy accuracy after the last step, and the
deterministic counters (trajectories, tokens). Derived, for each asynchronous variant
against the synchronous variant of its placement (`PAIRS`): `<async>_over_larger_stage`
(its step time over the larger of the synchronous rollout(+reward) and train(+publish)
medians: 1.0 is a perfect overlap) and `<async>_accuracy_minus_sync`; and `ray_overhead`
(ray-sync step over local-sync step).

Whole runs cannot alternate step by step (the asynchronous producer runs ahead), so the
variants run in sequence: wall times are exposed to the machine's load; counters are not.
Imports the bench helpers, the config loader and the driver; Ray only for Ray variants.
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
    "local-async-1": ("run.backend='local'", "schedule.mode='async'",
                      "schedule.max_staleness=1"),
    "ray-sync": ("run.backend='ray'", "schedule.mode='sync'"),
    "ray-async-1": ("run.backend='ray'", "schedule.mode='async'", "schedule.max_staleness=1"),
    "ray-async-2": ("run.backend='ray'", "schedule.mode='async'", "schedule.max_staleness=2"),
    "remote-sync": ("run.backend='local'", "engine.name='remote'", "schedule.mode='sync'"),
    "remote-async-1": ("run.backend='local'", "engine.name='remote'", "schedule.mode='async'",
                       "schedule.max_staleness=1"),
}
# each asynchronous variant and the synchronous one of the same placement
PAIRS = {"local-async-1": "local-sync", "ray-async-1": "ray-sync", "ray-async-2": "ray-sync",
         "remote-async-1": "remote-sync"}


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def rollout_dtype(cfg) -> str:
    """The precision the in-process engine would sample in for `cfg` (its 'auto' settled
    as a local run settles it), which the server of a remote variant is given."""
    if cfg.engine.dtype != "auto":
        return cfg.engine.dtype
    from rollwise.compose.parts import build_precision
    from rollwise.models import load_policy

    local = cfg.model_copy(deep=True)
    local.engine.name = "native"
    policy = load_policy(cfg.model.name, device=cfg.run.device, dtype=cfg.learner.master_dtype,
                         tiny=cfg.model.tiny.model_dump() | {"seed": cfg.run.seed})
    return build_precision(local, policy).rollout


def run_variant(path: Path, name: str, overrides: tuple[str, ...], out: Path, steps: int,
                warmup: int, extra: list[str]) -> dict[str, Any]:
    """Train one variant; its row. A remote variant first starts its server."""
    from rollwise.bench.servers import serve_for

    cfg = variant_config(path, name, overrides, out, extra, num_steps=steps,
                         checkpoint_every=0, checkpoint_minutes=0)
    if cfg.engine.name != "remote":
        return train_variant(cfg, name, warmup)
    dtype = rollout_dtype(cfg)
    log = Path(cfg.run.output_dir) / f"{cfg.run.name}-server.log"
    with serve_for(cfg, dtype=dtype, log=log) as url:
        cfg.engine.remote_urls = [url]
        cfg.engine.dtype = dtype  # what the learner's mismatch correction assumes
        return train_variant(cfg, name, warmup) | {"server_dtype": dtype}


def train_variant(cfg, name: str, warmup: int) -> dict[str, Any]:
    """Train `cfg` through the driver (no evaluation but the final one, no checkpoint but
    the last); its row, from the run's step records."""
    from rollwise.pipeline.build import build, run_steps
    from rollwise.pipeline.loop import train
    from rollwise.run.rundir import new_run

    cfg.eval.every = 0
    cfg.eval.before = False
    stages = build(cfg)
    run = new_run(Path(cfg.run.output_dir) / cfg.run.name, echo=lambda s: None)
    root = run.root
    start = time.perf_counter()
    try:
        summary = train(stages, run, cfg.run.num_steps, eval_before=False,
                        steps=run_steps(cfg))
    finally:
        stages.close()
    total = time.perf_counter() - start
    records = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    trains = [r for r in records if r["kind"] == "train"]
    return {"variant": name, **step_figures(trains, warmup),
            "accuracy": summary["eval_after"]["accuracy"], "run_seconds": total}


def step_figures(trains: list[dict], warmup: int) -> dict[str, Any]:
    """Medians over the steps after `warmup` and counters over every step. The busy
    fractions are the phase's seconds over the step's wall time (the run's clock between
    two step records), the same definition for every variant."""
    walls = [r["wall_time"] for r in trains]
    step_s = [b - a for a, b in zip([0.0, *walls], walls)][warmup:]
    kept = trains[warmup:]

    def med(key: str) -> float:
        return _median([float(r.get(key, 0.0)) for r in kept])

    def busy(key: str) -> float:
        return _median([float(r.get(key, 0.0)) / max(s, 1e-9) for r, s in zip(kept, step_s)])

    stale = [1 - r["staleness_hist_0"] / max(r["traj_trained"], 1) for r in kept]
    return {
        "step_s": _median(step_s),
        "rollout_s": med("time_rollout") + med("time_reward"),
        "train_s": med("time_train") + med("publish_seconds"),
        "publish_s": med("publish_seconds"), "wait_s": med("time_wait"),
        "rollout_busy": busy("time_rollout"), "learner_busy": busy("time_train"),
        "stale_frac": statistics.fmean(stale) if stale else 0.0,
        "staleness_max": max((_oldest(r) for r in kept), default=0),
        "stale_dropped": sum(r["traj_stale_dropped"] for r in trains),
        "trajectories": sum(r["traj_trained"] + r["traj_filtered"] for r in trains),
        "tokens": sum(r["step_tokens"] for r in trains),
        "steps": len(trains), "measured_steps": len(kept), "per_step_s": step_s,
    }


def _oldest(record: dict) -> int:
    """The largest age (in versions) of a trajectory the step trained, from its staleness
    histogram (3 stands for 3 or more). The rollout's own `staleness_max` is the age at the
    end of its collection, 0 for a batch collected whole before the publication it trains
    after."""
    ages = [3 if k == "3plus" else int(k) for k in ("0", "1", "2", "3plus")
            if record.get(f"staleness_hist_{k}", 0)]
    return max(ages, default=0)


def derived(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The overlap, accuracy and Ray-overhead ratios of one config's rows (PAIRS)."""
    by = {r["variant"]: r for r in rows}
    out: dict[str, float] = {}
    for slow, sync in PAIRS.items():
        if slow in by and sync in by:
            larger = max(by[sync]["rollout_s"], by[sync]["train_s"])
            out[f"{sync}_larger_stage_s"] = larger
            out[f"{slow}_over_larger_stage"] = by[slow]["step_s"] / larger
            out[f"{slow}_learner_busy"] = by[slow]["learner_busy"]
            out[f"{slow}_accuracy_minus_sync"] = by[slow]["accuracy"] - by[sync]["accuracy"]
    if "ray-sync" in by and "local-sync" in by:
        out["ray_overhead"] = by["ray-sync"]["step_s"] / by["local-sync"]["step_s"]
    return out


def run(configs: list[Path], *, variants: dict[str, tuple[str, ...]] | None = None,
        steps: int = 6, warmup: int = 1, extra: list[str] | None = None,
        num_cpus: int | None = None,
        progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Every variant of every config; a variant the build refuses is listed with the
    reason (`refused`), not trained. A Ray cluster only when a Ray variant is asked for."""
    import os

    from rollwise.bench.e2e import machine
    from rollwise.compose.config import ConfigError

    variants = variants or VARIANTS
    num_cpus = num_cpus or len(os.sched_getaffinity(0))
    ray, started = None, False
    if any("run.backend='ray'" in o for o in variants.values()):
        from rollwise.distributed.cluster import connect

        # on a shared machine Ray's OOM killer reacts to other programs' memory too
        os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
        ray, started = connect(None, num_cpus=num_cpus)
    out = Path(tempfile.mkdtemp(prefix="rollwise-bench-async-"))
    results = []
    try:
        for path in configs:
            rows, refused = [], []
            for name, overrides in variants.items():
                progress(f"{Path(path).name}: {name} ({steps} steps)")
                try:
                    rows.append(run_variant(Path(path), name, overrides, out, steps, warmup,
                                            list(extra or [])))
                except ConfigError as e:
                    refused.append({"variant": name, "reason": str(e)})
            results.append({"config": str(path), "variants": rows, "refused": refused,
                            "derived": derived(rows)})
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
                    ["variant", "step_s", "rollout_s", "train_s", "publish_s", "wait_s",
                     "rollout_busy", "learner_busy", "stale_frac", "stale_dropped",
                     "trajectories", "tokens", "accuracy"])
        for no in r["refused"]:
            typer.echo(f"{no['variant']}: refused: {no['reason']}")
        typer.echo(", ".join(f"{k} {v:.3f}" for k, v in r["derived"].items()))
    save_results(data, json)
