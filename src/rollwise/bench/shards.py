"""`rollwise bench learner --shards 1 --shards 2`: the learner over N FSDP2 ranks against one
process, on one fixed batch (docs/scaling.md, The learner on N devices).

The batch is bench/learner.py's (real rollouts of the quickstart's shape, every row with a
non-zero advantage). Each shard count trains its own copy of the same weights; all learners
are started first (the same process start), then the counts alternate within each
repetition. Per count: what each rank holds (parameters, gradients, optimizer state: its
shards, counted by bytes, so deterministic), the resident set an update added on a rank
(activations and workspace), the update's seconds and the publication's (the ranks' rows
into the driver's copy, then the rollout engine's install of it), medians over repetitions.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch

from rollwise.bench.common import load_workload, median, print_table, save_results, say

MB = 2.0**20


def _config(model: str, shards: int, threads: int):
    from rollwise.compose.config import validate_config

    return validate_config({"model": {"name": model}, "run": {"threads": threads},
                            "learner": {"lr": 1e-5, "skip_zero_advantage": False,
                                        "shards": shards, "release_memory": True}})


class _Side:
    """One shard count: its learner (or ranks), its copy of the weights and an engine."""

    def __init__(self, model: str, policy, shards: int, engine_dtype: str, threads: int):
        from rollwise.compose.parts import build_learner
        from rollwise.compose.precision import PrecisionChoice
        from rollwise.distributed.shards import _Model, start_local
        from rollwise.engine import NativeEngine

        self.shards = shards
        self.model = copy.deepcopy(policy.model)
        cfg = _config(model, shards, threads)
        precision = PrecisionChoice(engine_dtype, "float32", "none",
                                    dict.fromkeys(("rollout", "learner", "correction"), "explicit"))
        if shards == 1:
            self.trainer = build_learner(cfg, _Model(self.model), precision)
        else:
            self.trainer = start_local(cfg, self.model, precision)
        self.engine = NativeEngine(self.model, eos_token_ids=policy.stop_ids, dtype=engine_dtype)
        self.version = 0

    def update(self) -> tuple[float, float]:
        """(update seconds, MiB the update added to a rank's resident set)."""
        from rollwise.system.runtime import rss_peak

        with rss_peak() as before:
            pass
        start = time.perf_counter()
        with rss_peak() as peak:
            out = self.trainer.update(self.batch)
        seconds = time.perf_counter() - start
        added = out.get("learner_rank_peak_rss_added_mb", peak["mb"] - before["mb"])
        return seconds, added

    def publish(self) -> float:
        start = time.perf_counter()
        self.version += 1
        self.trainer.publish(self.version)
        self.engine.publish(self.version)
        return time.perf_counter() - start

    def held(self) -> list[dict[str, float]]:
        from rollwise.learner.shards import held_bytes

        return [held_bytes(self.trainer)] if self.shards == 1 else self.trainer.memory()

    def close(self) -> None:
        self.trainer.close()


def run(model: str = "smollm2-135m", *, shards: tuple[int, ...] = (1, 2), reps: int = 3,
        engine_dtype: str = "float32", threads: int = 1, seed: int = 0) -> dict[str, Any]:
    from rollwise.bench.learner import _batch

    policy, pairs = load_workload(model, 4, seed, "cpu", split="pairs")
    batch, _ = _batch(policy, pairs, 8, 64, seed, {})
    sides = []
    try:
        for n in shards:
            say(f"starting {n} learner rank(s)")
            side = _Side(model, policy, n, engine_dtype, threads)
            side.batch = batch
            sides.append(side)
        times = {n: {"update_s": [], "publish_s": [], "added_rss_mb": []} for n in shards}
        for rep in range(reps):
            for side in sides[rep % len(sides):] + sides[: rep % len(sides)]:
                seconds, added = side.update()
                published = side.publish()
                t = times[side.shards]
                t["update_s"].append(seconds)
                t["publish_s"].append(published)
                t["added_rss_mb"].append(added)
                say(f"rep {rep + 1}/{reps} shards {side.shards}: update {seconds:.2f}s, "
                    f"publish {published:.3f}s")
        held = {side.shards: side.held() for side in sides}
    finally:
        for side in sides:
            side.close()
    one = held[shards[0]][0]
    base = one["parameters"] + one["gradients"] + one["optimizer"]
    rows = []
    for n in shards:
        rank = max(held[n], key=lambda h: h["parameters"] + h["gradients"] + h["optimizer"])
        state = rank["parameters"] + rank["gradients"] + rank["optimizer"]
        rows.append({"shards": n, "params_mb": rank["parameters"] / MB,
                     "grads_mb": rank["gradients"] / MB, "optimizer_mb": rank["optimizer"] / MB,
                     "frozen_mb": rank["frozen"] / MB, "state_mb": state / MB,
                     f"state_vs_{shards[0]}": state / base,
                     "update_added_rss_mb": median(times[n]["added_rss_mb"]),
                     "update_s": median(times[n]["update_s"]),
                     "publish_s": median(times[n]["publish_s"]),
                     f"update_vs_{shards[0]}": median(times[n]["update_s"])
                     / median(times[shards[0]]["update_s"])})
    return {"benchmark": "learner shards", "model": model, "rows": batch.num_rows,
            "tokens": int(batch.attention_mask.sum()), "reps": reps, "threads_per_rank": threads,
            "engine_dtype": engine_dtype, "torch": torch.__version__, "shards": rows,
            "per_rep": times}


def command(*, model: str, json: Path | None, reps: int, threads: int, shards: list[int],
            engine_dtype: str) -> None:
    from rollwise.system.runtime import configure

    if any(n < 1 for n in shards):
        raise ValueError(f"--shards takes counts of at least 1, not {shards}")
    configure(threads or 1)
    data = run(model, shards=tuple(shards), reps=reps, engine_dtype=engine_dtype,
               threads=threads or 1)
    print_table(f"learner over N ranks, {model}: the largest rank's bytes, {data['rows']} rows "
                f"/ {data['tokens']} tokens, {threads or 1} thread(s) a rank", data["shards"],
                list(data["shards"][0]))
    save_results(data, json)
