"""The decoder's layer computations, written once for every pass (nano-vllm's model side):
the RMS norm, the q/k/v projections with rotary positions, the gated MLP, the output
logits, and `Layers.forward`, the one layer body (q/k/v, attention, o_proj, MLP) that the
prompt prefill, the chunk pass and the static decode step all run. A pass differs from
another only in where it writes a layer's keys/values and what its queries attend to:
that is the `attend` callable it hands to `forward` (see passes.py and step.py).

Weights are read through the `Decoder`'s public `tensor` / `linear` / `linears`
(decoder.py), never its storage.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rollwise.engine.decoder import Decoder

# (layer index, q [B, C, heads, hd], k [B, C, kv_heads, hd], v) -> [B, C, heads * hd]:
# writes the layer's keys/values where the pass keeps them and returns the attention output
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [..., hd] (the half-split layout of Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Layers:
    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self.heads, self.kv_heads, self.head_dim = decoder.heads, decoder.kv_heads, decoder.head_dim
        self.rep, self.scale, self.dtype = decoder.rep, decoder.scale, decoder.dtype
        self.device = decoder.device

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, C] ids -> [B, C, D] input embeddings."""
        return F.embedding(tokens, self.decoder.tensor(self.decoder.embed))

    def rms(self, x: torch.Tensor, m: nn.Module) -> torch.Tensor:
        """RMS norm with module `m`'s gain (float32 statistics for lower precisions)."""
        eps = getattr(m, "variance_epsilon", getattr(m, "eps", 1e-6))
        w = self.decoder.tensor(m)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, eps)
        return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * w

    def qkv(self, x: torch.Tensor, layer: nn.Module, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, C, D] -> q [B, C, heads, hd], k and v [B, C, kv_heads, hd] (q, k rotated)."""
        a = layer.self_attn
        b, c, _ = x.shape
        h = self.rms(x, layer.input_layernorm)
        q, k, v = self.decoder.linears(h, (a.q_proj, a.k_proj, a.v_proj))
        q = q.reshape(b, c, self.heads, self.head_dim)
        k = k.reshape(b, c, self.kv_heads, self.head_dim)
        v = v.reshape(b, c, self.kv_heads, self.head_dim)
        if self.decoder.qk_norm:
            q, k = self.rms(q, a.q_norm), self.rms(k, a.k_norm)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def mlp(self, x: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
        d = self.decoder
        gate, up = d.linears(x, (mlp.gate_proj, mlp.up_proj))
        gate = F.silu(gate) if d.silu else mlp.act_fn(gate)
        return d.linear(gate * up, mlp.down_proj)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, D] last hidden states -> [N, V] float32 logits."""
        d = self.decoder
        return d.linear(self.rms(hidden, d.norm), d.lm_head).float()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attend: Attend) -> torch.Tensor:
        """The layer body over every layer: x [B, C, D] embeddings -> [B, C, D] hidden
        states before the final norm. `cos`/`sin` broadcast against [B, C, heads, hd];
        `attend` (see `Attend`) is the pass's cache write and attention."""
        d = self.decoder
        for i, layer in enumerate(d.layers):
            q, k, v = self.qkv(x, layer, cos, sin)
            x = x + d.linear(attend(i, q, k, v), layer.self_attn.o_proj)
            x = x + self.mlp(self.rms(x, layer.post_attention_layernorm), layer.mlp)
        return x
