"""The step-measuring parts shared by the end-to-end benchmark's sides (rollwise variants
in bench/e2e.py, TRL in bench/e2e_trl.py): a variant's config, a side stepped through the
driver, and the medians and paired ratios of their step records. Its own module so that
e2e.py and e2e_trl.py both import it and neither imports the other at load time."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PHASES = ("rollout", "reward", "train", "other")


def variant_config(path: Path, name: str, overrides: tuple[str, ...] | list[str], out: Path,
                   extra: list[str] | None = None, **run_keys: Any):
    """The config of one variant: the file, the variant's overrides, then `extra` (applies to
    every variant), then the run keys the benchmark sets (name, output dir, steps...)."""
    from rollwise.compose.config import load_config

    keys = {"name": f"'{Path(path).stem}-{name}'", "output_dir": f"'{out}'", "overwrite": "true",
            **run_keys}
    return load_config(path, [*overrides, *(extra or []), *(f"run.{k}={v}" for k, v in
                                                             keys.items())])


@dataclass
class Side:
    """One variant built for stepping: its stages and run directory."""

    name: str
    stages: Any
    run: Any
    num_steps: int
    done: int = 0
    clock: float = 0.0  # the run's training seconds after the last step

    @classmethod
    def build(cls, name: str, cfg) -> Side:
        from rollwise.pipeline.build import build
        from rollwise.run.rundir import new_run

        stages = build(cfg)
        run = new_run(Path(cfg.run.output_dir) / cfg.run.name, echo=lambda s: None)
        return cls(name, stages, run, cfg.run.num_steps)

    def step(self) -> dict[str, Any]:
        """One training step through the driver's `train_step`; its record plus counters."""
        from rollwise.pipeline.loop import train_step

        stats = getattr(self.stages.engine, "stats", None)
        before = _engine_counters(stats)
        record = train_step(self.stages, self.run, self.done, self.num_steps)
        self.done += 1
        after = _engine_counters(stats)
        record["engine_forward_passes"] = after[0] - before[0] if stats else None
        # the step's own wall time (the run's clock); the phases and `other` partition it
        record["time_step"] = record["wall_time"] - self.clock
        self.clock = record["wall_time"]
        return record

    def close(self) -> None:
        self.run.store.close()
        self.run.metrics.close()


def _engine_counters(stats) -> tuple[int, int]:
    return (stats.forward_passes, stats.generated_tokens) if stats is not None else (0, 0)


def step_row(name: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of one side's step records (warm-up already dropped) and its counters.

    >>> r = step_row("x", [{"time_rollout": 1.0, "time_train": 3.0, "time_step": 4.0,
    ...                     "step_tokens": 10, "rows_trained": 8.0},
    ...                    {"time_rollout": 2.0, "time_train": 5.0, "time_step": 7.0,
    ...                     "step_tokens": 12, "rows_trained": 0.0}])
    >>> r["step_s"], r["rollout_s"], r["train_s"], r["reward_s"], r["tokens_per_step"]
    (5.5, 1.5, 4.0, 0.0, 11.0)
    """
    def med(key: str) -> float:
        return statistics.median(float(r.get(key) or 0.0) for r in records)

    row: dict[str, Any] = {"variant": name, "steps": len(records), "step_s": med("time_step")}
    row |= {f"{p}_s": med(f"time_{p}") for p in PHASES}
    row |= {"step_min_s": min(r["time_step"] for r in records),
            "step_max_s": max(r["time_step"] for r in records),
            "tokens_per_step": med("step_tokens"), "rows_trained_per_step": med("rows_trained"),
            "rows_skipped_per_step": med("rows_skipped_zero_adv"),
            "zero_var_frac": med("zero_var_frac")}
    passes = [r["engine_forward_passes"] for r in records if r.get("engine_forward_passes")]
    row["engine_forward_passes_per_step"] = statistics.median(passes) if passes else None
    return row


def paired_ratios(base: list[dict[str, Any]], other: list[dict[str, Any]],
                  key: str) -> dict[str, float] | None:
    """Median, min and max of base[i][key] / other[i][key] over paired steps.

    >>> paired_ratios([{"t": 4.0}, {"t": 6.0}, {"t": 9.0}],
    ...               [{"t": 2.0}, {"t": 2.0}, {"t": 3.0}], "t")
    {'median': 3.0, 'min': 2.0, 'max': 3.0, 'n': 3}
    """
    ratios = [b[key] / o[key] for b, o in zip(base, other) if b.get(key) and o.get(key)]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "n": len(ratios)}


def summarise_steps(config: str, kept: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Rows per variant and paired ratios of each variant against the first (the baseline)."""
    names = list(kept)
    rows = [step_row(n, kept[n]) | {"config": config} for n in names]
    base = names[0]
    ratios = {f"{base}_over_{n}": {k: paired_ratios(kept[base], kept[n], f"time_{k}")
                                   for k in ("step", "rollout", "train")}
              for n in names[1:]}
    return {"config": config, "variants": rows, "ratios": ratios,
            "per_step": {n: [{k: r.get(k) for k in ("step", "time_step", *[
                f"time_{p}" for p in PHASES], "step_tokens", "rows_trained",
                "rows_skipped_zero_adv", "zero_var_frac")} for r in kept[n]] for n in names}}
