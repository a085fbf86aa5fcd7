"""Memory chosen by the machine: what `run.memory = "auto"` means.

    cfg, choice = choose_memory(cfg)   # before the model loads (pipeline/launch.open_run)
    choice.line()                      # the run header's line (None: nothing to say)
    choice.record()                    # summary.json's and run.json's "memory"

`auto` compares the memory free when the run starts (`free_mb`) with the run's expected
peak (`expected_peak_mb`, an estimate from the model's shape and the config, below). When
less is free, the low-memory settings (`LOW`: bfloat16 master weights, bfloat16 AdamW
moments, activation checkpointing, freed memory) replace the defaults of every one of those
keys that the config leaves unset; on the quickstart they took the peak from 5.1 to 2.3-2.7
GB at the same held-out accuracy over eight seeds (58.4% against 59.2%) and cost learner
time (checkpointing recomputes the forward pass: about 1.5x the update; docs/performance.md,
Memory). `low` takes them whatever is free, `default` never. A key set in the config file,
by `--set` or on a `Config` in Python wins. Two are skipped where they would not be the
measured settings: with LoRA the bfloat16 master and moments (the trained adapters are
small; the frozen base's dtype is `learner.master_dtype`), and the bfloat16 master where the learner
computes in float32 (`learner.precision`, or `auto` without native bfloat16): there the
residual stream would be bfloat16 too, which ended 7 points lower on the quickstart.
`run.allocator = "jemalloc"` (2.3 GB) is not switched: the allocator is chosen when the
process starts, before the config is read here.

Only host memory on a CPU device is compared: with `run.device` a GPU, `auto` keeps the
defaults (set `run.memory = "low"`). A resumed run keeps the choice its first start made
(run.json), whatever is free now: its checkpoint holds weights and moments of that choice.

Free memory: `$ROLLWISE_FREE_MEMORY_MB` when set (tests fake the figure with it), else
MemAvailable of /proc/meminfo, else psutil's `available` where psutil is installed, else
unknown (the defaults stay).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rollwise.compose.config import Config

FREE_ENV = "ROLLWISE_FREE_MEMORY_MB"
# The low-memory settings of docs/performance.md ("Eight seeds: the accuracy is the
# defaults'"), in the order the header names them.
LOW: dict[str, Any] = {"learner.master_dtype": "bfloat16", "learner.optimizer": "adamw-bf16",
                       "learner.activation_checkpointing": True,
                       "learner.release_memory": True}
# Python, torch and transformers (0.42 GB measured on the quickstart), the tokenizer, the
# task and its prompts: resident before any weight.
RUNTIME_MB = 512.0
_ENGINE_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1, "auto": 2}  # a weight, per precision
_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class MemoryChoice:
    """What `run.memory` settled to for this run, and the figures behind it."""

    setting: str  # run.memory: auto | default | low
    choice: str  # default | low
    free_mb: float | None = None  # free at start (None: unknown, not measured)
    expected_mb: float | None = None  # the expected peak of the config as given
    low_mb: float | None = None  # ... with the low-memory settings applied
    applied: dict[str, Any] = field(default_factory=dict)  # key -> value switched
    kept: dict[str, Any] = field(default_factory=dict)  # set in the config, other than LOW
    skipped: dict[str, str] = field(default_factory=dict)  # key -> why not applied
    resumed: bool = False  # taken from the run's first start...
    prior: dict[str, Any] | None = None  # ... whose record this was (run.json)

    def line(self) -> str | None:
        """The run header's line; None when the defaults stay and nothing needs saying."""
        if self.choice != "low" or (self.resumed and not self.applied):
            return None
        settings = ", ".join(f"{k}={_text(v)}" for k, v in self.applied.items()) or "none left"
        if self.resumed:
            why = "as the run started"  # `applied`: the keys the config leaves unset
        elif self.setting == "low":
            why = "run.memory = 'low'"
        else:
            why = f"{_gib(self.free_mb)} free < {_gib(self.expected_mb)} expected peak"
        text = f"memory: {why} -> low-memory settings ({settings}"
        if self.low_mb is not None and not self.resumed:
            text += f"; expected peak {_gib(self.low_mb)}"
            if self.free_mb is not None and self.low_mb > self.free_mb:
                text += ", more than is free"
        text += ")"
        if self.kept:
            text += "; as set: " + ", ".join(f"{k}={_text(v)}" for k, v in self.kept.items())
        if self.skipped:
            text += "; not applied: " + "; ".join(f"{k} ({reason})"
                                                 for k, reason in self.skipped.items())
        if self.setting == "auto" and not self.resumed:
            text += "; run.memory = 'default' keeps the defaults"
        return text

    def record(self) -> dict[str, Any]:
        """summary.json's and run.json's "memory" (a resumed run re-applies `applied`; its
        record stays its first start's)."""
        out = {"setting": self.setting, "choice": self.choice, "applied": self.applied,
               "kept": self.kept, "skipped": self.skipped, "resumed": self.resumed}
        for key in ("free_mb", "expected_mb", "low_mb"):
            value = getattr(self, key)
            out[key] = None if value is None else round(value, 1)
        return out if self.prior is None else out | self.prior | {"resumed": True}


