"""The in-process learner as the trainer port of inference servers in other processes:
each publication is a folder of safetensors files that the servers load.

    <root>/v<version>/model.safetensors          full weights, named as the model's
                                                 state_dict (a tied copy written once)
    <root>/v<version>/adapter_model.safetensors  LoRA: only the adapter, named as peft
    <root>/v<version>/adapter_config.json        saves it, and its configuration

With LoRA the first publication holds the base model's full weights (the servers may have
started from other ones; the adapter is still zero then: peft starts lora_B at 0), the
later ones the adapter only, which a server merges into that base.

The writing lives on the trainer's side, as a Ray learner puts its weights in the object
store: the weights are the trainer's, `Published.handle` carries where they are, and the
rollout side (rollout/remote.py) only tells the servers the path. One folder is kept: the
previous version's is removed when the next is written, since the servers confirmed
loading it (the rollout port's `publish` returned) before the trainer publishes again.

Imports torch, safetensors and the records.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from rollwise.learner.learner import Learner
from rollwise.types import Batch, Published


class FileTrainer:
    """`learner` (training `model` in place) whose publications are folders under a new
    temporary folder inside `root` (the system's temporary folder when empty)."""

    def __init__(self, learner: Learner, model, root: str = ""):
        self.learner, self.model = learner, model
        if root:
            Path(root).mkdir(parents=True, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix="rollwise-weights-", dir=root or None))
        self._folder: Path | None = None
        self._published = self._synced = -1

    def update(self, batch: Batch) -> dict[str, float]:
        return self.learner.update(batch)

    def reference_kl(self, batch: Batch):
        return self.learner.reference_kl(batch)

    def publish(self, version: int) -> Published:
        """The model's weights (after the first publication, the adapter only, for LoRA)
        written as `version`."""
        first = self._folder is None
        if not first:
            shutil.rmtree(self._folder, ignore_errors=True)
        folder = self.root / f"v{version}"
        nbytes = write_weights(self.model, folder, full=first)
        self._folder, self._published = folder, version
        return Published(version, str(folder), nbytes)

    def sync_into(self, model) -> int | None:
        """The driver's model is the one trained here; the version when it changed since
        the last call (the evaluator's engine then re-reads the weights)."""
        if self._published == self._synced:
            return None
        self._synced = self._published
        return self._published

    def state_dict(self) -> dict:
        return self.learner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.learner.load_state_dict(state)

    def close(self) -> None:
        self.learner.close()
        shutil.rmtree(self.root, ignore_errors=True)


def write_weights(model, folder: Path, full: bool = False) -> int:
    """`model`'s weights into `folder` (created): a peft model's adapter and its
    configuration (unless `full`: its base model's weights), else the full state_dict;
    the bytes written."""
    folder.mkdir(parents=True)
    lora = hasattr(model, "peft_config")
    if lora and full:
        tensors = _plain({name.replace(".base_layer.", "."): t for name, t in
                          model.get_base_model().state_dict().items() if ".lora_" not in name})
        save_file(tensors, folder / "model.safetensors")
    elif lora:
        from peft import get_peft_model_state_dict

        tensors = _plain(get_peft_model_state_dict(model))
        save_file(tensors, folder / "adapter_model.safetensors")
        config = model.peft_config["default"].to_dict()
        (folder / "adapter_config.json").write_text(json.dumps(config, default=_listed))
    else:
        tensors = _plain(model.state_dict())
        save_file(tensors, folder / "model.safetensors")
    return sum(t.nbytes for t in tensors.values())


def _plain(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors, each storage once (a tied output layer is the
    embedding's: the first name keeps it, as Hugging Face checkpoints do)."""
    seen: set[tuple] = set()
    out = {}
    for name, t in state.items():
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        t = t.detach().to("cpu").contiguous()
        # a view of a larger storage is copied: safetensors writes whole, unshared storages
        out[name] = t.clone() if t.untyped_storage().nbytes() != t.nbytes else t
    return out


def _listed(value):
    """JSON for what peft's configuration holds besides plain data (sets of modules)."""
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    return str(value)
