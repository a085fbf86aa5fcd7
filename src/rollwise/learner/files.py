"""The in-process learner as the trainer port of inference servers in other processes:
each publication is a folder of safetensors files that the servers load.

    <root>/v<version>/model.safetensors          full weights, named as the model's
                                                 state_dict (a tied copy written once)
    <root>/v<version>/adapter_model.safetensors  LoRA: only the adapter, named as peft
    <root>/v<version>/adapter_config.json        saves it, and its configuration

Full weights are written in the precision the servers sample in: a bfloat16 server gets
bfloat16 (half the bytes; it would round float32 weights to the same values on loading),
a float32 server float32. The rollout side asks, for each server, `Publication.folder(
dtype)` of the handle of each `Published`; every version is written, inside `publish`, in
each dtype asked for at the version before (float32 before any was), so the folders never
change after `publish` returned, even when the rollout side loads them later from another
thread (the asynchronous driver). A dtype not written yet is written on its first ask:
at a run's first publication, before any update. Servers of two precisions each get
theirs. Only what is published is rounded: the trainer's own weights stay as they are.

With LoRA the first publication holds the base model's full weights (the servers may have
started from other ones; the adapter is still zero then: peft starts lora_B at 0), the
later ones the adapter only, which a server merges into that base. Both stay float32 in
any case: the base is written once, and the server merges in float32 before it rounds,
as the in-process engine does.

The files are written by `save_tensors`, one tensor at a time from the tensors' own memory
(converted through one reused buffer when the dtype changes), not through a copy of the
whole model. Nothing is synced to disk (no fsync, no rename): a server reads a folder
only after `publish` returned its path, the files closed, so the page cache (or a shared
file system's close-to-open consistency) already shows them whole.

The writing lives on the trainer's side, as a Ray learner puts its weights in the object
store: the weights are the trainer's, `Published.handle` carries where they are, and the
rollout side (rollout/remote.py) only tells the servers the path. One version is kept: the
previous version's folders are removed when the next is written, since the servers
confirmed loading it (the rollout port's `publish` returned) before the trainer publishes
again.

Imports torch, the learner and the records.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
import threading
import time
from pathlib import Path

import torch

from rollwise.learner.learner import Learner
from rollwise.types import Batch, Published

FULL_FILE, ADAPTER_FILE = "model.safetensors", "adapter_model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
         torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
         torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}  # safetensors' names


class FileTrainer:
    """`learner` (training `model` in place) whose publications are folders under a new
    temporary folder inside `root` (the system's temporary folder when empty)."""

    def __init__(self, learner: Learner, model, root: str = "", *, untied: bool = False,
                 probe: list[int] | None = None):
        self.learner = learner
        self.weights = WeightsPublisher(model, root, untied=untied, probe=probe)
        self._synced = -1

    @property
    def model(self):
        return self.weights.model

    @property
    def root(self) -> Path:
        return self.weights.root

    def update(self, batch: Batch) -> dict[str, float]:
        return self.learner.update(batch)

    def reference_kl(self, batch: Batch):
        return self.learner.reference_kl(batch)

    def publish(self, version: int) -> Published:
        """The model's weights (after the first publication, the adapter only, for LoRA)
        written as `version` (a sharded learner first brings the model to them)."""
        self.learner.publish(version)
        return self.weights.publish(version)

    def sync_into(self, model) -> int | None:
        """The driver's model is the one trained here; the version when it changed since
        the last call (the evaluator's engine then re-reads the weights)."""
        if self.weights.version == self._synced:
            return None
        self._synced = self.weights.version
        return self._synced

    def state_dict(self) -> dict:
        return self.learner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.learner.load_state_dict(state)

    def close(self) -> None:
        self.learner.close()
        self.weights.close()


class WeightsPublisher:
    """`model`'s weights as a folder per version under a new temporary folder inside
    `root`, written in each dtype the servers asked for at the previous version (float32
    before any asked); `seconds` holds the last write's phases (gather, convert, write).
    `untied`: a tied output layer written under its own name too (vLLM's reload keeps a
    tied model's start-up head, so it serves an untied copy: serve/vllm.py). `probe`: token
    ids whose log-probs under each version (`Publication.probe`) the servers' are checked
    against (rollout/remote.py), computed before the files are written (`seconds['probe_s']`;
    on a thread of its own, overlapping the write and the servers' load, it gained nothing
    on 2 cores: docs/remote.md)."""

    def __init__(self, model, root: str = "", *, untied: bool = False,
                 probe: list[int] | None = None):
        self.model, self.untied, self.probe = model, untied, probe
        if root:
            Path(root).mkdir(parents=True, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix="rollwise-weights-", dir=root or None))
        self.dtypes = ["float32"]  # written for each version
        self.asked: set[str] = set()  # asked for (Publication.folder) since the last version
        self.version = -1
        self.seconds: dict[str, float] = {}
        self._current: Publication | None = None
        self._removing: threading.Thread | None = None

    def publish(self, version: int) -> Published:
        """`version` written in every dtype wanted; the handle is the `Publication`, the
        bytes those of all its files. The previous version's folders are removed on a
        thread of their own (freeing a large file's pages takes a while), the one before
        waited for first."""
        self._wait_removed()
        if self._current is not None:
            self._removing = threading.Thread(target=self._current.remove, daemon=True,
                                              name="rollwise-weights-remove")
            self._removing.start()
        self.seconds = {}
        if self.asked:
            self.dtypes, self.asked = sorted(self.asked), set()
        self._current = Publication(self, version, first=self._current is None)
        if self.probe:
            start = time.perf_counter()
            self._current.probe = probe_logprobs(self.model, self.probe)
            self.seconds["probe_s"] = time.perf_counter() - start
        nbytes = sum(self._current.write(d) for d in self.dtypes)
        self.version = version
        return Published(version, self._current, nbytes, dict(self.seconds))

    def expect(self, dtypes: list[str | None]) -> None:
        """The servers' precisions, known before the first publication: it is written in
        those (the weights a server gets are the same as if it had asked)."""
        self.dtypes = sorted({self.written_dtype(d) for d in dtypes}) or self.dtypes

    def written_dtype(self, dtype: str | None) -> str:
        """What a server sampling in `dtype` gets: that dtype when the trainer writes it,
        float32 otherwise (unknown, int8: converted from float32 by the server) and for
        LoRA (see the module's docstring)."""
        lora = hasattr(self.model, "peft_config")
        return dtype if dtype in DTYPES and not lora else "float32"

    def _wait_removed(self) -> None:
        if self._removing is not None:
            self._removing.join()
            self._removing = None

    def close(self) -> None:
        self._wait_removed()
        shutil.rmtree(self.root, ignore_errors=True)


