"""The native engine's converted projections: `Dense` (y = x W^T + b in the engine's float
dtype, bfloat16 weights on the CPU in oneDNN's packed layout) and `Int8Dense` (int8 weights
per output channel, activations quantized per row at each call, optional SmoothQuant
factors), `int8_kernel` (which integer product this process runs) and `int8_weight_levels`
(7-bit weights where the integer kernel would saturate). `engine/decoder.py` builds them at
each publication; docs/precision.md has the measurements.

Imports torch only.
"""

from __future__ import annotations

import os
import warnings

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


# ONEDNN_MAX_CPU_ISA values at or above an ISA with VNNI (AVX512_CORE_VNNI, AVX2_VNNI, ...)
_VNNI_ISAS = ("VNNI", "BF16", "AMX", "FP16", "ALL")
INT8_KERNELS = ("onednn", "fbgemm", "loop", "device")


def int8_kernel(device: torch.device | str = "cpu") -> str:
    """The integer product `Int8Dense` runs in this process:

    - "onednn": `torch._int_mm`, which reaches oneDNN's VNNI kernels only where the CPU has
      AVX-512-VNNI (torch asks cpuinfo) and no vector-ISA cap hides it;
    - "fbgemm": on other x86 CPUs (AVX2), FBGEMM's dynamic-quantized linear (unsigned 7-bit
      activations against signed 8-bit weights, `reduce_range`, so its 16-bit pair sums never
      saturate). Measured on a real AVX2 CPU at SmolLM2's shapes it ran 2.1-2.8x float32
      where `torch._int_mm` ran 0.04-0.11x (docs/precision.md). A run capped to AVX2
      (ATEN_CPU_CAPABILITY=avx2 or ONEDNN_MAX_CPU_ISA below VNNI) takes it too, so a capped
      run computes what a real AVX2 CPU computes (not at its speed);
    - "loop": `torch._int_mm`'s reference triple loop (no VNNI and no FBGEMM, e.g. Arm):
      exact but far slower than float32, so `auto` never picks int8 there;
    - "device": an accelerator's own integer kernels (`torch._int_mm` on CUDA)."""
    device = torch.device(device)
    if device.type != "cpu":
        return "device"
    isa_cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    capped = (os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("avx2", "default")
              or bool(isa_cap and not any(t in isa_cap for t in _VNNI_ISAS)))
    if torch.cpu._is_vnni_supported() and not capped:
        return "onednn"
    return "fbgemm" if _has_fbgemm() else "loop"


def _has_fbgemm() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


_weight_levels: dict[str, int] = {}


def int8_weight_levels(device: torch.device | str = "cpu") -> int:
    """127, or 63 where this process's `torch._int_mm` saturates with full-range weights.

    oneDNN capped below VNNI multiplies unsigned 8-bit activations (the signed ones shifted
    by 128) with signed 8-bit weights and adds pairs into 16 bits with saturation: 255 x 127
    x 2 overflows 32767, while 255 x 64 x 2 does not. So there the weights use 7 bits. (The
    "fbgemm" kernel keeps 8-bit weights: its activations take 7 bits instead.) Decided by a
    product whose exact result is known, once per process and device (the kernel does not
    change within one); on a GPU the product runs there (its integer kernels accumulate in
    32 bits: 127 expected)."""
    device = torch.device(device)
    key = torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else str(device)
    if key not in _weight_levels:
        x = torch.full((32, 256), 127, dtype=torch.int8, device=device)
        w = torch.full((32, 256), 127, dtype=torch.int8, device=device)
        exact = bool((torch._int_mm(x, w.t()) == 127 * 127 * 256).all())
        _weight_levels[key] = 127 if exact else 63
    return _weight_levels[key]


def _fbgemm_pack(wq: torch.Tensor, scale: torch.Tensor):
    """FBGEMM's packed form of int8 weights `wq` [N, K] (scales [N], per output channel),
    with two zero columns appended for `Int8Dense`'s range columns."""
    padded = torch.cat([wq, wq.new_zeros(wq.shape[0], 2)], 1)
    engine = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = "fbgemm"
        with warnings.catch_warnings():  # quantized tensors are deprecated in torch 2.13,
            warnings.simplefilter("ignore")  # still the only way into FBGEMM's kernels
            qw = torch._make_per_channel_quantized_tensor(
                padded, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0)
            return torch.ops.quantized.linear_prepack(qw, None)
    finally:
        torch.backends.quantized.engine = engine


class Int8Dense:
    """y ~ x W^T (+ b) from int8 operands: W quantized once per output channel (symmetric,
    scale = max |w| / levels, so rounding never overflows; levels 127, or 63 where the
    kernel would saturate: int8_weight_levels), x per row at each call.

    On the "onednn", "loop" and "device" kernels (`int8_kernel`) x is symmetric 8-bit, step
    max|x_m| / 127. On "fbgemm" each row is divided by its max |x_m| and two columns (+1, -1)
    are appended, so FBGEMM's per-tensor dynamic range is [-1, 1] for every batch: the
    quantization is per row (a token's result does not depend on the other rows), step
    2 max|x_m| / 127 (7 bits), zero point 64. Error per element: half a step of each operand
    before accumulation (exact int32 sums)."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None,
                 smooth: torch.Tensor | None = None, kernel: str | None = None):
        """`smooth`: [K] SmoothQuant factors s; W is stored as W s and x is read as x / s.
        `kernel`: one of INT8_KERNELS (default: `int8_kernel(w.device)`)."""
        self.kernel = kernel or int8_kernel(w.device)
        if self.kernel not in INT8_KERNELS:
            raise ValueError(f"int8 kernel must be one of {INT8_KERNELS}, not {self.kernel!r}")
        w = w.float() if smooth is None else w.float() * smooth
        self.inv = None if smooth is None else 1.0 / smooth
        levels = 127 if self.kernel == "fbgemm" else int8_weight_levels(w.device)
        self.scale = w.abs().amax(1).clamp_(min=1e-12) / levels  # [N]
        # stored [N, K] and passed transposed: the layout oneDNN's int8 product runs fastest on
        self.wq = (w / self.scale[:, None]).round_().to(torch.int8)
        self.b = None if b is None else b.float()
        self.packed = None
        if self.kernel == "fbgemm":
            self.packed = _fbgemm_pack(self.wq, self.scale)
            self.wq = None  # FBGEMM holds its own copy

    @property
    def activation_step(self) -> float:
        """A row's quantization step as a multiple of its max |x_m| (module docstring)."""
        return 2 / 127 if self.kernel == "fbgemm" else 1 / 127

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.inv is not None:
            x2 = x2 * self.inv
        amax = x2.abs().amax(-1, keepdim=True).clamp_(min=1e-12)  # [M, 1]
        if self.packed is not None:
            rows = x2.new_empty(x2.shape[0], x2.shape[1] + 2)  # [M, K + 2]: x / amax, +1, -1
            torch.div(x2, amax, out=rows[:, :-2])
            rows[:, -2], rows[:, -1] = 1.0, -1.0
            # FBGEMM applies both scales itself (the weights' are in the packed tensor)
            y = torch.ops.quantized.linear_dynamic(rows, self.packed, True).mul_(amax)
        else:
            sx = amax.div_(127)
            xq = (x2 / sx).round_().to(torch.int8)
            y = torch._int_mm(xq, self.wq.t()).float().mul_(sx).mul_(self.scale)
        if self.b is not None:
            y += self.b
        return y.view(*shape[:-1], -1)
