"""Checkpoints: tensors in safetensors, everything else as JSON; nothing is ever unpickled.

    checkpoints/step_N/model.safetensors      trainable parameters (all, or the LoRA adapters)
    checkpoints/step_N/optimizer.safetensors  optimizer + scheduler tensors
    checkpoints/step_N/optimizer.json         their structure (tensors named, numbers inline)
    checkpoints/step_N/rng.json               torch / python / numpy RNG states
    checkpoints/step_N/state.json             step, policy version, data cursor, counters
    checkpoints/step_N/learner/               a sharded learner's optimizer state instead:
                                              one torch.distributed.checkpoint (DCP) folder,
                                              each rank's shard, loadable by any number

Why no pickle: a run directory is something people share, and `torch.load` of a pickle
runs whatever code the file names. safetensors and JSON can only hold data.

A checkpoint is written into a temporary folder, each file fsync'ed, then renamed into
place (and the parent folder fsync'ed), so a process killed at any instant leaves the
previous checkpoint whole and no half of the new one. Old checkpoints beyond `keep` are
removed only after the new one is in place.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rollwise.system.atomic import fsync_dir, fsync_file

LEARNER_DIR = "learner"  # a sharded learner's optimizer state, in a checkpoint


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().contiguous().cpu() for n, p in model.named_parameters()
            if p.requires_grad}


# -- a tree of dicts, lists, numbers and tensors as (JSON, {name: tensor}) -----------------

def encode_tree(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able form of `tree`; its tensors go into `tensors` under generated names.
    Non-string dict keys (optimizer state is keyed by parameter index) and tuples are
    tagged so that `decode_tree` gives back the same types.

    >>> t = {}; encode_tree({0: (1, 2.5), "s": None}, t)
    {'__items__': [[0, {'__tuple__': [1, 2.5]}], ['s', None]]}
    """
    if isinstance(tree, torch.Tensor):
        name = f"t{len(tensors)}"
        # no copy of a CPU tensor: written at once, and a copy of AdamW's moments would
        # double their memory at every checkpoint (the run's peak, at its end)
        tensor = tree.detach().cpu().contiguous()
        # a view of a larger storage is copied: safetensors writes whole, unshared storages
        tensors[name] = tensor.clone() if tensor.untyped_storage().nbytes() != tensor.nbytes \
            else tensor
        return {"__tensor__": name}
    if isinstance(tree, np.ndarray):
        return {"__ndarray__": tree.tolist(), "dtype": str(tree.dtype)}
    if isinstance(tree, np.generic):
        return tree.item()
    if isinstance(tree, dict):
        items = [[k, encode_tree(v, tensors)] for k, v in tree.items()]
        if all(isinstance(k, str) and not k.startswith("__") for k in tree):
            return dict(items)
        return {"__items__": items}
    if isinstance(tree, tuple):
        return {"__tuple__": [encode_tree(v, tensors) for v in tree]}
    if isinstance(tree, list):
        return [encode_tree(v, tensors) for v in tree]
    if isinstance(tree, bytes):
        return {"__bytes__": base64.b64encode(tree).decode("ascii")}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    raise TypeError(f"cannot store a {type(tree).__name__} in a checkpoint")


