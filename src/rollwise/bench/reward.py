"""`rollwise bench reward`: what the code sandbox costs per execution, per isolation level.

Every level is timed with the layers it uses here (Landlock, seccomp, the drop to nobody,
the candidate process the verdict is decided outside of); the target (mean <= 50 ms)
applies to the default level, the one detection picks. Each repetition runs every level once
over the same programs (pycode eval samples with their
reference solutions, so every test passes), alternating which level goes first, in one
process; per-execution wall times give mean, median and p95, and the ratios to the
limits-only level are medians over repetitions. Deterministic counters beside them:
executions, tests run and tests passed (equal when nothing went wrong).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from rollwise.bench.common import print_table, save_results, say

TARGET_MEAN_MS = 50.0


def run(executions: int = 40, reps: int = 3, levels: tuple[str, ...] = (),
        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Time `executions` sandboxed runs per level and repetition."""
    from rollwise.rewards.sandbox import (
        ISOLATION_LEVELS,
        SandboxLimits,
        detect_isolation,
        isolation_info,
    )
    from rollwise.tasks import make_task
    from rollwise.tasks.code import program_of

    detected = detect_isolation()  # the default backend here: the target applies to it
    works = []
    for level in levels or ISOLATION_LEVELS:
        try:
            detect_isolation(level)
            works.append(level)
        except RuntimeError:
            if progress:
                progress(f"{level}: not available here, skipped")
    task = make_task("pycode", seed=0, num_train=1, num_eval=executions, isolation="rlimits")
    programs = [(program_of(s.reference, s), s.meta["tests"], s.meta["entry_point"])
                for s in task.eval]
    limits = SandboxLimits()
    times, per_rep, counts = _time_levels(works, programs, limits, reps, progress)
    results = []
    base = "rlimits" if "rlimits" in works else works[0]
    for level in works:
        ms = sorted(1000 * t for t in times[level])
        ratio = statistics.median(a / b for a, b in zip(per_rep[level], per_rep[base]))
        results.append({"isolation": level, "mean_ms": statistics.fmean(ms),
                        "median_ms": statistics.median(ms),
                        "p95_ms": ms[min(len(ms) - 1, int(0.95 * len(ms)))],
                        f"over_{base}": ratio, **counts[level],
                        "default": level == detected,
                        "meets_target": statistics.fmean(ms) <= TARGET_MEAN_MS,
                        "layers": "; ".join(isolation_info(level)["layers"])})
    return {"benchmark": "reward", "executions_per_rep": executions, "reps": reps,
            "target_mean_ms": TARGET_MEAN_MS, "limits": limits.__dict__,
            "detected": isolation_info(), "results": results}


def _time_levels(works: list[str], programs: list[tuple[str, str, str]], limits, reps: int,
                 progress: Callable[[str], None] | None
                 ) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, dict]]:
    """Run every program under each level, the order alternating per repetition: seconds per
    execution, mean seconds per repetition, and executions/tests/passed, per level."""
    from rollwise.rewards.sandbox import run_tests

    times: dict[str, list[float]] = {lvl: [] for lvl in works}
    per_rep: dict[str, list[float]] = {lvl: [] for lvl in works}
    counts = {lvl: {"executions": 0, "tests": 0, "passed": 0} for lvl in works}
    for rep in range(reps):
        order = works if rep % 2 == 0 else list(reversed(works))
        for level in order:
            batch = []
            for code, tests, entry in programs:
                start = time.perf_counter()
                result = run_tests(code, tests, entry, limits, isolation=level)
                batch.append(time.perf_counter() - start)
                c = counts[level]
                c["executions"] += 1
                c["tests"] += result.total
                c["passed"] += result.passed
            times[level] += batch
            per_rep[level].append(statistics.fmean(batch))
            if progress:
                progress(f"rep {rep + 1}/{reps} {level}: mean "
                         f"{1000 * statistics.fmean(batch):.1f} ms")
    return times, per_rep, counts


def command(*, json: Path | None, executions: int, reps: int, isolation: list[str] | None) -> None:
    """`rollwise bench reward`: run it, print the tables, write `json` (and its page)."""
    data = run(executions=executions, reps=reps, levels=tuple(isolation or ()),
               progress=say)
    base = next(k for k in data["results"][0] if k.startswith("over_"))
    print_table(f"sandbox cost per execution (target mean <= {data['target_mean_ms']:g} ms)",
                data["results"], ["isolation", "mean_ms", "median_ms", "p95_ms", base,
                                  "executions", "tests", "passed", "default", "meets_target"])
    typer.echo(f"detected here: {data['detected']['isolation']}")
    save_results(data, json)
