"""The native engine's converted projections: `Dense` (y = x W^T + b in the engine's float
dtype, bfloat16 weights on the CPU in oneDNN's packed layout) and `Int8Dense` (int8 weights
per output channel, activations quantized per row at each call, optional SmoothQuant
factors), and `int8_weight_levels` (7-bit weights where the integer kernel would saturate).
`engine/decoder.py` builds them at each publication; docs/precision.md has the measurements.

Imports torch only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Dense:
    """A converted projection: y = x W^T (+ b) in the engine's dtype. bfloat16 weights on
    the CPU are reordered once, at conversion, into oneDNN's blocked layout (`pack`), so a
    product does not re-pack the weight on every call; the result is the same."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, pack: bool = False):
        self.w, self.b, self.packed = w, b, None
        if pack:
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
                self.w = None
            except (RuntimeError, AttributeError):  # no oneDNN in this build: plain linear
                self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.b, "none", [], "")
        return F.linear(x, self.w, self.b)


_weight_levels: dict[str, int] = {}


def int8_weight_levels(device: torch.device | str = "cpu") -> int:
    """127, or 63 where this process's int8 product saturates with full-range weights.

    Without VNNI (AVX2, or oneDNN capped to it) the integer kernel multiplies unsigned 8-bit
    activations (the signed ones shifted by 128) with signed 8-bit weights and adds pairs into
    16 bits with saturation: 255 x 127 x 2 overflows 32767, while 255 x 64 x 2 does not. So
    there the weights use 7 bits. Decided by a product whose exact result is known, once per
    process and device (the kernel does not change within one); on a GPU the product runs
    there (its integer kernels accumulate in 32 bits: 127 expected)."""
    device = torch.device(device)
    key = torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else str(device)
    if key not in _weight_levels:
        x = torch.full((32, 256), 127, dtype=torch.int8, device=device)
        w = torch.full((32, 256), 127, dtype=torch.int8, device=device)
        exact = bool((torch._int_mm(x, w.t()) == 127 * 127 * 256).all())
        _weight_levels[key] = 127 if exact else 63
    return _weight_levels[key]


class Int8Dense:
    """y ~ x W^T (+ b) from int8 operands: W quantized once per output channel, x per row at
    each call; both symmetric (scale = max |value| / levels, so rounding never overflows;
    levels 127, or 63 for weights where the kernel would saturate: int8_weight_levels).
    Error per product: each operand is off by at most half a step, i.e. relative error of
    order 1/254 (1/126) per factor before accumulation (exact int32 sums)."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None,
                 smooth: torch.Tensor | None = None):
        """`smooth`: [K] SmoothQuant factors s; W is stored as W s and x is read as x / s."""
        w = w.float() if smooth is None else w.float() * smooth
        self.inv = None if smooth is None else 1.0 / smooth
        self.scale = w.abs().amax(1).clamp_(min=1e-12) / int8_weight_levels(w.device)  # [N]
        # stored [N, K] and passed transposed: the layout oneDNN's int8 product runs fastest on
        self.wq = (w / self.scale[:, None]).round_().to(torch.int8)
        self.b = None if b is None else b.float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.inv is not None:
            x2 = x2 * self.inv
        sx = x2.abs().amax(-1, keepdim=True).clamp_(min=1e-12).div_(127)  # [M, 1]
        xq = (x2 / sx).round_().to(torch.int8)
        y = torch._int_mm(xq, self.wq.t()).float().mul_(sx).mul_(self.scale)
        if self.b is not None:
            y += self.b
        return y.view(*shape[:-1], -1)
