"""Shared pieces of the benchmarks: the arithmetic workload, the matmul peak, medians, and
printing/writing results (a rich table, JSON, and the HTML page)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import typer


def load_workload(model: str, num_prompts: int, seed: int = 0, device: str = "cpu",
                  task: str = "arith", split: str = "eval", **options):
    """(policy, prompt ids) for a task the configs train on (default: two-digit addition);
    the tiny model is warm-started on the task's references exactly as training does
    (shared cache)."""
    from rollwise.compose.sections import TinyConfig
    from rollwise.models import load_policy
    from rollwise.tasks import make_task

    chat = model != "tiny"
    options = options or ({"digits": 2, "terms": 2} if task == "arith" else {})
    task = make_task(task, seed=seed, num_train=2000, num_eval=200, chat=chat, **options)
    if model == "tiny":
        warm = [(s.prompt, s.reference) for s in task.train if s.reference]
        policy = load_policy("tiny", device=device, warm_start=warm,
                             tiny=TinyConfig().model_dump() | {"seed": seed})
    else:
        policy = load_policy(model, device=device)
    pool = task.eval if split == "eval" else task.train  # "train" or "pairs": train split
    samples = (pool * (num_prompts // len(pool) + 1))[:num_prompts]
    if split == "pairs":
        return policy, [(s, policy.encode(s.prompt)) for s in samples]
    return policy, [policy.encode(s.prompt) for s in samples]


def matmul_peak_gflops(dtype: torch.dtype, size: int = 2048, reps: int = 5,
                       device: str = "cpu") -> float:
    """Median GFLOP/s of a plain size x size matrix product in `dtype` on this machine now
    (int8: GOP/s of the engine's integer product, `int8_kernel`: torch._int_mm, or FBGEMM's
    with its activation quantization; int32 accumulation)."""
    from rollwise.engine.projections import Int8Dense, int8_kernel

    if dtype == torch.int8 and int8_kernel(device) == "fbgemm":
        lin = Int8Dense(torch.randn(size, size), None, kernel="fbgemm")
        a = torch.randn(size, size)

        def product() -> torch.Tensor:
            return lin(a)
    elif dtype == torch.int8:
        a = torch.randint(-63, 64, (size, size), dtype=torch.int8, device=device)
        b = torch.randint(-63, 64, (size, size), dtype=torch.int8, device=device).t()

        def product() -> torch.Tensor:
            return torch._int_mm(a, b)
    else:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)

        def product() -> torch.Tensor:
            return a @ b
    product()
    times = []
    for _ in range(reps):
        synchronize(a.device)  # nothing queued may be counted in the timed product
        start = time.perf_counter()
        product()
        synchronize(a.device)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times) / 1e9


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# CUDA runtime/driver calls that each put one unit of work on the GPU: a kernel, or a whole
# captured graph (a replay counts as one)
_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
             "cudaGraphLaunch", "cuGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")


def dispatches_per_call(fn, calls: int, device: torch.device | str) -> tuple[float, str, float]:
    """(count per call, what was counted, device busy fraction) of `fn` run `calls` times
    under the torch profiler: on a GPU the kernel launches, graph replays and copies the
    host queued, and the share of the wall time the GPU spent in kernels; on a CPU the aten
    operators dispatched (nested ones included) and NaN. Counts are deterministic for a
    given code path, unlike wall time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize(device)
        wall = time.perf_counter() - start
    events = prof.events()
    if cuda:
        n = sum(1 for e in events if e.name in _LAUNCHES)
        busy = sum(e.device_time for e in events if e.device_type.name == "CUDA") / 1e6 / wall
        return n / calls, "GPU launches (kernels, graph replays, copies)", min(busy, 1.0)
    n = sum(1 for e in events if e.name.startswith("aten::"))
    return n / calls, "aten ops", float("nan")


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def print_table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="left" if c in ("engine", "workload", "strategy") else "right")
    for r in rows:
        table.add_row(*[_fmt(r.get(c)) for c in columns])
    console = Console()
    if not console.is_terminal:  # a log or a pipe: never squeeze figures into 80 columns
        console = Console(width=200)
    console.print(table)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)


def write_results(data: dict, json_path: Path | None) -> Path | None:
    """Write the JSON and its HTML page next to it; returns the page's path."""
    if json_path is None:
        return None
    from rollwise.observe import write_bench_report

    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(data, indent=2))
    return write_bench_report(json_path)


def save_results(data: dict, json_path: Path | None) -> None:
    """`write_results`, then say where the JSON and its page went."""
    page = write_results(data, json_path)
    if page:
        typer.echo(f"wrote {json_path} and {page}")


def say(message: str) -> None:
    """A progress line on stderr (the tables go to stdout)."""
    typer.echo(f"  {message}", err=True)


_SDPA_REGISTERED = {"done": False}


def _register_cpu_sdpa_flops() -> None:
    """torch's FLOP counter has no formula for the CPU attention kernel
    (`_scaled_dot_product_flash_attention_for_cpu`), so attention on a CPU would count 0.
    Forward: 4 x batch x query heads x queries x keys x head size (Q K^T and P V, grouped
    key/value heads included); backward: twice that (dV, dP, dQ, dK)."""
    if _SDPA_REGISTERED["done"]:
        return
    from torch.utils.flop_counter import register_flop_formula

    aten = torch.ops.aten

    def forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        b, h, sq, d = query_shape
        return 4 * b * h * sq * key_shape[2] * d

    def backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                 **kwargs) -> int:
        return 2 * forward(query_shape, key_shape, value_shape)

    for op, formula in ((aten._scaled_dot_product_flash_attention_for_cpu, forward),
                        (aten._scaled_dot_product_flash_attention_for_cpu_backward, backward)):
        try:
            register_flop_formula(op)(formula)
        except (RuntimeError, ValueError):  # torch gained its own: keep it
            pass
    _SDPA_REGISTERED["done"] = True


def count_flops(fn) -> tuple[Any, int]:
    """(fn(), the FLOPs torch's counter counted in it), CPU attention included."""
    from torch.utils.flop_counter import FlopCounterMode

    _register_cpu_sdpa_flops()
    with FlopCounterMode(display=False) as counter:
        out = fn()
    return out, int(counter.get_total_flops())
