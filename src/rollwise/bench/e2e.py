"""B3, end to end: where a training step's time goes, and time to accuracy.

Each part compares *variants* of one training config (a TOML file plus `--set` overrides):

- `baseline`: the plain synchronous configuration: Hugging Face `generate` as the engine,
  every row through the learner (no zero-advantage skip), float32 learner.
- `best`: the config as shipped (native engine: continuous batching, shared prompt prefix,
  log-probs from the engine; zero-advantage rows skipped; the config's precision).
- with `--precision`, instead: `float32` (engine and learner in float32) against `bfloat16`
  (bfloat16 rollouts, bfloat16-autocast learner, token TIS); see `PRECISIONS`.

Parts:

- **steps**: `warmup + steps` training steps per variant, alternating variant by variant in
  one process (the first to go alternates too), warm-up steps dropped. A step's wall time is
  split into rollout / reward / train (the learner: advantages and update) / other, as the
  driver records it. Medians per variant, and per-step paired ratios baseline / variant
  (median, min, max). Beside the wall times, deterministic counters: tokens generated, rows
  through the learner, zero-advantage rows skipped.
- **time to accuracy**: each variant trained from the same start through the real driver
  with a held-out greedy evaluation every `eval_every` steps; training wall time (evaluation
  excluded), rollouts and tokens at the first evaluation at or above the target, and the
  curves (accuracy against wall time and against rollouts). Variants run one after another
  (a whole run cannot alternate), so these wall times are more exposed to machine load than
  the step medians; the rollouts and tokens are not.

`--vs trl` (bench/e2e_trl.py) adds TRL's GRPOTrainer to the steps part.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from rollwise.bench.common import print_table, save_results, say
from rollwise.bench.sides import (  # noqa: F401 (re-exported: the benchmark's public names)
    PHASES,
    Side,
    paired_ratios,
    step_row,
    summarise_steps,
    variant_config,
)

BASELINE = ("engine.name='hf'", "engine.dtype='float32'", "learner.skip_zero_advantage=false",
            "learner.precision='float32'", "learner.share_prompts=false")
DEFAULT_VARIANTS: dict[str, tuple[str, ...]] = {"baseline": BASELINE, "best": ()}
# the precision axis (`--precision`): float32 everywhere against bfloat16 rollouts, bfloat16
# autocast learner and token TIS, and against int8 rollouts with a float32 learner and TIS,
# all on the native engine (docs/precision.md)
PRECISIONS: dict[str, tuple[str, ...]] = {
    "float32": ("engine.name='native'", "engine.dtype='float32'",
                "learner.precision='float32'", "algorithm.correction='none'"),
    "bfloat16": ("engine.name='native'", "engine.dtype='bfloat16'",
                 "learner.precision='bf16-autocast'", "algorithm.correction='tis'"),
    "int8": ("engine.name='native'", "engine.dtype='int8'",
             "learner.precision='float32'", "algorithm.correction='tis'"),
}


def alternate(sides: list, rounds: int, progress: Callable[[str], None]) -> dict[str, list]:
    """`rounds` steps of every side, one side after another; the side that goes first
    rotates each round, so no side always runs on a machine its predecessor warmed."""
    records: dict[str, list] = {s.name: [] for s in sides}
    for i in range(rounds):
        order = sides[i % len(sides):] + sides[: i % len(sides)]
        for side in order:
            rec = side.step()
            records[side.name].append(rec)
            progress(f"round {i + 1}/{rounds} {side.name}: step {rec['time_step']:.1f}s "
                     f"(rollout {rec.get('time_rollout', 0):.1f}s, "
                     f"train {rec.get('time_train', 0):.1f}s)")
    return records


def run_steps(path: Path, variants: dict[str, tuple[str, ...]], *, steps: int = 5,
              warmup: int = 1, extra: list[str] | None = None, out: Path,
              progress: Callable[[str], None] = print) -> dict[str, Any]:
    """The steps part for one config file (see the module docstring)."""
    sides = []
    for name, overrides in variants.items():
        cfg = variant_config(path, name, overrides, out, extra, num_steps=warmup + steps)
        sides.append(Side.build(name, cfg))
    try:
        records = alternate(sides, warmup + steps, progress)
    finally:
        for s in sides:
            s.close()
    kept = {name: recs[warmup:] for name, recs in records.items()}
    return summarise_steps(str(path), kept)


def run_accuracy(path: Path, variants: dict[str, tuple[str, ...]], *, steps: int | None = None,
                 eval_every: int | None = None, target: float | None = None,
                 target_frac: float = 0.9, extra: list[str] | None = None, out: Path,
                 progress: Callable[[str], None] = print) -> dict[str, Any]:
    """The time-to-accuracy part for one config file; `steps` and `eval_every` default to the
    file's. The target defaults to `target_frac` of the baseline's best accuracy."""
    from rollwise.bench.alloc import summarise, train_one

    runs: dict[str, list[dict[str, Any]]] = {}
    for name, overrides in variants.items():
        keys = {} if steps is None else {"num_steps": steps}
        every = [] if eval_every is None else [f"eval.every={eval_every}"]
        cfg = variant_config(path, name, overrides, out, [*(extra or []), *every], **keys)
        progress(f"{Path(path).stem} {name}: {cfg.run.num_steps} steps, eval every "
                 f"{cfg.eval.every}")
        runs[name] = train_one(cfg)
    base = next(iter(runs))
    best_base = max(r["eval_accuracy"] for r in runs[base] if r["kind"] == "eval")
    goal = target if target is not None else round(target_frac * best_base, 4)
    rows = []
    for name, recs in runs.items():
        s = summarise(recs, goal)
        first = next(r for r in recs if r["kind"] == "eval")
        rows.append({"variant": name, "config": str(path),
                     "accuracy_before": first["eval_accuracy"], **s,
                     "train_seconds": max(r["wall_time"] for r in recs)})
    for row in rows:
        b = rows[0]
        for key in ("seconds_to_target", "rollouts_to_target", "tokens_to_target"):
            ok = b[key] and row[key]
            row[f"{key.split('_')[0]}_speedup"] = b[key] / row[key] if ok else None
    return {"config": str(path), "target": goal,
            "target_rule": "given" if target is not None else f"{target_frac} x baseline's best",
            "variants": rows, "curves": _accuracy_curves(Path(path).stem, runs)}


def _accuracy_curves(stem: str, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    evals = {n: [r for r in recs if r["kind"] == "eval"] for n, recs in runs.items()}
    return {
        f"{stem}: held-out accuracy vs training wall time": {
            "x": "training seconds", "y": "greedy accuracy",
            "series": {n: [[r["wall_time"], r["eval_accuracy"]] for r in e]
                       for n, e in evals.items()}},
        f"{stem}: held-out accuracy vs rollouts": {
            "x": "rollouts", "y": "greedy accuracy",
            "series": {n: [[r["rollouts"], r["eval_accuracy"]] for r in e]
                       for n, e in evals.items()}},
    }


def machine() -> dict[str, Any]:
    """CPU model and kind (its best vector ISA from its flags, torch's dispatch and any
    environment cap on it: a capped run is not a real CPU of the lower kind), cores, torch
    version and threads, for the report."""
    import os

    import torch

    from rollwise.compose.precision import _ISA_CAPS, best_isa, cpu_name

    return {"cpu": cpu_name(), "cpu_kind": best_isa(),
            "dispatch": torch.backends.cpu.get_cpu_capability(),
            "caps": {k: os.environ[k] for k in _ISA_CAPS if k in os.environ},
            "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def run(configs: list[Path], *, parts: tuple[str, ...] = ("steps", "accuracy"),
        variants: dict[str, tuple[str, ...]] | None = None, steps: int = 5, warmup: int = 1,
        accuracy_steps: int | None = None, eval_every: int | None = None,
        target: float | None = None, target_frac: float = 0.9, extra: list[str] | None = None,
        vs_trl: bool = False, trl_options: dict[str, Any] | None = None,
        progress: Callable[[str], None] = print) -> dict[str, Any]:
    """B3 over each config file: the parts asked for, and TRL alongside when `vs_trl`."""
    variants = dict(variants or DEFAULT_VARIANTS)
    data: dict[str, Any] = {"benchmark": "B3 end to end", "variants": {
        k: list(v) for k, v in variants.items()}, "extra": list(extra or []),
        "step_split": [], "time_to_accuracy": [], "curves": {}}
    with tempfile.TemporaryDirectory(prefix="rollwise-b3-") as tmp:
        out = Path(tmp)
        for path in configs:
            if "steps" in parts and not vs_trl:
                data["step_split"].append(run_steps(path, variants, steps=steps, warmup=warmup,
                                                    extra=extra, out=out, progress=progress))
            if vs_trl:
                from rollwise.bench.e2e_trl import run_vs_trl

                data["step_split"].append(run_vs_trl(
                    path, variants, steps=steps, warmup=warmup, extra=extra, out=out,
                    trl_options=trl_options or {}, progress=progress))
            if "accuracy" in parts:
                acc = run_accuracy(path, variants, steps=accuracy_steps, eval_every=eval_every,
                                   target=target, target_frac=target_frac, extra=extra,
                                   out=out, progress=progress)
                data["curves"] |= acc.pop("curves")
                data["time_to_accuracy"].append(acc)
    data["machine"] = machine()
    return data


def compare_runs(run_dirs: list[Path]) -> dict[str, Any]:
    """Finished run directories side by side (e.g. the float32 and bfloat16 quickstarts,
    docs/precision.md): accuracy before/after, training time, per-step medians (time split,
    mismatch metrics of the correction, publication cost), and their curves in one page."""
    import json

    runs: dict[str, list[dict[str, Any]]] = {}
    rows = []
    for d in map(Path, run_dirs):
        recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x]
        runs[d.name] = recs
        train = [r for r in recs if r["kind"] == "train"]
        evals = [r for r in recs if r["kind"] == "eval"]

        def med(key: str, train=train) -> float | None:
            values = [float(r[key]) for r in train if r.get(key) is not None]
            return statistics.median(values) if values else None

        rows.append({"run": d.name, "steps": len(train),
                     "accuracy_before": evals[0]["eval_accuracy"] if evals else None,
                     "accuracy_after": evals[-1]["eval_accuracy"] if evals else None,
                     "best_accuracy": max((r["eval_accuracy"] for r in evals), default=None),
                     "train_seconds": max((r["wall_time"] for r in recs), default=0.0),
                     **{f"{k}_s": med(f"time_{k}") for k in ("rollout", "train")},
                     "publish_s": med("publish_seconds"),
                     **{k: med(f"correction_{k}") for k in (
                         "kl", "kl_k1", "weight_mean", "weight_max", "clipped_frac", "ess")}})
    curves = _accuracy_curves("runs", runs)
    curves["runs: training reward vs step"] = {
        "x": "step", "y": "mean reward",
        "series": {n: [[r["step"], r["reward_mean"]] for r in recs if r["kind"] == "train"]
                   for n, recs in runs.items()}}
    return {"benchmark": "run comparison", "runs": rows, "curves": curves,
            "machine": machine()}


def command(*, configs: list[Path] | None, json: Path | None, part: list[str] | None, steps: int,
            warmup: int, accuracy_steps: int | None, eval_every: int | None, target: float | None,
            target_frac: float, set_: list[str] | None, baseline_set: list[str] | None,
            best_set: list[str] | None, precision: bool, vs: str | None, trl_set: list[str] | None,
            no_baseline: bool) -> None:
    """`rollwise bench e2e`: run it, print the tables, write `json` (and its page)."""
    from rollwise.compose.config import parse_value

    if vs not in (None, "trl"):
        raise typer.BadParameter(f"--vs {vs!r}: only 'trl' is supported")
    parts = tuple(part or ("steps", "accuracy"))
    bad = [p for p in parts if p not in ("steps", "accuracy")]
    if bad:
        raise typer.BadParameter(f"--part {bad[0]!r}: use steps or accuracy")
    variants = {"baseline": tuple(baseline_set) if baseline_set is not None else BASELINE,
                "best": tuple(best_set or ())}
    if precision:
        variants = dict(PRECISIONS)
    elif no_baseline:
        variants.pop("baseline")
    trl_options = {k.strip(): parse_value(v.strip())
                   for k, v in (item.split("=", 1) for item in trl_set or [])}
    paths = configs or [Path("configs/tiny_arith.toml"), Path("configs/quickstart.toml")]
    data = run(paths, parts=parts, variants=variants, steps=steps, warmup=warmup,
               accuracy_steps=accuracy_steps, eval_every=eval_every, target=target,
               target_frac=target_frac, extra=list(set_ or []), vs_trl=vs == "trl",
               trl_options=trl_options, progress=say)
    for s in data["step_split"]:
        print_table(f"B3 step time: {s['config']} (median of {steps} steps)", s["variants"],
                    ["variant", "step_s", "rollout_s", "reward_s", "train_s", "other_s",
                     "tokens_per_step", "rows_trained_per_step", "rows_skipped_per_step"])
        for name, r in s["ratios"].items():
            typer.echo(f"{name}: " + ", ".join(
                f"{k} {v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})"
                for k, v in r.items() if v))
    for a in data["time_to_accuracy"]:
        print_table(f"B3 time to {a['target']:.3f} held-out accuracy: {a['config']}",
                    a["variants"], ["variant", "accuracy_before", "final_accuracy",
                                    "best_accuracy", "seconds_to_target", "rollouts_to_target",
                                    "tokens_to_target", "seconds_speedup", "train_seconds"])
    save_results(data, json)


def compare_command(*, runs: list[Path], json: Path | None) -> None:
    """`rollwise bench compare`: run it, print the tables, write `json` (and its page)."""
    data = compare_runs(runs)
    print_table("runs compared", data["runs"],
                ["run", "accuracy_before", "accuracy_after", "best_accuracy", "train_seconds",
                 "rollout_s", "train_s", "publish_s", "kl", "weight_mean", "clipped_frac"])
    save_results(data, json)
