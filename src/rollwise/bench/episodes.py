"""B-episodes: multi-turn rollouts with and without the kept KV cache (`episodes.keep_kv`).

The same episodes (a config's environment task, prompts and seeds) are rolled out by two
native engines that differ only in whether a conversation's keys/values are kept between
its turns. Each round runs both sides in turn (the order alternates from round to round)
on a fresh engine pair built from the one policy. Deterministic counters sit beside the
wall time: prompt tokens submitted, prompt tokens the engine computed, history tokens it
took from a kept cache, forward passes. Tokens sampled from the same seeds are the same on
both sides up to rounding (float32: identical ids in practice; bfloat16: a rare near-tie
can flip a token, and the episodes diverge from there), which `same_episodes` reports.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import typer

from rollwise.bench.common import print_table, save_results, say

SIDES = ("kept", "recomputed")


def run(config: Path | None, *, rounds: int = 3, prompts: int = 8,
        overrides: list[str] | None = None, progress=print) -> dict[str, Any]:
    from rollwise.compose.config import load_config
    from rollwise.compose.parts import (
        build_engine,
        build_episode_runner,
        build_policy,
        build_precision,
        build_sampling,
        build_task,
    )
    from rollwise.pipeline.stages import encode_prompts
    from rollwise.system.runtime import configure as configure_runtime

    cfg = load_config(config, list(overrides or []))
    configure_runtime(cfg.run.threads)
    r = cfg.rollout
    task = build_task(cfg)
    if task.env is None:
        raise ValueError(f"task '{task.name}' has no environment: nothing multi-turn to measure")
    policy = build_policy(cfg, task)
    precision = build_precision(cfg, policy)
    encoded, _ = encode_prompts(policy, task.train, r.max_prompt_tokens, r.max_tokens)
    sampling = build_sampling(cfg)
    per_side: dict[str, list[dict[str, float]]] = {s: [] for s in SIDES}
    same = total = 0
    for k in range(rounds):
        batch = encoded[k * prompts: (k + 1) * prompts]
        tokens: dict[str, list[list[int]]] = {}
        for side in SIDES if k % 2 == 0 else SIDES[::-1]:
            cfg.episodes.keep_kv = side == "kept"
            engine = build_engine("native", policy, cfg.engine.batch_size,
                                  cfg.engine.kv_budget_tokens, precision.rollout)
            runner = build_episode_runner(cfg, engine, sampling, policy, task)
            start = time.perf_counter()
            groups, figures, counts = runner.run(batch)
            wall = time.perf_counter() - start
            tokens[side] = [t.response_ids for g in groups for t in g.trajectories]
            per_side[side].append(_round_figures(wall, counts, figures, engine))
            progress(f"round {k + 1}/{rounds} {side}: {wall:.1f} s, prefill "
                     f"{counts.prefill_tokens} of {counts.prompt_tokens} prompt tokens")
        same += sum(a == b for a, b in zip(tokens["kept"], tokens["recomputed"]))
        total += len(tokens["kept"])
    rows = [_side_row(side, per_side[side]) for side in SIDES]
    ratios = [b["seconds"] / a["seconds"] for a, b in zip(per_side["kept"], per_side["recomputed"])]
    prefill = [b["prefill_seconds"] / max(a["prefill_seconds"], 1e-9)
               for a, b in zip(per_side["kept"], per_side["recomputed"])]
    return {"benchmark": "B-episodes: kept KV cache across turns vs recomputed history",
            "config": str(config) if config else None, "model": cfg.model.name,
            "task": task.name, "rounds": rounds, "prompts_per_round": prompts,
            "group_size": r.group_size, "rollout_dtype": precision.rollout, "sides": rows,
            "same_episodes": f"{same}/{total}",
            "recomputed_over_kept_seconds": ratios,
            "median_recomputed_over_kept_seconds": statistics.median(ratios),
            "median_recomputed_over_kept_prefill_seconds": statistics.median(prefill)}


def _round_figures(wall: float, counts, figures, engine) -> dict[str, float]:
    """One side's figures of one round: its seconds, episode counts and engine work."""
    return {"seconds": wall, "episodes": counts.episodes, "turns": counts.turns,
            "prompt_tokens": counts.prompt_tokens, "prefill_tokens": counts.prefill_tokens,
            "kv_reused_tokens": counts.kv_reused_tokens,
            "reusable_tokens": counts.prefix_reuse_tokens,
            "generated_tokens": figures.generated_tokens,
            "forward_passes": figures.forward_passes,
            "prefill_seconds": engine.stats.prefill_seconds}


def _side_row(side: str, runs: list[dict[str, float]]) -> dict[str, Any]:
    """A side's table row: counts summed over rounds, seconds as medians."""
    row = {"side": side, **{key: sum(x[key] for x in runs) for key in (
        "episodes", "turns", "prompt_tokens", "prefill_tokens", "kv_reused_tokens",
        "reusable_tokens", "generated_tokens", "forward_passes")}}
    row["median_seconds"] = statistics.median(x["seconds"] for x in runs)
    row["median_prefill_seconds"] = statistics.median(x["prefill_seconds"] for x in runs)
    return row


def command(*, config: Path | None, json: Path | None, rounds: int, prompts: int,
            set_: list[str] | None, threads: int) -> None:
    """`rollwise bench episodes`: run it, print the tables, write `json` (and its page)."""
    overrides = [] if config else ["task.name='guess'", "task.options={high=8, max_guesses=4}",
                                   "episodes.max_turns=4", "rollout.max_tokens=4"]
    data = run(config, rounds=rounds, prompts=prompts, progress=say,
               overrides=[*overrides, f"run.threads={threads}", *(set_ or [])])
    print_table(f"Kept KV cache vs recomputed history: {data['model']}, {data['task']}, "
                f"{data['rollout_dtype']}", data["sides"],
                ["side", "episodes", "turns", "prompt_tokens", "prefill_tokens",
                 "kv_reused_tokens", "generated_tokens", "forward_passes", "median_seconds",
                 "median_prefill_seconds"])
    typer.echo(f"recomputed / kept wall time: {data['median_recomputed_over_kept_seconds']:.2f}x "
               f"(median of {rounds}); prefill time "
               f"{data['median_recomputed_over_kept_prefill_seconds']:.2f}x; same episodes "
               f"{data['same_episodes']}")
    save_results(data, json)
