"""B-tree: plain sampling vs tree rollouts inside a response (`tree.mode`: LATR and
entropy branching, rollout/trees.py) on a config's single-turn task.

Each round takes the next `prompts` training prompts and rolls them out once per side on a
fresh native engine and scheduler built from the one policy (the side order rotates from
round to round, so drift in the machine's load falls on every side alike). Per side it
counts, beside the wall time: distinct responses per group, distinct correct responses
per group, the share of correct responses and of groups with one (pass@group), tokens
generated, prompt and recomputed tokens, tokens lent from a kept cache, forward passes, and
the tree's forks and prunes. Ratios to plain sampling are medians over rounds.

Imports typer only at module level (the CLI registers `command` directly); the rest is
imported when a benchmark runs.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Annotated, Any

import typer

SIDES = ("plain", "latr", "entropy", "entropy-running")  # the last: entropy_fork_after
COUNTS = ("groups", "responses", "distinct", "distinct_correct", "correct", "solved_groups",
          "generated_tokens", "prefill_tokens", "recompute_tokens", "reused_tokens",
          "forward_passes", "forks", "prunes", "masked_tokens")


def run(config: Path | None, *, rounds: int = 3, prompts: int = 16, fork_after: int = 8,
        overrides: list[str] | None = None, progress=print) -> dict[str, Any]:
    """Every side on the same prompts, `rounds` times; the figures per side and ratios.
    `fork_after`: the entropy-running side's tree.entropy_fork_after."""
    from rollwise.compose.config import load_config
    from rollwise.compose.parts import build_policy, build_precision, build_sampling, build_task
    from rollwise.pipeline.stages import encode_prompts
    from rollwise.system.runtime import configure as configure_runtime

    cfg = load_config(config or Path("configs/tiny_arith.toml"), list(overrides or []))
    configure_runtime(cfg.run.threads)
    task = build_task(cfg)
    policy = build_policy(cfg, task)
    precision = build_precision(cfg, policy)
    encoded, _ = encode_prompts(policy, task.train, cfg.rollout.max_prompt_tokens,
                                cfg.rollout.max_tokens)
    sampling = build_sampling(cfg)
    per_side: dict[str, list[dict[str, float]]] = {s: [] for s in SIDES}
    for k in range(rounds):
        batch = encoded[k * prompts: (k + 1) * prompts]
        order = SIDES[k % len(SIDES):] + SIDES[: k % len(SIDES)]
        for side in order:
            cfg.tree.mode = {"plain": "none", "entropy-running": "entropy"}.get(side, side)
            cfg.tree.entropy_fork_after = fork_after if side == "entropy-running" else 0
            figures = _one_side(cfg, policy, precision.rollout, sampling, task, batch)
            per_side[side].append(figures)
            progress(f"round {k + 1}/{rounds} {side}: {figures['seconds']:.2f} s, "
                     f"{figures['distinct']} distinct of {figures['responses']} responses")
    rows = [_side_row(side, per_side[side]) for side in SIDES]
    ratios = {f"median_{side}_over_plain_seconds": statistics.median(
        b["seconds"] / a["seconds"] for a, b in zip(per_side["plain"], per_side[side]))
        for side in SIDES[1:]}
    s = cfg.tree
    return {"benchmark": "B-tree: plain sampling vs LATR vs entropy branching",
            "config": str(config) if config else "configs/tiny_arith.toml",
            "overrides": list(overrides or []),
            "model": cfg.model.name, "task": task.name, "rounds": rounds,
            "prompts_per_round": prompts, "group_size": cfg.rollout.group_size,
            "temperature": cfg.rollout.temperature, "max_tokens": cfg.rollout.max_tokens,
            "rollout_dtype": precision.rollout,
            "tree_options": {"latr_threshold": s.latr_threshold, "latr_margin": s.latr_margin,
                             "latr_lookahead": list(s.latr_lookahead),
                             "latr_similarity": s.latr_similarity,
                             "entropy_branches": s.entropy_branches,
                             "entropy_fork_after (entropy-running)": fork_after,
                             "tree_forced_tokens": s.forced_tokens},
            "sides": rows, **ratios}


