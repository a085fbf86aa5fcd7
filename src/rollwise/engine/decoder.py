"""The native engine's forward pass for Llama-family decoders (Llama/SmolLM, Qwen2, Qwen3,
Mistral), reading the transformers model's own parameter tensors.

Two passes share the layer code:

- `prefill`: a batch of group prompts (right-padded), causal self-attention, keys and values
  written to the prefix region of the cache; returns the next-token logits of each prompt.
- `forward_rows`: a chunk of `c_r` new tokens for each running row (1 when decoding, more
  when resuming or verifying a draft). A query attends to its group's prompt (one copy for
  the whole group: queries are regrouped so the product is one matrix multiply per group)
  and to its own earlier tokens, under one softmax.

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
from rollwise.engine.kvcache import KVCache
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
class RowPlan:
    """Everything a `forward_rows` call needs about its rows, built once per call."""

    rows: slice | torch.Tensor  # the cache rows of the B inputs (a slice when contiguous)
    tokens: torch.Tensor  # [B, C] input ids (right-padded chunks)
    cos: torch.Tensor  # [B, C, 1, d]
    sin: torch.Tensor
    write_rows: torch.Tensor  # [B*C] cache row of each input token
    write_pos: torch.Tensor  # [B*C] position in the row's own region
    smax: int  # own-token keys to read
    gslots: torch.Tensor | None  # prefix slots read, None when they are 0..G-1
    groups: int  # G
    nmax: int  # rows per group, padded
    gpos: torch.Tensor  # [B] index of each row in the [G * nmax] group layout
    pmax: int  # prefix keys to read
    mask: torch.Tensor  # [B, 1, rep*C, pmax + smax] additive

    def prefix(self, t: torch.Tensor) -> torch.Tensor:
        view = t[:, :, : self.pmax]
        return view[: self.groups] if self.gslots is None else view.index_select(0, self.gslots)

    def to_groups(self, t: torch.Tensor) -> torch.Tensor:
        """[B, kvH, M, X] row layout -> [G, kvH, nmax*M, X] (absent rows are zero)."""
        _, h, m, x = t.shape
        buf = t.new_zeros(self.groups * self.nmax, h, m, x)
        buf[self.gpos] = t
        return buf.view(self.groups, self.nmax, h, m, x).transpose(1, 2).reshape(
            self.groups, h, self.nmax * m, x)

    def to_rows(self, t: torch.Tensor, m: int) -> torch.Tensor:
        """[G, kvH, nmax*M, X] group layout -> [B, kvH, M, X]."""
        g, h, _, x = t.shape
        return t.view(g, h, self.nmax, m, x).transpose(1, 2).reshape(g * self.nmax, h, m, x)[
            self.gpos]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


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

    def _w(self, m: nn.Module) -> torch.Tensor:
        return self._tensors.get(m, m.weight) if self.shared else self._tensors[m]

    def _lin(self, x: torch.Tensor, m: nn.Module) -> torch.Tensor:
        if not self.shared:
            return self._linears[m](x)
        if type(m) is nn.Linear:
            return F.linear(x, self._tensors.get(m, m.weight), m.bias)
        return m(x)  # e.g. a LoRA-wrapped projection: its own forward reads live adapters

    def _lin_many(self, x: torch.Tensor, mods: tuple[nn.Module, ...]) -> list[torch.Tensor]:
        """The projections `mods` of one input: one fused product when converted."""
        if self.shared:
            return [self._lin(x, m) for m in mods]
        return list(self._linears[mods](x).split(self._sizes[mods], -1))

    def _rms(self, x: torch.Tensor, m: nn.Module) -> torch.Tensor:
        eps = getattr(m, "variance_epsilon", getattr(m, "eps", 1e-6))
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self._w(m), eps)
        return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * self._w(m)

    def _mlp(self, x: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
        gate, up = self._lin_many(x, (mlp.gate_proj, mlp.up_proj))
        gate = F.silu(gate) if self.silu else mlp.act_fn(gate)
        return self._lin(gate * up, mlp.down_proj)

    def _qkv(self, x, layer, cos, sin):
        a = layer.self_attn
        b, c, _ = x.shape
        h = self._rms(x, layer.input_layernorm)
        q, k, v = self._lin_many(h, (a.q_proj, a.k_proj, a.v_proj))
        q = q.reshape(b, c, self.heads, self.head_dim)
        k = k.reshape(b, c, self.kv_heads, self.head_dim)
        v = v.reshape(b, c, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self._rms(q, a.q_norm), self._rms(k, a.k_norm)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, D] last hidden states -> [N, V] float32 logits."""
        return self._lin(self._rms(hidden, self.norm), self.lm_head).float()

    # -- passes ----------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, cache: KVCache, tokens: torch.Tensor, lengths: list[int],
                slot0: int) -> torch.Tensor:
        """Prompts [g, P] (right-padded) into prefix slots slot0..slot0+g-1; [g, V] logits."""
        g, p = tokens.shape
        cos, sin = self.cos[:p][None, :, None], self.sin[:p][None, :, None]
        x = F.embedding(tokens, self._w(self.embed))
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer, cos, sin)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            cache.pk[i][slot0: slot0 + g, :, :p] = k
            cache.pv[i][slot0: slot0 + g, :, :p] = v
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True,
                                               scale=self.scale, enable_gqa=self.rep > 1)
            x = x + self._lin(o.transpose(1, 2).reshape(g, p, -1), layer.self_attn.o_proj)
            x = x + self._mlp(self._rms(x, layer.post_attention_layernorm), layer.mlp)
        last = x[torch.arange(g, device=x.device), torch.tensor(lengths, device=x.device) - 1]
        return self.logits(last)

    @torch.inference_mode()
    def prefill_from(self, cache: KVCache, slots: list[int], tokens: list[list[int]],
                     starts: list[int]) -> torch.Tensor:
        """The rest of g prompts whose first `starts[i]` tokens are already in prefix slot
        `slots[i]`: `tokens[i]` at positions starts[i].. attend to those and causally to
        each other, and their keys/values are written after them. One pass; [g, V] logits."""
        dev = self.device
        g, w = len(tokens), max(len(t) for t in tokens)
        ids = torch.zeros(g, w, dtype=torch.long)
        for r, t in enumerate(tokens):
            ids[r, : len(t)] = torch.tensor(t)
        start = torch.tensor(starts)
        n = torch.tensor([len(t) for t in tokens])
        pos = start[:, None] + torch.arange(w)  # [g, w]
        valid = torch.arange(w)[None] < n[:, None]  # [g, w] real tokens, not padding
        # padding queries attend like their row's last real token (no unwritten keys)
        pos = torch.minimum(pos, (start + n - 1)[:, None])
        end = int((start + n).max())
        mask = (torch.arange(end)[None, None] <= pos[:, :, None])[:, None].to(dev)  # [g,1,w,E]
        slot_t = torch.tensor(slots)
        put = (slot_t[:, None].expand(g, w)[valid].to(dev), pos[valid].to(dev))
        pos, valid = pos.to(dev), valid.to(dev)
        cos, sin = self.cos[pos][:, :, None], self.sin[pos][:, :, None]
        x = F.embedding(ids.to(dev), self._w(self.embed))
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer, cos, sin)  # k, v: [g, w, kv_heads, head_dim]
            cache.pk[i][put[0], :, put[1]] = k[valid]
            cache.pv[i][put[0], :, put[1]] = v[valid]
            keys, values = cache.pk[i][slot_t, :, :end], cache.pv[i][slot_t, :, :end]
            o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                               scale=self.scale, enable_gqa=self.rep > 1)
            x = x + self._lin(o.transpose(1, 2).reshape(g, w, -1), layer.self_attn.o_proj)
            x = x + self._mlp(self._rms(x, layer.post_attention_layernorm), layer.mlp)
        return self.logits(x[torch.arange(g, device=dev), (n - 1).to(dev)])

    def plan(self, rows: list[int], tokens: list[list[int]], own: list[int], slots: list[int],
             prefix_lens: list[int]) -> RowPlan:
        """Plan a `forward_rows` over cache `rows` with chunks `tokens`, `own[r]` own tokens
        already cached, prompt in prefix slot `slots[r]` of length `prefix_lens[r]`."""
        dev = self.device
        r0 = rows[0]
        row_sel = (slice(r0, r0 + len(rows)) if rows == list(range(r0, r0 + len(rows)))
                   else torch.tensor(rows, device=dev))
        b, c = len(tokens), max(len(t) for t in tokens)
        ids = torch.zeros(b, c, dtype=torch.long)
        for r, t in enumerate(tokens):
            ids[r, : len(t)] = torch.tensor(t)
        own_t = torch.tensor(own)
        plen = torch.tensor(prefix_lens)
        step = torch.arange(c)
        positions = (plen + own_t)[:, None] + step  # [B, C]
        positions.clamp_(max=self.max_context - 1)  # padding beyond the context is masked
        smax = max(o + len(t) for o, t in zip(own, tokens))
        pmax = max(prefix_lens)
        # group layout: slot -> group index, and each row's place among its siblings
        unique = sorted(set(slots))
        contiguous = unique == list(range(len(unique)))
        index = {s: i for i, s in enumerate(unique)}
        seen: dict[int, int] = {}
        gpos_list = []
        for s in slots:
            j = seen.get(s, 0)
            seen[s] = j + 1
            gpos_list.append((index[s], j))
        nmax = max(seen.values())
        gpos = torch.tensor([g * nmax + j for g, j in gpos_list])
        ok_pre = torch.arange(pmax)[None, None, :] < plen[:, None, None]  # [B, 1, P]
        ok_own = torch.arange(smax)[None, None, :] <= (own_t[:, None] + step)[:, :, None]
        ok = torch.cat([ok_pre.expand(b, c, pmax), ok_own], dim=-1)  # [B, C, P+S]
        mask = torch.zeros(ok.shape, dtype=self.dtype).masked_fill_(~ok, float("-inf"))
        mask = mask[:, None, None].expand(b, 1, self.rep, c, pmax + smax).reshape(
            b, 1, self.rep * c, pmax + smax)
        return RowPlan(
            rows=row_sel, tokens=ids.to(dev), cos=self.cos[positions.to(dev)][:, :, None],
            sin=self.sin[positions.to(dev)][:, :, None],
            write_rows=torch.tensor(rows).repeat_interleave(c).to(dev),
            write_pos=(own_t[:, None] + step).reshape(-1).to(dev), smax=smax,
            gslots=None if contiguous else torch.tensor(unique, device=dev),
            groups=len(unique), nmax=nmax, gpos=gpos.to(dev), pmax=pmax, mask=mask.to(dev))

    @torch.inference_mode()
    def forward_rows(self, cache: KVCache, p: RowPlan) -> torch.Tensor:
        """Run the planned chunks; returns [B, C, D] hidden states (before the final norm)."""
        x = F.embedding(p.tokens, self._w(self.embed))
        b, c = p.tokens.shape
        rows = p.rows
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer, p.cos, p.sin)
            rk, rv = cache.rk[i], cache.rv[i]
            rk[p.write_rows, :, p.write_pos] = k.reshape(b * c, self.kv_heads, self.head_dim)
            rv[p.write_rows, :, p.write_pos] = v.reshape(b * c, self.kv_heads, self.head_dim)
            qh = q.view(b, c, self.kv_heads, self.rep, self.head_dim).permute(0, 2, 3, 1, 4)
            qh = qh.reshape(b, self.kv_heads, self.rep * c, self.head_dim)
            m = self.rep * c
            own_k, own_v = rk[rows, :, : p.smax], rv[rows, :, : p.smax]
            pre_k, pre_v = p.prefix(cache.pk[i]), p.prefix(cache.pv[i])
            s_pre = p.to_rows(p.to_groups(qh) @ pre_k.transpose(-1, -2), m)
            scores = torch.cat([s_pre, qh @ own_k.transpose(-1, -2)], dim=-1)
            scores = scores.float().mul_(self.scale).add_(p.mask)
            probs = scores.softmax(-1).to(self.dtype)
            out = probs[..., p.pmax:] @ own_v
            out = out + p.to_rows(p.to_groups(probs[..., : p.pmax]) @ pre_v, m)
            out = out.view(b, self.kv_heads, self.rep, c, self.head_dim).permute(0, 3, 1, 2, 4)
            x = x + self._lin(out.reshape(b, c, -1), layer.self_attn.o_proj)
            x = x + self._mlp(self._rms(x, layer.post_attention_layernorm), layer.mlp)
        return x


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
