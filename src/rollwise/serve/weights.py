"""New weights for the served model from a folder of safetensors, in two halves: `stage`
checks a folder against the model without touching it (names, shapes, the adapter's
settings), `apply` writes the staged weights into the model's own tensors in place, one
tensor at a time, and puts back what it wrote if it fails or runs out of time.

A folder holds either full weights (`model.safetensors`, named as the served model's
state_dict; a tied tensor, such as an output layer sharing the embedding, may be left out)
or a LoRA adapter as peft saves it (`adapter_model.safetensors` + `adapter_config.json`).
An adapter is merged into the base weights: those the server started with, or the last full
weights loaded since. Loading another adapter replaces the previous one (its base comes
back first); loading full weights makes them the new base.

Imports torch and safetensors only.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

FULL, ADAPTER, ADAPTER_CONFIG = "model.safetensors", "adapter_model.safetensors", "adapter_config.json"
PEFT_PREFIX = "base_model.model."


class UpdateError(Exception):
    """A weight update that did not happen: the phase it failed in and why; the model keeps
    the weights it had."""

    def __init__(self, phase: str, reason: str, status: int = 400):
        super().__init__(f"{phase}: {reason}")
        self.phase, self.reason, self.status = phase, reason, status


@dataclass
class Staged:
    """A checked folder: what `apply` will write, as (served tensor name, a function giving
    its new value); the values are read only when written."""

    kind: str  # "full" | "adapter"
    writes: list[tuple[str, object]] = field(default_factory=list)
    source: str = ""


class WeightStore:
    """The served model's tensors by state_dict name, and the base weights that adapters
    are merged into (kept on the host only for tensors an adapter has changed)."""

    def __init__(self, model):
        self.model = model
        self.tensors: dict[str, torch.Tensor] = {}
        self.bases: dict[str, torch.Tensor] = {}

    # -- stage: read and check, the model untouched ----------------------------------------

    def stage(self, folder: str) -> Staged:
        path = Path(folder)
        if not path.is_dir():
            raise UpdateError("load", f"{folder} is not a folder")
        self.tensors = dict(self.model.state_dict())  # the model's tensors as they are now
        try:
            if (path / FULL).is_file():
                return self._stage_full(path / FULL)
            if (path / ADAPTER).is_file() and (path / ADAPTER_CONFIG).is_file():
                return self._stage_adapter(path)
        except UpdateError:
            raise
        except Exception as e:  # noqa: BLE001 - an unreadable file, whatever the reader says
            raise UpdateError("load", f"{folder}: cannot be read ({type(e).__name__}: {e})"
                              ) from None
        raise UpdateError("load", f"{folder} holds neither {FULL} (full weights) nor "
                          f"{ADAPTER} with {ADAPTER_CONFIG} (a LoRA adapter)")

    def _stage_full(self, file: Path) -> Staged:
        with safe_open(file, "pt") as f:
            shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
        for name, shape in shapes.items():
            self._check(file.name, name, shape)
        covered = {self.tensors[n].data_ptr() for n in shapes}
        missing = [n for n, t in self.tensors.items() if n not in shapes
                   and t.data_ptr() not in covered]
        if missing:
            raise UpdateError("load", f"{file.name} lacks {len(missing)} of the served model's "
                              f"tensors, e.g. '{missing[0]}'")

        def reader(name):
            def read():
                with safe_open(file, "pt") as f:
                    return f.get_tensor(name)
            return read
        return Staged("full", [(n, reader(n)) for n in shapes], str(file))

    def _check(self, where: str, name: str, shape: list[int]) -> None:
        if name not in self.tensors:
            raise UpdateError("load", f"{where}: tensor '{name}' is not a weight of the served "
                              "model")
        want = list(self.tensors[name].shape)
        if shape != want:
            raise UpdateError("load", f"{where}: tensor '{name}' has shape {shape}; the served "
                              f"model's is {want}")

    def _stage_adapter(self, path: Path) -> Staged:
        scale = _adapter_scale(json.loads((path / ADAPTER_CONFIG).read_text()))
        with safe_open(path / ADAPTER, "pt") as f:
            pairs: dict[str, dict[str, torch.Tensor]] = {}
            for key in f.keys():  # noqa: SIM118 (not a dict)
                module, _, part = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
                if part not in ("A.weight", "B.weight"):
                    raise UpdateError("load", f"{ADAPTER}: tensor '{key}' is not a LoRA factor "
                                      "(lora_A.weight / lora_B.weight)")
                pairs.setdefault(module + ".weight", {})[part[0]] = f.get_tensor(key)
        deltas = {}
        for name, ab in pairs.items():
            if set(ab) != {"A", "B"}:
                raise UpdateError("load", f"{ADAPTER}: '{name}' lacks lora_A or lora_B")
            a, b = ab["A"].float(), ab["B"].float()
            self._check(ADAPTER, name, [b.shape[0], a.shape[1]])
            deltas[name] = (a, b)

        def merged(name):
            def value():
                base = self.bases.get(name, self.tensors[name]).float().cpu()
                if name not in deltas:
                    return base
                a, b = deltas[name]
                return base + (b @ a) * scale
            return value
        names = sorted(set(deltas) | set(self.bases))
        return Staged("adapter", [(n, merged(n)) for n in names], str(path))

    # -- apply: in place, undone on failure ------------------------------------------------

    @torch.no_grad()
    def apply(self, staged: Staged, deadline: float) -> None:
        """Write `staged` into the model, one tensor at a time; past `deadline` (monotonic
        seconds) or on any error, put back what was written and raise UpdateError."""
        old: list[tuple[str, torch.Tensor]] = []
        try:
            for name, value in staged.writes:
                if time.monotonic() > deadline:
                    raise UpdateError("load", f"timed out after writing {len(old)} of "
                                      f"{len(staged.writes)} tensors", status=504)
                target = self.tensors[name]
                new = value()
                old.append((name, target.detach().to("cpu", copy=True)))
                target.copy_(new)
        except Exception as e:
            for name, before in reversed(old):
                self.tensors[name].copy_(before)
            if isinstance(e, UpdateError):
                raise UpdateError(e.phase, f"{e.reason}; the old weights were put back",
                                  e.status) from None
            raise UpdateError("load", f"{type(e).__name__}: {e}; the old weights were put "
                              "back", status=500) from e
        if staged.kind == "full":
            self.bases.clear()
        else:
            for name, before in old:
                self.bases.setdefault(name, before)


def _adapter_scale(config: dict) -> float:
    """The factor of B @ A in a peft LoRA adapter's config (refusing what it cannot merge)."""
    if config.get("peft_type", "LORA") != "LORA":
        raise UpdateError("load", f"{ADAPTER_CONFIG}: peft_type {config['peft_type']!r} is not "
                          "LORA")
    for key in ("use_dora", "rank_pattern", "alpha_pattern", "fan_in_fan_out"):
        if config.get(key):
            raise UpdateError("load", f"{ADAPTER_CONFIG}: {key} is not supported")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise UpdateError("load", f"{ADAPTER_CONFIG}: needs an integer r >= 1 and a number "
                          "lora_alpha")
    return alpha / r**0.5 if config.get("use_rslora") else alpha / r