def decode_tree(data: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `encode_tree`.

    >>> decode_tree({'__items__': [[0, {'__tuple__': [1, 2.5]}]]}, {})
    {0: (1, 2.5)}
    """
    if isinstance(data, list):
        return [decode_tree(v, tensors) for v in data]
    if not isinstance(data, dict):
        return data
    if "__tensor__" in data:
        return tensors[data["__tensor__"]]
    if "__ndarray__" in data:
        return np.asarray(data["__ndarray__"], dtype=data["dtype"])
    if "__items__" in data:
        return {k: decode_tree(v, tensors) for k, v in data["__items__"]}
    if "__tuple__" in data:
        return tuple(decode_tree(v, tensors) for v in data["__tuple__"])
    if "__bytes__" in data:
        return base64.b64decode(data["__bytes__"])
    return {k: decode_tree(v, tensors) for k, v in data.items()}


def save_tree(folder: Path, stem: str, tree: Any) -> None:
    tensors: dict[str, torch.Tensor] = {}
    structure = encode_tree(tree, tensors)
    save_file(tensors, folder / f"{stem}.safetensors")
    (folder / f"{stem}.json").write_text(json.dumps(structure))


def load_tree(folder: Path, stem: str) -> Any:
    tensors = load_file(folder / f"{stem}.safetensors")
    return decode_tree(json.loads((folder / f"{stem}.json").read_text()), tensors)


# -- RNG state -------------------------------------------------------------------------

def rng_state() -> dict[str, Any]:
    """Every RNG the run draws from, as plain data (torch's as a uint8 tensor)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- checkpoints -----------------------------------------------------------------------

def save_checkpoint(folder: Path, model, learner_state: dict, state: dict, keep: int = 2,
                    rng: dict[str, Any] | None = None) -> Path:
    """Write checkpoints/step_N atomically; `rng` defaults to the current RNG state (the
    driver passes the state it had at the end of step N, see `rundir.Run.snapshot`)."""
    folder.mkdir(parents=True, exist_ok=True)
    step = state["step"]
    final, tmp = folder / f"step_{step}", folder / f".tmp_step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(trainable_state(model), tmp / "model.safetensors")
        learner_state = dict(learner_state)
        if "folder" in learner_state:  # a sharded learner's: its ranks wrote it whole
            shutil.move(learner_state.pop("folder"), tmp / LEARNER_DIR)
            for f in (tmp / LEARNER_DIR).iterdir():
                fsync_file(f)
            fsync_dir(tmp / LEARNER_DIR)
        save_tree(tmp, "optimizer", learner_state)
        save_tree(tmp, "rng", rng if rng is not None else rng_state())
        # compact: the batches an async checkpoint keeps make it large (2.8x indented)
        (tmp / "state.json").write_text(json.dumps(state, separators=(",", ":")))
        for f in tmp.iterdir():
            if f.is_file():
                fsync_file(f)
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _replace_dir(tmp, final)
    fsync_dir(folder)
    for old in list_checkpoints(folder)[:-keep]:
        # renamed first: a kill during the removal must not leave a half-deleted step_N
        # that still looks complete
        doomed = old.with_name(f".del_{old.name}")
        os.rename(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    for leftover in folder.glob(".del_step_*"):  # from a run killed while removing
        shutil.rmtree(leftover, ignore_errors=True)
    return final


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; an existing `final` (the same step saved again) is moved
    aside first and removed after, so some complete copy exists at every instant."""
    if not final.exists():
        os.rename(tmp, final)
        return
    old = final.with_name(f".old_{final.name}")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for p in folder.glob("step_*"):
        with contextlib.suppress(ValueError):
            if (p / "state.json").is_file():
                found.append((int(p.name.split("_", 1)[1]), p))
    return [p for _, p in sorted(found)]


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
    if (path / "rng.json").is_file():
        set_rng_state(load_tree(path, "rng"))
        learner_state = load_tree(path, "optimizer")
        if (path / LEARNER_DIR).is_dir():  # a sharded learner's optimizer state (DCP)
            learner_state["folder"] = str(path / LEARNER_DIR)
    else:
        set_rng_state(_load_legacy(path / "rng.pt"))
        learner_state = _load_legacy(path / "optimizer.pt")
    return learner_state, json.loads((path / "state.json").read_text())


def _load_legacy(file: Path) -> Any:
    """A `.pt` file of an older rollwise, read with `weights_only=True` (tensors and plain
    containers only: a planted payload is refused, not run)."""
    try:
        return torch.load(file, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any refusal is reported the same way
        raise ValueError(f"{file}: refused to load (it holds more than tensors and plain "
                         f"data, and loading it could run code); re-create the checkpoint "
                         f"with this rollwise ({type(e).__name__})") from None
