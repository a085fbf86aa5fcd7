"""Helpers the run-level tests share: train a config into a run directory, read its records."""

from __future__ import annotations

import json
from pathlib import Path

from rollwise.compose.config import to_toml
from rollwise.pipeline.build import build, run_steps
from rollwise.pipeline.loop import train
from rollwise.run.rundir import Run


def records(root: Path, kind: str | None = None) -> list[dict]:
    """The metrics.jsonl records of a run (of one kind: "train", "eval")."""
    out = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    return [r for r in out if kind is None or r["kind"] == kind]


def run_config(cfg, name: str, *, stages=None, resume: bool = False) -> dict:
    """Train `cfg` into <output_dir>/<name> (resumed when `resume`); the run's summary.
    The stages are closed at the end, as the front ends close them."""
    cfg.run.name = name
    stages = stages or build(cfg)
    run = Run(Path(cfg.run.output_dir) / name, resume=resume, config_toml=to_toml(cfg),
              echo=lambda s: None)
    try:
        return train(stages, run, cfg.run.num_steps, eval_every=cfg.eval.every,
                     checkpoint_every=cfg.run.checkpoint_every, steps=run_steps(cfg))
    finally:
        stages.close()