def _gib(mb: float) -> str:
    return f"{mb / 1024:.1f} GiB"


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# -- free memory ------------------------------------------------------------------------------

def free_mb() -> float | None:
    """MiB of memory a new run can take now (module docstring); None when unknown."""
    faked = os.environ.get(FREE_ENV)
    if faked:
        try:
            return float(faked)
        except ValueError:
            raise ValueError(f"${FREE_ENV} = {faked!r}: not a number of MiB") from None
    return available_mb()


def available_mb() -> float | None:
    """MiB the system could give a new process now (MemAvailable of /proc/meminfo, else
    psutil's `available`); None when neither can tell."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        return None
    return psutil.virtual_memory().available / 2**20


# -- the model's shape, before it loads -------------------------------------------------------

def model_shape(cfg: Config) -> dict[str, Any] | None:
    """The sizes of the model's config (hidden_size, layers, vocabulary, ...) without
    loading it: the tiny model's settings, SmolLM2-135M's known config, a local directory's
    config.json; None where they cannot be read."""
    name = cfg.model.name
    if name == "tiny":
        from rollwise.models.tiny import CHARS, SPECIALS

        t = cfg.model.tiny
        return {"model_type": "llama", "hidden_size": t.hidden, "num_hidden_layers": t.layers,
                "intermediate_size": 3 * t.hidden, "num_attention_heads": t.heads,
                "num_key_value_heads": t.kv_heads, "vocab_size": len(SPECIALS) + len(CHARS),
                "tie_word_embeddings": True}
    if name == "smollm2-135m":
        from rollwise.models.smollm2 import SHAPE

        return dict(SHAPE)
    try:
        shape = json.loads((Path(name) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    shape = shape.get("text_config", shape) if isinstance(shape, dict) else None
    needed = ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size",
              "num_attention_heads")
    return shape if isinstance(shape, dict) and all(k in shape for k in needed) else None


def _dims(shape: dict[str, Any]) -> tuple[int, int, int, int, int, int, int]:
    """(hidden, layers, intermediate, vocabulary, query width, key/value width, heads)."""
    hidden, heads = int(shape["hidden_size"]), int(shape["num_attention_heads"])
    kv = int(shape.get("num_key_value_heads") or heads)
    head_dim = int(shape.get("head_dim") or hidden // heads)
    return (hidden, int(shape["num_hidden_layers"]), int(shape["intermediate_size"]),
            int(shape["vocab_size"]), heads * head_dim, kv * head_dim, heads)


def parameters(shape: dict[str, Any]) -> int:
    """Parameters of a Llama/Qwen2-style decoder: the embedding (and an untied output layer),
    per layer q/k/v/o (q/k/v biases for Qwen2), the gated MLP and two norms, a final norm."""
    hidden, layers, inter, vocab, q, kv, _ = _dims(shape)
    bias = shape.get("attention_bias", shape.get("model_type") == "qwen2")
    attention = hidden * (2 * q + 2 * kv) + (q + 2 * kv if bias else 0)
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    embeddings = vocab * hidden * (1 if shape.get("tie_word_embeddings", False) else 2)
    return embeddings + layers * per_layer + hidden


def lora_parameters(shape: dict[str, Any], rank: int, targets: list[str]) -> int:
    """Parameters of rank-`rank` adapters on the projections named in `targets`."""
    hidden, layers, inter, _, q, kv, _ = _dims(shape)
    sizes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
             "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
             "down_proj": (inter, hidden)}
    return layers * sum(rank * (a + b) for name, (a, b) in sizes.items() if name in targets)


# -- the estimate -----------------------------------------------------------------------------

def learner_autocasts(cfg: Config, shape: dict[str, Any] | None) -> bool:
    """Whether the learner will compute under bf16-autocast: as set, or what `auto`
    precision (compose/precision.py) can pick here: bfloat16 on a GPU, on a CPU only with
    native bfloat16 and a model at least MIN_HIDDEN wide (the probe may still pick float32
    where bfloat16 is not faster; not timed here)."""
    precision = cfg.learner.precision
    if precision != "auto":
        return precision == "bf16-autocast"
    from rollwise.compose.precision import MIN_HIDDEN, cpu_flags, native_bf16

    if os.environ.get("ROLLWISE_AUTO_PRECISION", "").lower() == "float32":
        return False
    if not cfg.run.device.startswith("cpu"):
        return True
    if shape is None or int(shape["hidden_size"]) < MIN_HIDDEN:
        return False
    import torch

    return native_bf16(cpu_flags(), torch.backends.cpu.get_cpu_capability())


def expected_peak_mb(cfg: Config, shape: dict[str, Any], *, autocast: bool) -> float:
    """The run's expected peak resident set, MiB, for a synchronous run on a CPU:

        RUNTIME_MB + P x (w + e + c + r + s) + T x m + max(T x g, A)

    P parameters, T trained (P, or the LoRA adapters'); per parameter w the weight (4 float32, 2
    bfloat16: learner.master_dtype, with LoRA the frozen base's), e the engine's copy (its
    precision's bytes unless it reads the weights in place: the same precision), c autocast's
    bfloat16 copies of float32 weights (2), r the KL reference (2 under autocast, else 4; full
    fine-tuning with kl_coef > 0), s compensated rounding's residual (1); per trained parameter
    m the optimizer's moments (learner/optim.py's MOMENT_BYTES: 8 for AdamW) and g the gradient
    (the weight's bytes). A: the activations of one micro-batch, min(micro_batch_tokens, rows x
    max_tokens) tokens (every row trained, every response at its budget; prompts not counted) at
    learner/memory.py's bytes a token (1.30 MiB for the 135M shape under autocast, 0.11 with
    checkpointing), plus one log-prob chunk over the vocabulary, or learner.memory_budget_mb
    where set. The backward pass frees a layer's activations as its gradients appear (the first
    update: 3.3 GB before it, 3.5 GB after), so the two count as the larger of them.

    Calibration (SmolLM2-135M, 134.5M parameters, the quickstart: 32 rows of 64 tokens,
    chunk 1024): the defaults under autocast 512 + 8 B x P (1026) + 8 B x P (1026) +
    max(513, 2048 x 1.30 + 576) = 5.7 GiB (6.1 GB), against 5.10 GB measured over 3 steps
    (time -v; per step 4756-4979 MiB) and 4809 MiB for the 32-row batch alone (bench
    learner), whose steps trained fewer rows of shorter responses; the low-memory settings
    512 + 2 B x P (257) + 4 B x P (513) + max(257, 2048 x 0.11 + 576) = 2.0 GiB (2.2 GB),
    against 2141-2720 MiB over 3 steps and 2454-2680 MiB over 20 (jemalloc; docs/
    performance.md, Memory). So the defaults' figure is a little above what was measured
    (a step can train every row at full length), the low settings' a little below
    (fragmentation: `reuse` reached 3.3 GiB over 20 steps)."""
    from rollwise.learner.memory import activation_mb_per_token, logits_mb
    from rollwise.learner.optim import MOMENT_BYTES

    m, lc, r = cfg.model, cfg.learner, cfg.rollout
    lora = m.lora_rank > 0
    p = parameters(shape)
    trained = lora_parameters(shape, m.lora_rank, list(m.lora_targets)) if lora else p
    bf16_master = lc.master_dtype == "bfloat16"
    weight = 2 if bf16_master else 4
    engine = _ENGINE_BYTES[cfg.engine.dtype]
    per_param = weight + (0 if engine == weight else engine)
    per_param += 2 if autocast and weight == 4 else 0
    if cfg.algorithm.kl_coef > 0 and not lora:
        per_param += 2 if autocast or weight == 2 else 4
    if bf16_master and lc.master_rounding == "compensated":
        per_param += 1
    grad = 4 if lora else weight
    moments = MOMENT_BYTES[lc.optimizer]
    model = SimpleNamespace(config=SimpleNamespace(**shape))
    tokens = min(lc.micro_batch_tokens, r.prompts_per_step * r.group_size * r.max_tokens)
    precision = "bf16-autocast" if autocast or bf16_master else "float32"
    activations = (tokens * activation_mb_per_token(model, precision,
                                                    lc.activation_checkpointing)
                   + logits_mb(model, min(lc.logprob_chunk, tokens)))
    if lc.memory_budget_mb > 0:
        activations = min(activations, lc.memory_budget_mb)
    return (RUNTIME_MB + (p * per_param + trained * moments) / 2**20
            + max(trained * grad / 2**20, activations))


# -- the choice -------------------------------------------------------------------------------

def explicit_keys(cfg: Config) -> set[str]:
    """The dotted keys the config sets (a file, --set, or a `Config` built in Python), as
    opposed to those left at their defaults."""
    return {f"{name}.{key}" for name in type(cfg).model_fields
            for key in getattr(cfg, name).model_fields_set}


def _skip_reason(key: str, cfg: Config, autocast: bool) -> str | None:
    """Why a low-memory setting is not applied to `cfg`, or None."""
    if cfg.learner.shards > 1 and key in ("learner.master_dtype", "learner.optimizer"):
        return ("learner.shards > 1: FSDP2 shards float32 weights and torch's AdamW; each rank "
                "holds 1/N of them instead")
    if cfg.model.lora_rank > 0 and key in ("learner.master_dtype", "learner.optimizer"):
        return ("LoRA: measured for full fine-tuning; learner.master_dtype is then the frozen "
                "weights' dtype")
    if key == "learner.master_dtype" and not autocast:
        return ("the learner computes in float32 here: bfloat16 weights would make its "
                "residual stream bfloat16, 7 points lower on the quickstart")
    return None


def _with(cfg: Config, settings: dict[str, Any]) -> Config:
    """A copy of `cfg` with `settings` (dotted keys) assigned."""
    out = cfg.model_copy(deep=True)
    for key, value in settings.items():
        section, name = key.split(".")
        setattr(getattr(out, section), name, value)
    return out


def choose_memory(cfg: Config, *, resumed: dict[str, Any] | None = None,
                  free: float | None = None) -> tuple[Config, MemoryChoice]:
    """`cfg` with run.memory settled (module docstring), and the choice. `resumed`: the
    "memory" record of the run being resumed ({} for a run from before it had one): its
    settings are applied again to the keys `cfg` leaves unset, nothing is measured.
    `free`: MiB free, instead of reading it (`free_mb`)."""
    setting, explicit = cfg.run.memory, explicit_keys(cfg)
    if setting == "auto" and resumed is not None:
        before = resumed.get("applied", {})  # run.json's keys are sorted: LOW's order first
        applied = {k: before[k] for k in [*LOW, *before] if k in before and k not in explicit}
        choice = MemoryChoice(setting, resumed.get("choice", "default"), applied=applied,
                              resumed=True, prior=dict(resumed))
        return (_with(cfg, applied) if applied else cfg), choice
    if setting == "default":
        return cfg, MemoryChoice(setting, "default")
    shape = model_shape(cfg)
    autocast = learner_autocasts(cfg, shape)
    expected = expected_peak_mb(cfg, shape, autocast=autocast) if shape else None
    if setting == "auto":
        if free is None and cfg.run.device.startswith("cpu"):
            free = free_mb()
        if free is None or expected is None or free >= expected:
            return cfg, MemoryChoice(setting, "default", free_mb=free, expected_mb=expected)
    applied, kept, skipped = {}, {}, {}
    for key, value in LOW.items():
        section, name = key.split(".")
        if key in explicit:
            if getattr(getattr(cfg, section), name) != value:
                kept[key] = getattr(getattr(cfg, section), name)
        elif (why := _skip_reason(key, cfg, autocast)) is not None:
            skipped[key] = why
        else:
            applied[key] = value
    low = _with(cfg, applied)
    low_mb = expected_peak_mb(low, shape, autocast=autocast) if shape else None
    return low, MemoryChoice(setting, "low", free_mb=free, expected_mb=expected, low_mb=low_mb,
                             applied=applied, kept=kept, skipped=skipped)
