"""The integer products torch offers on this CPU, against float32, at SmolLM2's layer shapes.

    python scripts/int8_kernels.py [THREADS]

One decoder layer's projections (q/k/v 960 x 576, o 576 x 576, gate/up 3072 x 576, down
576 x 1536) at 16, 64 and 256 rows, each candidate timed against float32 `F.linear` on the
same inputs, alternating round by round; the table is each one's median speed as a multiple
of float32's. Candidates: `torch._int_mm` (oneDNN's VNNI kernels where the CPU has
AVX-512-VNNI, else torch's reference loop), FBGEMM's dynamic-quantized linear with and
without `reduce_range`, weight-only `torch._weight_int8pack_mm` (float32 and bfloat16
inputs), the dynamic-quantized linear on the `onednn` engine, and the engine's own
`Int8Dense` as shipped (`int8_kernel()` picks its product). docs/precision.md, "int8 on a
real AVX2 CPU", has the figures of a real AVX2 CPU.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from rollwise.engine.projections import Int8Dense, int8_kernel

MATS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per projection


def _median_seconds(fns: dict, reps: int) -> dict[str, float]:
    for f in fns.values():
        f()
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            start = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def _quantized_packs(ws: list[torch.Tensor], engine: str) -> list:
    torch.backends.quantized.engine = engine
    packs = []
    for w in ws:
        scale = w.abs().amax(1) / 127
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized tensors are deprecated in torch 2.13
            qw = torch.quantize_per_channel(w, scale.double(), zero, 0, torch.qint8)
        packs.append(torch.ops.quantized.linear_prepack(qw, None))
    return packs


def candidates(rows: int) -> dict:
    ws = [torch.randn(n, k) * k**-0.5 for n, k in MATS]
    xs = [torch.randn(rows, k) for _, k in MATS]
    wq = [(w / (w.abs().amax(1, keepdim=True) / 127)).round().to(torch.int8) for w in ws]
    xq = [(x / (x.abs().amax(1, keepdim=True) / 127)).round().to(torch.int8) for x in xs]
    scales = [w.abs().amax(1) / 127 for w in ws]
    xb, sb = [x.bfloat16() for x in xs], [s.bfloat16() for s in scales]
    has_fbgemm = "fbgemm" in torch.backends.quantized.supported_engines
    fb = _quantized_packs(ws, "fbgemm") if has_fbgemm else None
    dnn = _quantized_packs(ws, "onednn")
    lins = [Int8Dense(w, None) for w in ws]
    out = {
        "float32": lambda: [F.linear(x, w) for x, w in zip(xs, ws)],
        "_int_mm": lambda: [torch._int_mm(a, b.t()) for a, b in zip(xq, wq)],
        "weight_int8pack f32": lambda: [torch._weight_int8pack_mm(x, q, s)
                                        for x, q, s in zip(xs, wq, scales)],
        "weight_int8pack bf16": lambda: [torch._weight_int8pack_mm(x, q, s)
                                         for x, q, s in zip(xb, wq, sb)],
        "onednn dynamic": lambda: [torch.ops.quantized.linear_dynamic(x, p, False)
                                   for x, p in zip(xs, dnn)],
        f"Int8Dense ({int8_kernel()})": lambda: [lin(x) for lin, x in zip(lins, xs)],
    }
    if fb is not None:
        out["fbgemm reduce_range"] = lambda: [torch.ops.quantized.linear_dynamic(x, p, True)
                                              for x, p in zip(xs, fb)]
        out["fbgemm full range"] = lambda: [torch.ops.quantized.linear_dynamic(x, p, False)
                                            for x, p in zip(xs, fb)]
    return out


def main(threads: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    print(f"torch {torch.__version__}, dispatch {torch.backends.cpu.get_cpu_capability()}, "
          f"VNNI {torch.cpu._is_vnni_supported()}, int8_kernel {int8_kernel()}, "
          f"{threads} threads")
    for rows in (16, 64, 256):
        seconds = _median_seconds(candidates(rows), reps=15 if rows < 256 else 8)
        flops = 2 * rows * sum(n * k for n, k in MATS)
        base = seconds["float32"]
        print(f"rows {rows}: float32 {flops / base / 1e9:.1f} GFLOP/s; "
              + ", ".join(f"{k} {base / v:.2f}x" for k, v in seconds.items() if k != "float32"))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
