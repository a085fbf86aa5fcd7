"""New weights for the served model from a folder of safetensors, in two halves: `stage`
checks a folder against the model without touching it (names, shapes, the adapter's
settings), `apply` writes the staged weights into the model's own tensors in place, one
tensor at a time, and puts back what it wrote if it fails or runs out of time.

Full weights are read from the file's memory map straight into the model's tensors (one
copy, converting when the file's dtype is not the model's: a bfloat16 file into a float32
model is exact). Putting back needs a copy of the old values, as large as the model; it is
taken only where the old values are still what is served: when the engine reads the
model's tensors in place. An engine that samples from its own converted copy (bfloat16,
int8) keeps serving the old weights from that copy until it publishes again, so a full
update that fails part-way there keeps no copy: the model's tensors are left partly
written (`torn`), the server serves on from its copy, and only full weights may load next.

A folder holds either full weights (`model.safetensors`, named as the served model's
state_dict; a tied tensor, such as an output layer sharing the embedding, may be left out)
or a LoRA adapter as peft saves it (`adapter_model.safetensors` + `adapter_config.json`).
An adapter is merged into the base weights: those the server started with, or the last full
weights loaded since. Loading another adapter replaces the previous one (its base comes
back first); loading full weights makes them the new base.

Imports torch and safetensors only.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

FULL, ADAPTER, ADAPTER_CONFIG = ("model.safetensors", "adapter_model.safetensors",
                                 "adapter_config.json")
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
    files: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # kept open

    def close(self) -> None:
        """The files the values are read from let go (their memory maps unmapped)."""
        self.files.close()


class WeightStore:
    """The served model's tensors by state_dict name, and the base weights that adapters
    are merged into (kept on the host only for tensors an adapter has changed)."""

    def __init__(self, model):
        self.model = model
        self.tensors: dict[str, torch.Tensor] = {}
        self.bases: dict[str, torch.Tensor] = {}
        self.torn = False  # a full update failed part-way with no copy of the old values

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
        staged = Staged("full", source=str(file))
        _read_ahead(file)
        try:
            # opened once and memory-mapped: each value is a view of the file, copied
            # straight into the model's tensor when written
            f = staged.files.enter_context(safe_open(file, "pt"))
            shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
            for name, shape in shapes.items():
                self._check(file.name, name, shape)
            covered = {self.tensors[n].data_ptr() for n in shapes}
            missing = [n for n, t in self.tensors.items() if n not in shapes
                       and t.data_ptr() not in covered]
            if missing:
                raise UpdateError("load", f"{file.name} lacks {len(missing)} of the served "
                                  f"model's tensors, e.g. '{missing[0]}'")
        except BaseException:
            staged.close()
            raise
        staged.writes = [(n, lambda n=n: f.get_tensor(n)) for n in shapes]
        return staged

    def _check(self, where: str, name: str, shape: list[int]) -> None:
        if name not in self.tensors:
            raise UpdateError("load", f"{where}: tensor '{name}' is not a weight of the served "
                              "model")
        want = list(self.tensors[name].shape)
        if shape != want:
            raise UpdateError("load", f"{where}: tensor '{name}' has shape {shape}; the served "
                              f"model's is {want}")

    def _stage_adapter(self, path: Path) -> Staged:
        if self.torn:
            raise UpdateError("load", "the last full-weights update failed part-way, so the "
                              "model's tensors are not the base an adapter merges into; load "
                              "full weights first", status=409)
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
    def apply(self, staged: Staged, deadline: float, keep_old: bool = True) -> None:
        """Write `staged` into the model, one tensor at a time; past `deadline` (monotonic
        seconds) or on any error, put back what was written and raise UpdateError. With
        `keep_old` False (the engine samples from its own copy of the weights) full
        weights are written with no copy of the old values, and a failure leaves the
        model `torn` instead. The staged files are let go either way."""
        keep = keep_old or staged.kind != "full"  # an adapter's old values are its base
        old: list[tuple[str, torch.Tensor]] = []
        written = 0
        try:
            for name, value in staged.writes:
                if time.monotonic() > deadline:
                    raise UpdateError("load", f"timed out after writing {written} of "
                                      f"{len(staged.writes)} tensors", status=504)
                target = self.tensors[name]
                new = value()
                if keep:
                    old.append((name, target.detach().to("cpu", copy=True)))
                written += 1
                target.copy_(new)
        except Exception as e:  # noqa: BLE001 - any failure mid-write is undone, then raised
            raise self._undo(e, old, keep, written) from (
                None if isinstance(e, UpdateError) else e)
        finally:
            staged.close()
        if staged.kind == "full":
            self.bases.clear()
            self.torn = False
        else:
            for name, before in old:
                self.bases.setdefault(name, before)

    def _undo(self, e: Exception, old: list[tuple[str, torch.Tensor]], kept: bool,
              written: int) -> UpdateError:
        """After `e` part-way: the old values put back (`kept`), else the model marked
        torn when anything was written; the UpdateError saying which."""
        for name, before in reversed(old):
            self.tensors[name].copy_(before)
        if kept or not written:
            after = "the old weights were put back"
        else:
            self.torn = True
            after = ("the engine serves on from its copy of the old weights; the next "
                     "update must hold full weights")
        if isinstance(e, UpdateError):
            return UpdateError(e.phase, f"{e.reason}; {after}", e.status)
        return UpdateError("load", f"{type(e).__name__}: {e}; {after}", status=500)


def _read_ahead(file: Path) -> None:
    """Ask the kernel to start reading `file` into the page cache now, while the server
    still serves (a file the trainer just wrote on this machine is there already)."""
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: no posix_fadvise
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


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
