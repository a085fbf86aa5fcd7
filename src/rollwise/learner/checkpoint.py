"""Checkpoints: trainable weights in safetensors, optimizer and RNG state, run state as JSON.

    checkpoints/step_N/model.safetensors   trainable parameters (all, or the LoRA adapters)
    checkpoints/step_N/optimizer.pt        optimizer + scheduler state
    checkpoints/step_N/rng.pt              torch / python / numpy RNG states
    checkpoints/step_N/state.json          step, policy version, data cursor, counters
A checkpoint is written to a temporary folder and renamed, so a crash never leaves half of one.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().contiguous().cpu() for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(folder: Path, model, learner_state: dict, state: dict, keep: int = 2) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step_{state['step']}"
    tmp = folder / f".tmp_step_{state['step']}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(trainable_state(model), tmp / "model.safetensors")
    torch.save(learner_state, tmp / "optimizer.pt")
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(),
                "numpy": np.random.get_state()}, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in list_checkpoints(folder)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob("step_*") if (p / "state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def load_checkpoint(path: Path, model) -> tuple[dict, dict]:
    """Restore weights and RNG into place; return (learner_state, run state)."""
    weights = load_file(path / "model.safetensors")
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in weights]
    if missing:
        raise ValueError(f"{path}: checkpoint lacks parameters {missing[:3]}; was it saved "
                         "with another model or LoRA setting?")
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)
    rng = torch.load(path / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    learner_state = torch.load(path / "optimizer.pt", weights_only=False)
    return learner_state, json.loads((path / "state.json").read_text())