def _one_side(cfg, policy, dtype: str, sampling, task, batch) -> dict[str, float]:
    """Roll `batch` out once with `cfg`'s schedule; its counts and seconds."""
    from rollwise.compose.parts import build_engine
    from rollwise.rollout import RolloutScheduler
    from rollwise.rollout.trees import tree_settings

    engine = build_engine("native", policy, cfg.engine.batch_size, cfg.engine.kv_budget_tokens,
                          dtype)
    sched = RolloutScheduler(engine, sampling, policy.decode, seed=cfg.run.seed,
                             tree=tree_settings(cfg.tree))
    start = time.perf_counter()
    groups = sched.run(batch).groups
    wall = time.perf_counter() - start
    out = {key: 0.0 for key in COUNTS} | {"seconds": wall, "groups": len(groups)}
    for g in groups:
        right = set()
        for t in g.trajectories:
            if task.verifier(t.text, g.sample) >= 1.0:
                right.add(tuple(t.response_ids))
                out["correct"] += 1
            out["masked_tokens"] += t.sampled_mask.count(0)
        out["responses"] += len(g.trajectories)
        out["distinct"] += len({tuple(t.response_ids) for t in g.trajectories})
        out["distinct_correct"] += len(right)
        out["solved_groups"] += bool(right)
    st = engine.stats
    out.update(generated_tokens=st.generated_tokens, prefill_tokens=st.prefill_tokens,
               recompute_tokens=st.recompute_tokens, reused_tokens=st.reused_tokens,
               forward_passes=st.forward_passes)
    if sched.trees is not None:
        out.update(forks=sched.trees.counters.forks, prunes=sched.trees.counters.prunes)
    return out


def _side_row(side: str, runs: list[dict[str, float]]) -> dict[str, Any]:
    """A side's table row: counts summed over rounds, per-group means, median seconds."""
    row: dict[str, Any] = {"side": side, **{key: int(sum(x[key] for x in runs))
                                             for key in COUNTS}}
    groups, responses = max(row["groups"], 1), max(row["responses"], 1)
    row["distinct_per_group"] = row["distinct"] / groups
    row["distinct_correct_per_group"] = row["distinct_correct"] / groups
    row["correct_share"] = row["correct"] / responses
    row["pass_at_group"] = row["solved_groups"] / groups
    row["median_seconds"] = statistics.median(x["seconds"] for x in runs)
    return row


def command(json: Annotated[Path | None, typer.Option(
                "--json", help="Write results here (+ .html).")] = None,
            config: Annotated[Path | None, typer.Option(
                help="Single-turn config (default configs/tiny_arith.toml).")] = None,
            rounds: Annotated[int, typer.Option(help="Rounds (each side once per round).")] = 3,
            prompts: Annotated[int, typer.Option(help="Prompts per round.")] = 16,
            fork_after: Annotated[int, typer.Option(
                help="The entropy-running side's tree.entropy_fork_after.")] = 8,
            set_: Annotated[list[str] | None, typer.Option(
                "--set", help="Config override, e.g. tree.latr_threshold=0.2.")] = None,
            threads: Annotated[int, typer.Option(
                help="Torch CPU threads (0: cores free at start).")] = 1) -> None:
    """Plain sampling vs LATR vs entropy branching: distinct (correct) responses per group,
    tokens, forward passes, wall time."""
    from rollwise.bench.common import print_table, save_results, say

    data = run(config, rounds=rounds, prompts=prompts, fork_after=fork_after, progress=say,
               overrides=[f"run.threads={threads}", *(set_ or [])])
    print_table(f"Tree rollouts: {data['model']}, {data['task']}, group {data['group_size']}, "
                f"T={data['temperature']}, {data['rollout_dtype']}", data["sides"],
                ["side", "distinct_per_group", "distinct_correct_per_group", "correct_share",
                 "pass_at_group", "generated_tokens", "prefill_tokens", "recompute_tokens",
                 "reused_tokens", "forward_passes", "forks", "prunes", "masked_tokens",
                 "median_seconds"])
    typer.echo(f"wall time vs plain (median of {rounds} rounds): " + ", ".join(
        f"{side} {data[f'median_{side}_over_plain_seconds']:.2f}x" for side in SIDES[1:]))
    save_results(data, json)
