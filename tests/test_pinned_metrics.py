"""Behaviour pinned across refactors: short tiny runs give the metrics recorded before.

The fixture (tests/data/pinned_metrics.json) was written by this file's `_write` with the
code as it was before the stage/record refactor (issue 15). Every figure that does not
measure time is compared. Float32 on one thread: the same seeds take the same arithmetic
path, so sums of the same products in the same order give the same bits; the tolerance
(1e-9 relative) only absorbs a differently ordered Python float sum over a step's records.
To re-record after an intended change: ROLLWISE_PIN_WRITE=1 pytest tests/test_pinned_metrics.py
(the quickstart pin, on SmolLM2, is slow: `-m slow`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from rollwise.pipeline.build import build
from rollwise.compose.config import load_config, to_toml
from rollwise.pipeline.loop import train
from rollwise.run.rundir import Run

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"
FIXTURE = Path(__file__).parent / "data" / "pinned_metrics.json"
QUICKSTART = Path(__file__).parents[1] / "configs" / "quickstart.toml"
QUICKSTART_FIXTURE = Path(__file__).parent / "data" / "pinned_quickstart.json"

# Each variant walks a different path through the stages: the default native scheduler,
# the HF engine's plain generation, partial rollouts with speculative reuse (pool carried
# across steps) and the adaptive allocator's extra rounds.
VARIANTS = {
    "default": [],
    "hf": ["rollout.engine='hf'"],
    "partial_reuse": ["rollout.strategy='partial'", "rollout.spec_reuse=true"],
    "dynamic": ["control.allocator='dynamic'"],
}
# measurements of this machine, not arithmetic: times, and the process's memory peaks
TIMING = ("time_", "wall_time", "_per_s", "seconds", "makespan", "tail_s", "eta", "peak_rss_",
          "cuda_max_allocated")


def _run(tmp_path: Path, extra: list[str], config: Path = CONFIG) -> list[dict]:
    cfg = load_config(config, [f"run.output_dir='{tmp_path}'", "run.num_steps=6",
                               "run.threads=1", "rollout.prompts_per_step=6",
                               "task.num_eval=24", "eval.every=3", *extra])
    stages = build(cfg)
    run = Run(tmp_path / cfg.run.name, resume=False, config_toml=to_toml(cfg),
              echo=lambda s: None)
    train(stages, run, cfg.run.num_steps, eval_every=cfg.eval.every)
    lines = (tmp_path / cfg.run.name / "metrics.jsonl").read_text().splitlines()
    return [_figures(json.loads(x)) for x in lines]


def _figures(record: dict) -> dict:
    return {k: v for k, v in sorted(record.items())
            if k == "kind" or (isinstance(v, (int, float)) and not any(t in k for t in TIMING))}


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_metrics_match_the_pinned_run(tmp_path, variant):
    records = _run(tmp_path, VARIANTS[variant])
    if os.environ.get("ROLLWISE_PIN_WRITE"):
        pinned = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
        pinned[variant] = records
        FIXTURE.write_text(json.dumps(pinned, indent=1, sort_keys=True) + "\n")
        return
    expected = json.loads(FIXTURE.read_text())[variant]
    assert len(records) == len(expected)
    for got, want in zip(records, expected, strict=True):
        assert sorted(got) == sorted(want), (got.get("step"), set(got) ^ set(want))
        diff = {k: (got[k], want[k]) for k in want if not _same(got[k], want[k])}
        assert not diff, f"step {want.get('step')} ({want.get('kind')}): {diff}"
    train_steps = [r for r in expected if r["kind"] == "train"]
    assert len(train_steps) == 6 and any(r["loss"] != 0 for r in train_steps)


@pytest.mark.slow
def test_quickstart_first_steps_match_the_pinned_run(tmp_path):
    """The quickstart's first two steps on SmolLM2, in float32. Float32 kernels differ
    between CPU kinds (vector width changes summation order, and sampling amplifies the
    last bit), so the pins are recorded per kind: (torch's CPU capability, torch version)."""
    import torch

    kind = f"{torch.backends.cpu.get_cpu_capability()} torch {torch.__version__}"
    records = _run(tmp_path, ["run.num_steps=2", "rollout.prompts_per_step=4",
                              "task.num_eval=16", "eval.every=0", "rollout.dtype='float32'",
                              "learner.precision='float32'", "algorithm.correction='none'"],
                   config=QUICKSTART)
    pinned = json.loads(QUICKSTART_FIXTURE.read_text()) if QUICKSTART_FIXTURE.exists() else {}
    if os.environ.get("ROLLWISE_PIN_WRITE"):
        pinned[kind] = records
        QUICKSTART_FIXTURE.write_text(json.dumps(pinned, indent=1, sort_keys=True) + "\n")
        return
    if kind not in pinned:
        pytest.skip(f"no quickstart pin recorded for {kind} (recorded: {sorted(pinned)}); "
                    "ROLLWISE_PIN_WRITE=1 records one")
    for got, want in zip(records, pinned[kind], strict=True):
        diff = {k: (got.get(k), want[k]) for k in want if not _same(got.get(k), want[k])}
        assert not diff, f"step {want.get('step')} ({want.get('kind')}): {diff}"
    assert [r["kind"] for r in records].count("train") == 2