class Publication:
    """One version's folders, by dtype: `folder(dtype)` is where a server sampling in
    `dtype` loads it from; `str()` the first folder written. `first`: the trainer's first
    publication (LoRA: the base model's weights; no update has run yet)."""

    def __init__(self, publisher: WeightsPublisher, version: int, first: bool):
        self.publisher, self.version, self.first = publisher, version, first
        self.folders: dict[str, Path] = {}
        self.nbytes: dict[str, int] = {}
        self.probe: list[float] | None = None  # the probe's log-probs under this version

    def write(self, dtype: str) -> int:
        """The folder for `dtype` written (once); its bytes of tensor data."""
        dtype = self.publisher.written_dtype(dtype)
        if dtype not in self.folders:
            folder = self.publisher.root / (f"v{self.version}" if not self.folders
                                            else f"v{self.version}-{dtype}")
            self.nbytes[dtype] = write_weights(self.publisher.model, folder, full=self.first,
                                               dtype=dtype, times=self.publisher.seconds,
                                               untied=self.publisher.untied)
            self.folders[dtype] = folder
        return self.nbytes[dtype]

    def folder(self, dtype: str | None) -> str:
        """The folder for a server sampling in `dtype` (None: not known); the next versions
        are written in that dtype too. One this version lacks is written now at the first
        publication; after it (the model may be training again, on another thread) the
        float32 folder serves instead, exact for any server. The rollout side asks each
        server once, so a later ask for another dtype comes only from a server that could
        not be asked before (or, writing float32 now, one restarted with another --dtype,
        whose next request stops the run)."""
        dtype = self.publisher.written_dtype(dtype)
        self.publisher.asked.add(dtype)
        if dtype not in self.folders and not self.first and "float32" in self.folders:
            dtype = "float32"
        self.write(dtype)
        return str(self.folders[dtype])

    def remove(self) -> None:
        for folder in self.folders.values():
            shutil.rmtree(folder, ignore_errors=True)

    def __str__(self) -> str:
        return str(next(iter(self.folders.values())))

    __fspath__ = __str__


