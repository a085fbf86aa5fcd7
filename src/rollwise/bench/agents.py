"""B-agents, step-level credit: episodes until held-out success on the guess-the-number
game reaches a target, GiGPO against GRPO, same seeds, same budget per step.

Both estimators train a fresh policy (the same warm start for the tiny model) through the
real driver on the `guess` task (rollwise.tasks.agents): GRPO gives every token of an episode
its group-normalised episode reward; GiGPO adds, per turn, the step advantage among the
group's turns taken in the same game state (the interval still possible). Held-out greedy
success is measured every `eval_every` steps; `episodes_to_target` is the cumulative
training episodes at the first evaluation at or above the target (None if never). The
target defaults to `target_frac` x the best success either side reached on that seed.
Sides alternate in order from seed to seed (GiGPO first on even seeds). Deterministic
counters (episodes, tokens) sit beside the wall time.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from rollwise.bench.alloc import summarise, train_one
from rollwise.bench.common import print_table, save_results, say

SIDES = ("gigpo", "grpo")


def bench_config(model: str, advantage: str, seed: int, steps: int, eval_every: int,
                 out: Path, extra: list[str] | None = None):
    """The game config: numbers 1-8, 4 guesses, 8 games x 8 episodes per step (tiny), or
    configs/agent_guess.toml's settings (SmolLM2)."""
    from rollwise.compose.config import load_config

    overrides = [
        f"run.name='{advantage}-s{seed}'", f"run.output_dir='{out}'", f"run.seed={seed}",
        f"run.num_steps={steps}", "run.overwrite=true", f"model.name='{model}'",
        "task.name='guess'", "task.options={high=8, max_guesses=4}", "task.num_train=512",
        "task.num_eval=64", "rollout.prompts_per_step=8", "rollout.group_size=8",
        "rollout.max_tokens=4", "episodes.max_turns=4", "rollout.temperature=1.0",
        "engine.dtype='float32'", "learner.precision='float32'", "learner.lr=1e-3",
        f"eval.every={eval_every}", f"algorithm.advantage='{advantage}'",
    ]
    if model != "tiny":
        overrides += ["rollout.prompts_per_step=4", "rollout.max_tokens=12",
                      "rollout.temperature=0.8", "learner.lr=3e-5", "engine.dtype='auto'",
                      "learner.precision='auto'"]
    return load_config(None, overrides + list(extra or []))


def run(model: str = "tiny", seeds: tuple[int, ...] = (0, 1), steps: int = 60,
        eval_every: int = 5, target: float | None = None, target_frac: float = 0.9,
        extra: list[str] | None = None, out: Path | None = None,
        progress: Callable[[str], None] = print) -> dict[str, Any]:
    work = Path(out) if out else Path(tempfile.mkdtemp(prefix="rollwise-bagents-"))
    runs: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in SIDES}
    for seed in seeds:
        for side in SIDES if seed % 2 == 0 else SIDES[::-1]:
            progress(f"{side} seed {seed}: {steps} steps")
            runs[side].append(train_one(bench_config(model, side, seed, steps, eval_every,
                                                     work, extra)))
    best = [max(r["eval_accuracy"] for side in SIDES for r in runs[side][i]
                if r["kind"] == "eval") for i in range(len(seeds))]
    targets = [target if target is not None else round(target_frac * b, 4) for b in best]
    rows = []
    per_seed = {side: [summarise(recs, t) for recs, t in zip(runs[side], targets)]
                for side in SIDES}
    for side in SIDES:
        s = per_seed[side]
        rows.append({
            "estimator": side,
            "per_seed_episodes_to_target": [x["rollouts_to_target"] for x in s],
            "per_seed_tokens_to_target": [x["tokens_to_target"] for x in s],
            "per_seed_seconds_to_target": [x["seconds_to_target"] for x in s],
            "seeds_reaching_target": sum(x["rollouts_to_target"] is not None for x in s),
            "final_success": statistics.median(x["final_accuracy"] for x in s),
            "best_success": statistics.median(x["best_accuracy"] for x in s)})
    ratios = [g["rollouts_to_target"] and r["rollouts_to_target"]
              and r["rollouts_to_target"] / g["rollouts_to_target"]
              for g, r in zip(per_seed["gigpo"], per_seed["grpo"])]
    if out is None:
        shutil.rmtree(work, ignore_errors=True)
    curves = {side: [[r["rollouts"], r["eval_accuracy"]] for r in runs[side][0]
                     if r["kind"] == "eval"] for side in SIDES}
    return {"benchmark": "B-agents: GiGPO vs GRPO on the guess game", "model": model,
            "seeds": list(seeds), "steps": steps, "eval_every": eval_every,
            "targets_per_seed": targets,
            "target_rule": "given" if target is not None else f"{target_frac} x best of both",
            "episodes_per_step": 32 if model != "tiny" else 64, "estimators": rows,
            "grpo_over_gigpo_episodes": ratios,
            "median_grpo_over_gigpo_episodes": statistics.median(
                [x for x in ratios if x]) if any(ratios) else None,
            "curves": {"held-out success vs episodes": {"x": "episodes", "y": "greedy success",
                                                        "series": curves}}}


def command(*, model: str, json: Path | None, seeds: int, steps: int, eval_every: int,
            target: float | None, target_frac: float, set_: list[str] | None, threads: int) -> None:
    """`rollwise bench agents`: run it, print the tables, write `json` (and its page)."""
    data = run(model, seeds=tuple(range(seeds)), steps=steps, eval_every=eval_every,
               target=target, target_frac=target_frac,
               extra=[f"run.threads={threads}", *(set_ or [])], progress=say)
    print_table(f"GiGPO vs GRPO on guess-the-number: {model}, targets "
                f"{data['targets_per_seed']}", data["estimators"],
                ["estimator", "per_seed_episodes_to_target", "per_seed_tokens_to_target",
                 "per_seed_seconds_to_target", "seeds_reaching_target", "final_success",
                 "best_success"])
    typer.echo(f"GRPO episodes / GiGPO episodes to target, per seed: "
               f"{data['grpo_over_gigpo_episodes']} (median "
               f"{data['median_grpo_over_gigpo_episodes']})")
    save_results(data, json)
