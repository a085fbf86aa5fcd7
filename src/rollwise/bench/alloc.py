"""B4, allocation efficiency: rollouts, tokens and wall time until held-out accuracy reaches a
target, for each allocator against `uniform` (GRPO with a fixed group size), on a task of
mixed difficulty, with the same per-step budget, steps and seeds.

Each allocator trains a fresh policy (the same warm start) through the real driver; held-out
greedy accuracy is measured every `eval_every` steps. `rollouts_to_target` is the cumulative
rollouts at the first evaluation where the running mean of the last `smooth` evaluations is at
or above the target (None if never reached); smoothing keeps one lucky evaluation from
deciding the crossing. The target defaults to `target_frac` of uniform's best smoothed
accuracy on the same seed, so every allocator is compared at a level the baseline reaches.
The training pool is `train_prompts` prompts (few enough that prompts come back, so the
allocators' per-prompt history carries information: docs/allocation.md says why), evaluated
on `eval_prompts` held-out prompts. An allocator is named alone (`aero`) or with options
(`aero:n0=2,max_n=8`, read as control.allocator_options). Figures are medians over seeds
(None when a seed never reached its target); speedups are medians of per-seed ratios
uniform / allocator over the seeds both reached.

Imports: bench.common (tables, results), compose.config, pipeline and run (inside the
functions that train).
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from rollwise.bench.common import print_table, save_results, say

DEFAULT_ALLOCATORS = ("uniform", "dynamic", "thompson", "pilot_commit", "dars", "vcrl", "gdro",
                      "aero", "xrpo", "hive")
# The regime (docs/allocation.md, B4): a small pool revisited over several epochs, held-out
# evaluation on enough prompts and often enough that the crossing has resolution.
TRAIN_PROMPTS, EVAL_PROMPTS, EVAL_EVERY, SMOOTH = 512, 400, 5, 3
# one-digit sums (mostly solved after the warm start) mixed with two-digit ones (learnt
# during the run on every seed measured); the 2026-12-04 regime used two-digit only
LEVELS = '["1x2", "2x2"]'


def parse_allocator(spec: str) -> tuple[str, dict[str, Any]]:
    """'aero:n0=2,max_n=8' -> ('aero', {'n0': 2, 'max_n': 8}); values are read as TOML
    scalars (a bare word is a string).

    >>> parse_allocator("aero:n0=2,rescue_prob=0.9"), parse_allocator("dars")
    (('aero', {'n0': 2, 'rescue_prob': 0.9}), ('dars', {}))
    """
    import tomllib

    name, _, rest = spec.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"allocator {spec!r}: option {item!r} is not key=value")
        try:
            options[key.strip()] = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            options[key.strip()] = value.strip()
    return name.strip(), options


def bench_config(model: str, allocator: str, seed: int, steps: int, eval_every: int,
                 out: Path, extra: list[str] | None = None, train_prompts: int = TRAIN_PROMPTS,
                 eval_prompts: int = EVAL_PROMPTS):
    """The B4 training config: sums of two one-digit or two two-digit numbers (arith_mix,
    levels 1x2 and 2x2) for the tiny model, with configs/tiny_arith.toml's warm start recipe
    (cached per training pool) and learning rate. Difficulty is mixed at the prompt level:
    after the warm start most one-digit sums are always solved, some two-digit ones never,
    the rest in between (uniform's zero-advantage fraction measures it). `allocator` may
    carry options ('aero:n0=2'). The earlier regime, two-digit sums only: `--set
    task.name='arith' --set task.options={digits=2,terms=2}`."""
    from rollwise.compose.config import load_config

    name, options = parse_allocator(allocator)
    inline = ", ".join(f"{k} = {json.dumps(v)}" for k, v in options.items())
    label = allocator.replace(":", "-").replace(",", "-").replace("=", "_")
    overrides = [
        f"run.name='{label}-s{seed}'", f"run.output_dir='{out}'", f"run.seed={seed}",
        f"run.num_steps={steps}", "run.overwrite=true", f"model.name='{model}'",
        "task.name='arith_mix'", f"task.options={{levels={LEVELS}}}",
        f"task.num_train={train_prompts}", f"task.num_eval={eval_prompts}",
        "rollout.prompts_per_step=16", "rollout.group_size=8", "rollout.max_tokens=16",
        "learner.lr=4e-4", "learner.warmup_steps=10", f"eval.every={eval_every}",
        f"control.allocator='{name}'", f"control.allocator_options={{{inline}}}",
    ]
    if model != "tiny":
        overrides += ["rollout.max_tokens=96", "learner.lr=1e-5", "rollout.temperature=0.7"]
    return load_config(None, overrides + list(extra or []))


def train_one(cfg) -> list[dict[str, Any]]:
    """Train one config; its metrics records (train and eval lines)."""
    from rollwise.pipeline.build import build
    from rollwise.pipeline.loop import train
    from rollwise.run.rundir import new_run

    stages = build(cfg)
    run = new_run(Path(cfg.run.output_dir) / cfg.run.name, echo=lambda s: None)
    root = run.root
    train(stages, run, cfg.run.num_steps, eval_every=cfg.eval.every)
    return [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]


def smoothed(evals: list[dict[str, Any]], smooth: int = 1) -> list[float]:
    """The running mean of the last `smooth` held-out accuracies at each evaluation (fewer at
    the start).

    >>> smoothed([{"eval_accuracy": a} for a in (0.1, 0.5, 0.3)], 2)
    [0.1, 0.3, 0.4]
    """
    acc = [r["eval_accuracy"] for r in evals]
    return [statistics.fmean(acc[max(0, i + 1 - smooth): i + 1]) for i in range(len(acc))]


def best_smoothed(records: list[dict[str, Any]], smooth: int = 1) -> float:
    """The best running-mean held-out accuracy of a run (what the default target scales)."""
    return max(smoothed([r for r in records if r["kind"] == "eval"], smooth))


def summarise(records: list[dict[str, Any]], target: float, smooth: int = 1) -> dict[str, Any]:
    """Cost to the first evaluation whose running mean over the last `smooth` evaluations is
    at or above `target`, and whole-run allocation figures.

    >>> recs = [{"kind": "eval", "eval_accuracy": 0.2, "rollouts": 0, "tokens": 0,
    ...          "wall_time": 0.0},
    ...         {"kind": "train", "zero_adv_frac": 0.5},
    ...         {"kind": "eval", "eval_accuracy": 0.6, "rollouts": 128, "tokens": 900,
    ...          "wall_time": 2.0}]
    >>> s = summarise(recs, 0.5)
    >>> s["rollouts_to_target"], s["final_accuracy"], s["zero_adv_frac"]
    (128, 0.6, 0.5)
    >>> summarise(recs, 0.5, smooth=2)["rollouts_to_target"] is None  # mean 0.4
    True
    """
    evals = [r for r in records if r["kind"] == "eval"]
    steps = [r for r in records if r["kind"] == "train"]
    hit = next((r for r, m in zip(evals, smoothed(evals, smooth)) if m >= target), None)

    def mean(key: str) -> float | None:
        values = [r[key] for r in steps if key in r]
        return statistics.fmean(values) if values else None

    return {
        "rollouts_to_target": hit["rollouts"] if hit else None,
        "tokens_to_target": hit["tokens"] if hit else None,
        "seconds_to_target": hit["wall_time"] if hit else None,
        "steps_to_target": hit["step"] if hit and "step" in hit else None,
        "final_accuracy": evals[-1]["eval_accuracy"] if evals else None,
        "best_accuracy": max((r["eval_accuracy"] for r in evals), default=None),
        "zero_adv_frac": mean("zero_adv_frac"),
        "zero_adv_frac_trained": mean("zero_adv_frac_trained"),
        "effective_frac": mean("effective_frac"),
        "rollouts_per_step": mean("step_rollouts"),
        "seconds_per_step": (steps[-1]["wall_time"] / len(steps)
                             if steps and "wall_time" in steps[-1] else None),
        "calib_brier": mean("calib_brier"),
        "total_rollouts": steps[-1].get("rollouts", 0) if steps else 0,
    }


def _median(values: list[Any]) -> Any:
    """Median of the values, None if any is None (a seed that never reached the target)."""
    if not values or any(v is None for v in values):
        return None
    return statistics.median(values)


def _row(name: str, seeds_: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    """One allocator's table row: medians over seeds, per-seed costs, median speedups."""
    row = {"allocator": name, **{k: _median([s[k] for s in seeds_]) for k in seeds_[0]}}
    row["seeds_reaching_target"] = sum(1 for s in seeds_ if s["rollouts_to_target"])
    for key in ("rollouts_to_target", "tokens_to_target", "seconds_to_target"):
        ratios = [u[key] / s[key] for u, s in zip(base, seeds_) if u[key] and s[key]]
        row[f"{key.split('_')[0]}_speedup"] = statistics.median(ratios) if ratios else None
    for key in ("rollouts_to_target", "seconds_to_target", "zero_adv_frac", "final_accuracy"):
        row[f"per_seed_{key}"] = [s[key] for s in seeds_]
    return row


def run(model: str = "tiny", allocators: tuple[str, ...] = DEFAULT_ALLOCATORS,
        seeds: tuple[int, ...] = (0,), steps: int = 120, eval_every: int = EVAL_EVERY,
        target: float | None = None, target_frac: float = 0.9, extra: list[str] | None = None,
        out: Path | None = None, progress: Callable[[str], None] = print,
        train_prompts: int = TRAIN_PROMPTS, eval_prompts: int = EVAL_PROMPTS,
        smooth: int = SMOOTH) -> dict[str, Any]:
    """Train every allocator for every seed; the B4 results (see the module docstring)."""
    order = ["uniform", *[a for a in allocators if a != "uniform"]]
    work = Path(out) if out else Path(tempfile.mkdtemp(prefix="rollwise-b4-"))
    runs: dict[str, list[list[dict[str, Any]]]] = {}
    # seed by seed, every allocator in turn: on a shared machine the load drifts, and runs
    # close in time see similar load, so seconds ratios compare like with like
    for seed in seeds:
        for name in order:
            progress(f"{name} seed {seed}: {steps} steps")
            cfg = bench_config(model, name, seed, steps, eval_every, work, extra,
                               train_prompts, eval_prompts)
            budget = cfg.rollout.prompts_per_step * cfg.rollout.group_size
            runs.setdefault(name, []).append(train_one(cfg))
    given = target is not None
    # one target per seed: each seed has its own data split and warm start
    targets = [target if given else round(target_frac * best_smoothed(recs, smooth), 4)
               for recs in runs["uniform"]]
    per_seed = {name: [summarise(recs, t, smooth) for recs, t in zip(runs[name], targets)]
                for name in order}
    rows = [_row(name, per_seed[name], per_seed["uniform"]) for name in order]
    if out is None:
        shutil.rmtree(work, ignore_errors=True)
    return {"benchmark": "B4 allocation efficiency", "model": model,
            "target": statistics.median(targets), "targets_per_seed": targets,
            "target_rule": "given" if given else (
                f"{target_frac} x uniform's best running mean of {smooth} evaluations"),
            "steps": steps, "seeds": list(seeds), "budget_per_step": budget,
            "train_prompts": train_prompts, "eval_prompts": eval_prompts,
            "eval_every": eval_every, "smooth": smooth,
            "allocators": rows, "curves": _curves(runs)}


def _curves(runs: dict[str, list[list[dict[str, Any]]]]) -> dict[str, Any]:
    """Held-out accuracy against cumulative rollouts and the zero-advantage fraction per step
    (first seed of each allocator)."""
    acc = {name: [[r["rollouts"], r["eval_accuracy"]] for r in recs[0] if r["kind"] == "eval"]
           for name, recs in runs.items()}
    zero = {name: [[r["step"], r["zero_adv_frac"]] for r in recs[0] if r["kind"] == "train"]
            for name, recs in runs.items()}
    return {"held-out accuracy vs rollouts": {"x": "rollouts", "y": "greedy accuracy",
                                              "series": acc},
            "zero-advantage group fraction": {"x": "step", "y": "fraction", "series": zero}}


def command(*, model: str, json: Path | None, allocator: list[str] | None, seeds: int, steps: int,
            eval_every: int, target: float | None, target_frac: float, set_: list[str] | None,
            threads: int, train_prompts: int = TRAIN_PROMPTS, eval_prompts: int = EVAL_PROMPTS,
            smooth: int = SMOOTH) -> None:
    """`rollwise bench alloc`: run it, print the tables, write `json` (and its page)."""
    from rollwise.control import ALLOCATORS

    unknown = [a for a in allocator or [] if parse_allocator(a)[0] not in ALLOCATORS]
    if unknown:
        raise typer.BadParameter(f"unknown allocator {unknown[0]!r}; "
                                 f"available: {', '.join(ALLOCATORS)}")
    data = run(model, allocators=tuple(allocator or DEFAULT_ALLOCATORS),
               seeds=tuple(range(seeds)), steps=steps, eval_every=eval_every, target=target,
               target_frac=target_frac, extra=[f"run.threads={threads}", *(set_ or [])],
               progress=say, train_prompts=train_prompts, eval_prompts=eval_prompts,
               smooth=smooth)
    print_table(f"B4 allocation: {model}, target accuracy {data['target']:.3f}",
                data["allocators"],
                ["allocator", "rollouts_to_target", "rollouts_speedup", "seconds_speedup",
                 "seconds_to_target", "final_accuracy", "zero_adv_frac", "zero_adv_frac_trained",
                 "rollouts_per_step", "seeds_reaching_target"])
    save_results(data, json)
