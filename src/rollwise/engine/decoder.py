"""The native engine's model as it holds it, for Llama-family decoders (Llama/SmolLM, Qwen2,
Qwen3, Mistral): the architecture's sizes, the rotary tables and the weights, read from the
transformers model's own parameter tensors (`Decoder`). What computes with them lives
beside it, one concern per module:

- `layers.py`: the layer computations (norm, q/k/v with rotary, MLP, output logits) and
  the one layer body every pass runs;
- `attention.py`: attention over the cache's two regions (a group's prompt, a row's own
  tokens) and over a prompt while it is prefilled;
- `passes.py`: the general passes (prompt prefill, chunks of rows);
- `step.py`: the static-shape decode step, its CUDA graphs and their staging.

Those modules read the weights through `Decoder.tensor`, `Decoder.linear` and
`Decoder.linears` only.

When the engine's dtype or device equals the parameters', weights are used in place: an
optimizer step is visible to the next forward with no transfer. Otherwise `refresh()` keeps
a converted copy, taken at each policy publication (docs/precision.md):

- `bfloat16` (or any float dtype): weights, activations and the KV cache in that dtype;
  the projections of one layer that read the same input are fused into one matrix (q/k/v,
  gate/up), so a decode step runs 4 matrix products per layer, not 7; bfloat16 weights on
  the CPU are kept in oneDNN's packed layout; attention scores and the softmax are computed
  in float32.
- `int8` (the lever for CPUs without native bfloat16, e.g. AVX2): activations and the KV
  cache stay float32; the q/k/v, o and gate/up projections hold int8 weights (one scale per
  output channel) and quantize their input at each call with one scale per row, so an
  outlier in one sequence does not coarsen the others; the int32 products come from
  `torch._int_mm` (oneDNN's integer kernels). Activation outliers sit in a few channels, so
  SmoothQuant's migration (alpha 0.5) moves part of each channel's range into the weights:
  x W^T = (x / s)(W s)^T with s_j = sqrt(max|x_j| / max|W_:,j|), max|x_j| measured at each
  publication by one float32 pass of the model body over fixed pseudo-random tokens.
  down_proj (whose input carries the largest outliers) stays float32. Where the integer
  kernel would saturate (no VNNI), weights use 7 bits (`projections.py`). Mismatch
  against float32 and the alternatives measured: docs/precision.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rollwise.engine.hf import stream_autocast
from rollwise.engine.projections import Dense, Int8Dense

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


class UnsupportedModel(ValueError):
    """The native engine has no forward pass for this architecture."""


def resolve_device(device: torch.device | str) -> torch.device:
    """`device` with its index made explicit ("cuda" -> "cuda:0" when that is current), so
    that it compares equal to the device a tensor reports."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def unwrap(model):
    """The transformers model inside a peft wrapper (LoRA layers stay injected)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def check_supported(model) -> None:
    hf = unwrap(model)
    cfg = getattr(hf, "config", None)
    kind = getattr(cfg, "model_type", type(hf).__name__)
    if kind not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(f"native engine: model type '{kind}' is not one of "
                               f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    rope = getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) in ("dynamic", "longrope"):
        raise UnsupportedModel(f"native engine: rope scaling '{rope}' is not supported")


@dataclass
class Taken:
    """Weights converted by `Decoder.take`, waiting to be installed (`Decoder.refresh`)."""

    parts: list[tuple]  # ("tensor", module, weight) / ("dense", modules, projection)
    seconds: float  # what taking them cost


class Decoder:
    def __init__(self, model, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, own_weights: bool = False):
        """`dtype`: the compute precision (float32, bfloat16, ...), or torch.int8 for int8
        projections around float32 activations. `own_weights`: keep a copy even when the
        precision is the parameters' (a trainer in another thread updates them while this
        decoder generates: asynchronous training in one process)."""
        check_supported(model)
        hf = unwrap(model)
        self.hf = hf
        cfg = hf.config
        self.cfg = cfg
        self.layers = list(hf.model.layers)
        self.embed, self.norm = hf.model.embed_tokens, hf.model.norm
        self.lm_head = hf.get_output_embeddings()
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.rep = self.heads // self.kv_heads
        self.scale = self.head_dim**-0.5
        self.qk_norm = hasattr(self.layers[0].self_attn, "q_norm")
        self.silu = getattr(cfg, "hidden_act", "silu") == "silu"
        weight = self.embed.weight
        self.int8 = dtype == torch.int8  # int8 projections, float32 everything else
        self.dtype = torch.float32 if self.int8 else (dtype or weight.dtype)
        self.device = resolve_device(device if device is not None else weight.device)
        # shared: the projections read in place (other tensors may be converted copies)
        proj = self.layers[0].mlp.down_proj.weight
        self.shared = (self.dtype == proj.dtype and self.device == resolve_device(proj.device)
                       and not self.int8 and not own_weights)
        self.own_weights = own_weights
        self.generation = 0  # publications so far (refresh)
        window = getattr(cfg, "sliding_window", None)
        if not (cfg.model_type == "mistral" or getattr(cfg, "use_sliding_window", False)):
            window = None
        self.max_context = min(int(cfg.max_position_embeddings), window or 1 << 30)
        pos = torch.arange(self.max_context, device=weight.device)[None]
        cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32, device=weight.device),
                                       pos)
        self.cos = cos[0].to(self.device, self.dtype)
        self.sin = sin[0].to(self.device, self.dtype)
        self._tensors: dict[nn.Module, torch.Tensor] = {}  # converted norm/embedding weights
        self._linears: dict[nn.Module | tuple, Dense | Int8Dense] = {}  # converted projections
        self._sizes: dict[tuple, list[int]] = {}  # output widths of each fused projection
        self.refresh()

    # -- weights ---------------------------------------------------------------------------

    def _groups(self) -> list[tuple[nn.Module, ...]]:
        """Projections converted together; those of one tuple read the same input and are
        fused into one matrix (their outputs concatenated)."""
        out: list[tuple[nn.Module, ...]] = [(self.lm_head,)]
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            out += [(a.q_proj, a.k_proj, a.v_proj), (a.o_proj,), (m.gate_proj, m.up_proj),
                    (m.down_proj,)]
        return out

    def _plain(self) -> list[nn.Module]:
        """Modules whose weight is read as a tensor (embedding lookup, norm gains)."""
        mods: list[nn.Module] = [self.embed, self.norm]
        for layer in self.layers:
            mods += [layer.input_layernorm, layer.post_attention_layernorm]
            if self.qk_norm:
                mods += [layer.self_attn.q_norm, layer.self_attn.k_norm]
        return mods

    @torch.no_grad()
    def take(self) -> Taken | None:
        """A converted copy of the current weights, to be installed later by
        `refresh(taken)`; None when the weights are shared. The asynchronous driver takes it
        on the trainer's thread right after an update (the parameters hold still there) and
        installs it on the rollout thread between two steps' rollouts."""
        if self.shared:
            return None
        start = time.perf_counter()
        parts = list(self._converted())
        return Taken(parts, time.perf_counter() - start)

    @torch.no_grad()
    def refresh(self, taken: Taken | None = None) -> float:
        """Install the converted copy of the weights (only when not shared): taken now, or
        `taken` earlier by `take`. The policy publication's cost; returns seconds. Counts
        the publications (`generation`), so that every engine reading these weights can
        tell keys/values computed before."""
        self.generation += 1
        start = time.perf_counter()
        if self.shared:
            self._convert_mismatched()
            return time.perf_counter() - start
        # taken now, each tensor replaces (or is written into) the one it follows before
        # the next is made: a publication holds at most one projection twice, not the model
        for kind, key, value in (taken.parts if taken is not None else self._converted()):
            if kind == "tensor":
                self._tensors[key] = _into(self._tensors.get(key), value)
            else:  # written into the tensors already held: captured graphs read those
                name = key if len(key) > 1 else key[0]
                self._linears[name] = _into_dense(self._linears.get(name), value)
        return time.perf_counter() - start + (taken.seconds if taken is not None else 0.0)

    def _convert_mismatched(self) -> None:
        """A shared decoder's copies of what it reads in another precision (a bfloat16
        learner's float32 norm gains)."""
        for m in (*self._plain(), self.lm_head):
            w = m.weight
            if w.dtype != self.dtype or resolve_device(w.device) != self.device:
                new = w.detach().to(self.device, self.dtype)
                self._tensors[m] = _into(self._tensors.get(m), new)

    def _converted(self):
        """The weights in this decoder's precision and layout, one tensor or projection at
        a time: ("tensor", module, weight) and ("dense", modules, projection). Tensors
        already in that precision (int8's float32 norms and embedding) are the parameters'
        own, read in place, unless the decoder owns its weights."""
        pack = (self.dtype == torch.bfloat16 and self.device.type == "cpu"
                and torch.backends.mkldnn.is_available())
        for m in self._plain():
            yield "tensor", m, m.weight.detach().to(self.device, self.dtype, copy=self.own_weights)
        amax = self._input_ranges() if self.int8 else {}
        for mods in self._groups():
            ws = [_effective_weight(m) for m in mods]
            bs = [getattr(m, "bias", None) for m in mods]
            w = ws[0] if len(ws) == 1 else torch.cat(ws)
            b = None if all(x is None for x in bs) else torch.cat([
                x.detach() if x is not None else w_.new_zeros(w_.shape[0])
                for x, w_ in zip(bs, ws)])
            w = w.to(self.device, self.dtype, copy=self.own_weights and len(ws) == 1)
            b = None if b is None else b.to(self.device, self.dtype)
            self._sizes[mods] = [x.shape[0] for x in ws]
            if mods[0] in amax:
                smooth = (amax[mods[0]].clamp(min=1e-5) / w.abs().amax(0).clamp(min=1e-5)).sqrt()
                yield "dense", mods, Int8Dense(w, b, smooth)
            else:
                yield "dense", mods, Dense(w, b, pack=pack)

    def _int8_inputs(self) -> list[nn.Module]:
        """The first projection of each int8 group (the group's input is read through it);
        down_proj, whose input carries the largest outliers, stays float32."""
        return [self.lm_head] + [layer.self_attn.q_proj for layer in self.layers] + [
            layer.self_attn.o_proj for layer in self.layers] + [
            layer.mlp.gate_proj for layer in self.layers]

    def _input_ranges(self) -> dict[nn.Module, torch.Tensor]:
        """[K] max |x_j| of each int8 projection's input over one float32 pass of the model
        body (no output layer) on 2 x 32 fixed pseudo-random tokens: the channels that carry
        outliers do so for any input, and fixed tokens keep the conversion deterministic."""
        amax: dict[nn.Module, torch.Tensor] = {}

        def record(m, args):
            x = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float()
            amax[m] = torch.maximum(amax[m], x) if m in amax else x

        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.embed.weight.shape[0], (2, 32), generator=gen)
        hooks = [m.register_forward_pre_hook(record) for m in self._int8_inputs()]
        try:
            with stream_autocast(self.hf, self.embed.weight.device):
                out = self.hf.model(input_ids=tokens.to(self.embed.weight.device))
        finally:
            for h in hooks:
                h.remove()
        if self.lm_head in self._int8_inputs():  # its input is the body's (normed) output
            record(self.lm_head, (out.last_hidden_state,))
        return {m: x.to(self.device) for m, x in amax.items()}

    # -- reading the weights (the layers' only way in: layers.py) ---------------------------

    def tensor(self, m: nn.Module) -> torch.Tensor:
        """The weight of a module read as a tensor (embedding, norm gains), converted or in
        place."""
        return self._tensors.get(m, m.weight) if self.shared else self._tensors[m]

    def linear(self, x: torch.Tensor, m: nn.Module) -> torch.Tensor:
        """x W^T (+ b) of projection `m`: the converted copy, or the parameters in place."""
        if not self.shared:
            return self._linears[m](x)
        if type(m) is nn.Linear:
            return F.linear(x, self._tensors.get(m, m.weight), m.bias)
        return m(x)  # e.g. a LoRA-wrapped projection: its own forward reads live adapters

    def linears(self, x: torch.Tensor, mods: tuple[nn.Module, ...]) -> list[torch.Tensor]:
        """The projections `mods` of one input: one fused product when converted."""
        if self.shared:
            return [self.linear(x, m) for m in mods]
        return list(self._linears[mods](x).split(self._sizes[mods], -1))


def _into(old: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
    """`new`'s values in `old`'s storage when the two match in shape and dtype (a CUDA graph
    captured on `old` then reads the new values), else `new`."""
    if old is None or new is None or old.shape != new.shape or old.dtype != new.dtype:
        return new
    return old.copy_(new)


def _into_dense(old, new):
    """A converted projection updated in place (see `_into`); oneDNN-packed ones (CPU only,
    where nothing is captured) are replaced."""
    if type(old) is not type(new) or getattr(old, "packed", None) is not None:
        return new
    for name, value in vars(new).items():
        if isinstance(value, torch.Tensor):
            setattr(old, name, _into(getattr(old, name), value))
    return old


def _effective_weight(m: nn.Module) -> torch.Tensor:
    """A module's weight with active LoRA adapters merged in (peft layers), detached."""
    base = getattr(m, "base_layer", None)
    if base is None:
        return m.weight.detach()
    w = base.weight.detach().clone()
    if not getattr(m, "disable_adapters", False):
        for name in getattr(m, "active_adapters", []):
            if name in getattr(m, "lora_A", {}):
                w += m.get_delta_weight(name).to(w.dtype)
    return w