def write_weights(model, folder: Path, full: bool = False, dtype: str = "float32",
                  times: dict[str, float] | None = None, untied: bool = False) -> int:
    """`model`'s weights into `folder` (created): a peft model's adapter and its
    configuration (unless `full`: its base model's weights), else the full state_dict,
    floating-point tensors in `dtype`; the bytes of tensor data written. `times` gets the
    seconds spent gathering the tensors, converting and writing them. `untied`: a tensor
    shared by two names (a tied output layer) written under both."""
    start = time.perf_counter()
    folder.mkdir(parents=True)
    lora = hasattr(model, "peft_config")
    if lora and not full:
        tensors, file = _plain(adapter_tensors(model)), ADAPTER_FILE
        config = model.peft_config["default"].to_dict()
        (folder / "adapter_config.json").write_text(json.dumps(config, default=_listed))
    elif lora:
        tensors, file = _plain({name.replace(".base_layer.", "."): t for name, t in
                                model.get_base_model().state_dict().items()
                                if ".lora_" not in name}, untied), FULL_FILE
    else:
        tensors, file = _plain(model.state_dict(), untied), FULL_FILE
    times = {} if times is None else times
    _add(times, gather_s=time.perf_counter() - start)
    return save_tensors(folder / file, tensors, DTYPES[dtype], times)


def adapter_tensors(model) -> dict[str, torch.Tensor]:
    """A peft model's adapter tensors, named as peft saves them. peft's
    `get_peft_model_state_dict` builds the whole model's state_dict to pick them out (0.2 s
    for SmolLM2, most of a LoRA sync); a plain LoRA's are its `lora_` parameters alone (7 ms).
    Configurations that save more or name it otherwise (biases, modules_to_save, DoRA's
    magnitude vectors) go through peft's function."""
    config = model.peft_config["default"]
    if (getattr(config, "bias", "none") != "none" or getattr(config, "modules_to_save", None)
            or getattr(config, "use_dora", False)):
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(model)
    return {name.replace(".default.", "."): p.detach() for name, p in model.named_parameters()
            if "lora_" in name}


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
                 times: dict[str, float] | None = None) -> int:
    """`tensors` as one safetensors file (8-byte header length, JSON header, data; metadata
    format 'pt' as safetensors writes it), floating-point tensors in `dtype` (None: as they
    are); the bytes of tensor data. A tensor already right is written from its own memory;
    one to convert goes through one buffer reused for all. `times`: convert_s, write_s."""
    want = {n: dtype if dtype is not None and t.is_floating_point() else t.dtype
            for n, t in tensors.items()}
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * want[name].itemsize
        header[name] = {"dtype": CODES[want[name]], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    convert = [t.numel() for n, t in tensors.items() if not _as_is(t, want[n])]
    # the bytes go to a file: tensors on any device are converted into a host buffer
    buffer = torch.empty(max(convert, default=0), dtype=dtype or torch.float32, device="cpu")
    converting = writing = 0.0
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for name, t in tensors.items():
            start = time.perf_counter()
            t = t.detach()
            if not _as_is(t, want[name]):
                t = buffer[:t.numel()].view(t.shape).copy_(t) if want[name] == buffer.dtype \
                    else t.to("cpu", want[name]).contiguous()
            middle = time.perf_counter()
            f.write(t.reshape(-1).view(torch.uint8).numpy())
            converting, writing = (converting + middle - start,
                                   writing + time.perf_counter() - middle)
    if times is not None:
        _add(times, convert_s=converting, write_s=writing)
    return offset


@torch.no_grad()
def probe_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1 under `model` as it is (float32 log-softmax, no
    dropout): what a server's prompt log-probs of `ids` must match."""
    training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        with torch.no_grad():  # no graph of the trainer's parameters
            logits = model(torch.tensor([ids], device=device)).logits[0, :-1].float()
    finally:
        model.train(training)
    logp = logits.log_softmax(-1).gather(1, torch.tensor(ids[1:], device=device)[:, None])
    return [float(x) for x in logp[:, 0].cpu()]


def _add(times: dict[str, float], **seconds: float) -> None:
    """Seconds added to `times` (a version written in two dtypes counts both)."""
    for k, v in seconds.items():
        times[k] = times.get(k, 0.0) + v


def _as_is(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Written straight from its memory: in `dtype`, contiguous, on the CPU."""
    return t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"


def _plain(state: dict[str, torch.Tensor], untied: bool = False) -> dict[str, torch.Tensor]:
    """Detached tensors, each storage once (a tied output layer is the embedding's: the
    first name keeps it, as Hugging Face checkpoints do) unless `untied` (each name)."""
    seen: set[tuple] = set()
    out = {}
    for name, t in state.items():
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen and not untied:
            continue
        seen.add(key)
        out[name] = t.detach()
    return out


def _listed(value):
    """JSON for what peft's configuration holds besides plain data (sets of modules)."""
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    return str(value)
