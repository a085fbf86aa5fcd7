"""Precision chosen by the machine: what `auto` means for `engine.dtype`,
`learner.precision` and `algorithm.correction`.

    choice = resolve("auto", "auto", "auto", shapes=ModelShapes.of(model), device="cpu")
    choice.rollout, choice.learner, choice.correction   # e.g. "int8", "float32", "tis"

A probe looks at the CPU's instruction sets (what torch dispatches to, plus /proc/cpuinfo or
the platform's equivalent) and times the candidate precisions on the model's own matrix
shapes for a second or two: the rollout's products at decode batch size (float32, bfloat16,
int8 with per-row activation scales) and the learner's forward + backward (float32 against
bfloat16 autocast). The measurement runs twice; when the two passes disagree (a choice
differs, or a ratio to float32 by more than AGREE: other work on the machine came or went)
a third runs, the median of the three decides this run, and nothing is cached. A consistent
result is cached per machine, torch version, vector-ISA caps, threads and shapes under
`$ROLLWISE_CACHE/probe/`, so later runs decide instantly; `ROLLWISE_REPROBE=1` (or
`rollwise bench probe`) measures again and replaces the entry.

The rule, on the CPU: bfloat16 only where the instruction set computes it natively
(AVX-512-BF16, AMX, Arm BF16) and the probe measures it faster; otherwise int8 rollouts when
the probe measures them faster and the integer kernel is a real one (oneDNN's VNNI kernels,
or FBGEMM's on AVX2: `engine.projections.int8_kernel`), never on torch's reference loop;
else float32. Models narrower than MIN_HIDDEN stay float32
(their steps are overhead, not arithmetic). The learner takes bfloat16 autocast under the
same two conditions. The mismatch correction follows: token TIS whenever the engine samples
at another precision than the learner computes in, none when both are float32. On CUDA:
bfloat16 where the device supports it. Any explicit setting wins; asking for bfloat16 where
it is emulated works but warns once with the measured slowdown, and so does asking for
int8 where only the reference loop computes it.

`ROLLWISE_AUTO_PRECISION=float32` makes `auto` mean float32 everywhere without probing
(results then do not depend on the machine's speed; the test suite uses it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROLLOUT_DTYPES = ("float32", "bfloat16", "int8")
LEARNER_PRECISIONS = ("float32", "bf16-autocast")
ADOPT_SPEEDUP = 1.25  # a lower precision is adopted only this much faster than float32
AGREE = 1.25  # two probe passes agree when every ratio to float32 is within this factor
# Below this hidden size a decode step's time is per-operation overhead, not arithmetic: the
# built-in tiny model (hidden 128) ran at 0.96x (bfloat16) and 0.91x (int8) of float32's
# tokens/s although its products alone time faster. Such models stay float32, unprobed.
MIN_HIDDEN = 512
_ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16", "FEAT_BF16")  # x86 cpuinfo; Arm (Linux, macOS)
_warned: set[str] = set()


@dataclass(frozen=True)
class ModelShapes:
    """The matrix shapes the probe times: hidden size, MLP width, attention q/k/v width."""

    hidden: int
    intermediate: int
    qkv: int

    @classmethod
    def of(cls, model) -> ModelShapes:
        cfg = getattr(model, "config", None)
        if cfg is None and hasattr(model, "get_base_model"):
            cfg = model.get_base_model().config
        hidden = int(cfg.hidden_size)
        heads = int(cfg.num_attention_heads)
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
        return cls(hidden, int(cfg.intermediate_size), (heads + 2 * kv) * head_dim)


@dataclass
class Probe:
    """What the machine is and how fast each precision ran on the model's shapes."""

    cpu: str  # model name
    isa: str  # torch.backends.cpu.get_cpu_capability() (honours ATEN_CPU_CAPABILITY)
    flags: list[str]  # the relevant instruction-set flags the CPU reports
    native_bf16: bool  # the CPU computes bfloat16 in hardware and torch may dispatch to it
    rollout_gflops: dict[str, float]  # decode-shaped products, per rollout dtype
    learner_gflops: dict[str, float]  # forward + backward, per learner precision
    torch_version: str = torch.__version__
    threads: int = 1
    caps: dict[str, str] = field(default_factory=dict)  # vector-ISA caps in the environment
    seconds: float = 0.0  # time the measurement took
    cached: bool = False
    passes: int = 1  # measurement passes run
    consistent: bool = True  # the passes agreed (only then is the result cached)
    int8_kernel: str = "onednn"  # engine.projections.int8_kernel: what the int8 figure ran

    def speedup(self, kind: str, name: str) -> float:
        table = self.rollout_gflops if kind == "rollout" else self.learner_gflops
        base = table.get("float32") or float("nan")
        return table.get(name, float("nan")) / base


@dataclass
class PrecisionChoice:
    rollout: str  # float32 | bfloat16 | int8
    learner: str  # float32 | bf16-autocast
    correction: str  # none | tis | ... (a corrections registry name)
    source: dict[str, str]  # per setting: "auto" or "explicit"
    probe: Probe | None = None

    def line(self) -> str:
        """The run header's one line: the choice and the measured ratios behind it."""
        src = self.source
        parts = [f"rollout {self.rollout}" + (" (auto)" if src["rollout"] == "auto" else ""),
                 f"learner {self.learner}" + (" (auto)" if src["learner"] == "auto" else ""),
                 f"correction {self.correction}"
                 + (" (auto)" if src["correction"] == "auto" else "")]
        text = "precision: " + ", ".join(parts)
        p = self.probe
        if p is None:
            return text
        ratios = ", ".join(f"{k} {p.speedup('rollout', k):.2f}x" for k in p.rollout_gflops
                           if k != "float32")
        learn = ", ".join(f"{k} {p.speedup('learner', k):.2f}x" for k in p.learner_gflops
                          if k != "float32")
        bf16 = "native bf16" if p.native_bf16 else "no native bf16"
        return (f"{text} | {p.cpu} ({p.isa}, {bf16}, int8 by {p.int8_kernel}); vs float32: "
                f"rollout {ratios}; learner "
                f"{learn}; {p.threads} threads" + (" [cached probe]" if p.cached else
                f" [probed in {p.seconds:.1f}s, {p.passes} passes"
                + ("]" if p.consistent else ": inconsistent, not cached]")))

    def record(self) -> dict:
        out = {"rollout": self.rollout, "learner": self.learner, "correction": self.correction,
               "source": self.source}
        if self.probe is not None:
            out["probe"] = asdict(self.probe)
        return out


# -- what the CPU is --------------------------------------------------------------------------

def cpu_flags() -> set[str]:
    """Instruction-set flags of this CPU: /proc/cpuinfo on Linux, sysctl on macOS."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    if platform.system() == "Darwin":
        import subprocess

        try:
            out = subprocess.run(["sysctl", "-a"], capture_output=True, text=True, timeout=5,
                                 check=False)
        except (OSError, subprocess.SubprocessError):
            return set()
        return {line.split(".")[-1].split(":")[0] for line in out.stdout.splitlines()
                if line.startswith("hw.optional.arm.FEAT_") and line.rstrip().endswith("1")}
    return set()


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def best_isa(flags: set[str] | None = None) -> str:
    """The CPU's own best vector ISA, from its flags (an environment cap changes what torch
    and oneDNN dispatch to, never these): amx, avx512_bf16, avx512_vnni, avx512, avx2,
    arm_bf16, arm or baseline. Figures and pinned metrics name it beside torch's dispatch."""
    flags = cpu_flags() if flags is None else flags
    for name, needs in (("amx", {"amx_bf16"}), ("avx512_bf16", {"avx512_bf16"}),
                        ("avx512_vnni", {"avx512_vnni"}), ("avx512", {"avx512f"}),
                        ("avx2", {"avx2"}), ("arm_bf16", {"bf16"}), ("arm", {"asimd"})):
        if needs <= flags:
            return name
    return "baseline"


def native_bf16(flags: set[str], isa: str) -> bool:
    """bfloat16 in hardware, and torch not capped below the ISA that has it. An AVX2 or
    DEFAULT dispatch (e.g. ATEN_CPU_CAPABILITY=avx2) means the bf16 instructions go unused."""
    if not any(f in flags for f in _BF16_FLAGS):
        return False
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if cap and "BF16" not in cap and "AMX" not in cap and cap != "ALL":
        return False
    return isa not in ("AVX2", "DEFAULT", "NO AVX")


# -- the micro-benchmark ----------------------------------------------------------------------

def _interleaved(fns: dict[str, object], budget_s: float) -> dict[str, float]:
    """Median seconds per call of each function, timed in alternating rounds (at least 5,
    until `budget_s` has passed): a busy machine slows every candidate alike, so their
    ratios hold where absolute figures would not. A candidate 3x slower than the fastest
    on its first timed call (emulated bfloat16, say) is not timed again: it cannot win."""
    for fn in fns.values():
        fn()  # warm-up: weight packing, allocator
    times: dict[str, list[float]] = {k: [] for k in fns}
    end = time.perf_counter() + budget_s
    live = list(fns)
    rounds = 0
    while rounds < 5 or (time.perf_counter() < end and rounds < 60):
        for k in live:
            start = time.perf_counter()
            fns[k]()  # type: ignore[operator]
            times[k].append(time.perf_counter() - start)
        if rounds == 0:
            best = min(t[0] for t in times.values())
            live = [k for k in live if times[k][0] < 3 * best]
        rounds += 1
    return {k: statistics.median(v) for k, v in times.items()}


def _rollout_layer(shapes: ModelShapes, dtype: str, rows: int):
    """One decoder layer's projections at `rows` decode rows, in `dtype` as the engine
    runs them (fused q/k/v and gate/up; int8 with per-row activation quantization)."""
    from rollwise.engine.projections import Dense, Int8Dense

    h, i, q = shapes.hidden, shapes.intermediate, shapes.qkv
    gen = torch.Generator().manual_seed(0)
    mats = [(q, h), (h, h), (2 * i, h), (h, i)]
    ws = [torch.randn(n, k, generator=gen) * k**-0.5 for n, k in mats]
    xs = [torch.randn(rows, k, generator=gen) for _, k in mats]
    if dtype == "int8":
        ones = [torch.ones(k) for _, k in mats]
        lins = [Int8Dense(w, None, s) for w, s in zip(ws, ones)]
    else:
        dt = getattr(torch, dtype)
        pack = dt == torch.bfloat16 and torch.backends.mkldnn.is_available()
        lins = [Dense(w.to(dt), None, pack=pack) for w in ws]
        xs = [x.to(dt) for x in xs]

    def layer():
        for lin, x in zip(lins, xs):
            lin(x)

    return layer, 2 * rows * sum(n * k for n, k in mats)


def _learner_step(shapes: ModelShapes, precision: str, rows: int):
    """Forward and backward of the MLP's products over `rows` tokens (weights float32, as
    the learner's master copy), in float32 or under bfloat16 autocast."""
    h, i = shapes.hidden, shapes.intermediate
    gen = torch.Generator().manual_seed(1)
    up = (torch.randn(2 * i, h, generator=gen) * h**-0.5).requires_grad_()
    down = (torch.randn(h, i, generator=gen) * i**-0.5).requires_grad_()
    x = torch.randn(rows, h, generator=gen, requires_grad=True)

    def step():
        ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-autocast"
               else contextlib.nullcontext())
        with ctx:
            a, b = torch.nn.functional.linear(x, up).chunk(2, -1)
            y = torch.nn.functional.linear(torch.nn.functional.silu(a) * b, down)
        y.float().sum().backward()
        up.grad = down.grad = x.grad = None

    return step, 3 * 2 * rows * (2 * i * h + h * i)  # forward, and backward's two products


def _gflops(work: dict[str, tuple], budget_s: float) -> dict[str, float]:
    seconds = _interleaved({k: fn for k, (fn, _) in work.items()}, budget_s)
    return {k: work[k][1] / seconds[k] / 1e9 for k in work}


def _cache_path(key: dict) -> Path:
    from rollwise.models.tiny import cache_root

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "probe" / f"{digest}.json"


def _measure(shapes: ModelShapes, budget_s: float) -> tuple[dict[str, float], dict[str, float]]:
    """One pass: (rollout GFLOP/s per dtype, learner GFLOP/s per precision)."""
    with torch.no_grad():
        rollout = _gflops({d: _rollout_layer(shapes, d, 64) for d in ROLLOUT_DTYPES}, budget_s)
    return rollout, _gflops({p: _learner_step(shapes, p, 256) for p in LEARNER_PRECISIONS},
                            budget_s)


def _agree(a: Probe, b: Probe) -> bool:
    """Two passes lead to the same choice and every ratio to float32 is within AGREE."""
    if choose(a) != choose(b):
        return False
    for kind, table in (("rollout", a.rollout_gflops), ("learner", a.learner_gflops)):
        for name in table:
            x, y = a.speedup(kind, name), b.speedup(kind, name)
            if not (x > 0 and y > 0 and max(x, y) / min(x, y) <= AGREE):
                return False
    return True


def probe(shapes: ModelShapes, *, threads: int | None = None, budget_s: float = 0.6,
          use_cache: bool = True, fresh: bool = False) -> Probe:
    """Measure (or read from the cache) this CPU's speed per precision on `shapes`: two
    passes, a third when they disagree (module docstring); only a consistent result is
    cached. `fresh` or `ROLLWISE_REPROBE=1`: a cached entry is ignored (and replaced)."""
    from rollwise.engine.projections import int8_kernel

    threads = threads or torch.get_num_threads()
    kernel = int8_kernel("cpu")
    flags = cpu_flags()
    isa = torch.backends.cpu.get_cpu_capability()
    caps = {k: os.environ[k] for k in _ISA_CAPS if k in os.environ}
    relevant = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))
                      or f in _BF16_FLAGS or f in ("asimd", "sve", "i8mm"))
    key = {"cpu": cpu_name(), "flags": relevant, "isa": isa, "caps": caps,
           "torch": torch.__version__, "threads": threads, "shapes": asdict(shapes),
           "int8": kernel, "v": 3}
    path = _cache_path(key)  # v3: entries from before the FBGEMM kernel are measured again
    if use_cache and path.is_file() and not (fresh or os.environ.get("ROLLWISE_REPROBE")):
        try:
            data = json.loads(path.read_text())
            return Probe(**data | {"cached": True})
        except (OSError, ValueError, TypeError):
            pass  # a damaged cache entry is measured again
    start = time.perf_counter()
    native = native_bf16(flags, isa)
    passes = [Probe(cpu=key["cpu"], isa=isa, flags=relevant, native_bf16=native,
                    rollout_gflops=r, learner_gflops=lr, threads=threads, caps=caps,
                    int8_kernel=kernel)
              for r, lr in (_measure(shapes, budget_s) for _ in range(2))]
    consistent = _agree(*passes)
    if not consistent:
        r, lr = _measure(shapes, budget_s)
        passes.append(dataclasses.replace(passes[0], rollout_gflops=r, learner_gflops=lr))
    result = dataclasses.replace(
        passes[0], rollout_gflops=_median_table([p.rollout_gflops for p in passes]),
        learner_gflops=_median_table([p.learner_gflops for p in passes]),
        seconds=time.perf_counter() - start, passes=len(passes), consistent=consistent)
    if use_cache and consistent:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")  # parallel writers (test workers)
            tmp.write_text(json.dumps(asdict(result) | {"cached": False}))
            tmp.replace(path)
        except OSError:
            pass  # an unwritable cache only costs the next run a second
    return result


def _median_table(tables: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(t[k] for t in tables) for k in tables[0]}


# -- the decision -----------------------------------------------------------------------------

def choose(p: Probe, *, int8: bool = True) -> tuple[str, str]:
    """(rollout dtype, learner precision) for a probed CPU; see the module docstring."""
    def fast(kind: str, name: str) -> bool:
        return p.speedup(kind, name) >= ADOPT_SPEEDUP

    if p.native_bf16 and fast("rollout", "bfloat16"):
        rollout = "bfloat16"
    elif int8 and p.int8_kernel != "loop" and fast("rollout", "int8"):
        rollout = "int8"
    else:
        rollout = "float32"
    learner = ("bf16-autocast" if p.native_bf16 and fast("learner", "bf16-autocast")
               else "float32")
    return rollout, learner


def default_correction(rollout: str, learner: str) -> str:
    """TIS whenever the engine's precision is not the learner's float32 (bf16-autocast
    products still differ from a bfloat16 engine's), none when both are float32."""
    return "none" if (rollout, learner) == ("float32", "float32") else "tis"


def resolve(rollout: str, learner: str, correction: str, *, shapes: ModelShapes | None,
            device: str = "cpu", engine: str = "native", echo=None) -> PrecisionChoice:
    """Settle every `auto` among the three settings; warn once when bfloat16 is asked for
    on a CPU that emulates it. `shapes` None (no model at hand) probes nothing."""
    source = {"rollout": "auto" if rollout == "auto" else "explicit",
              "learner": "auto" if learner == "auto" else "explicit",
              "correction": "auto" if correction == "auto" else "explicit"}
    dev = torch.device(device)
    p: Probe | None = None
    if os.environ.get("ROLLWISE_AUTO_PRECISION", "").lower() == "float32":
        auto_rollout, auto_learner = "float32", "float32"
    elif dev.type == "cuda":
        bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        auto_rollout, auto_learner = ("bfloat16", "bf16-autocast") if bf16 else (
            "float32", "float32")
    else:
        wants_bf16 = rollout == "bfloat16" or learner == "bf16-autocast"
        wants_loop = rollout == "int8" and _int8_on_loop()  # explicit int8, no real kernel
        small = shapes is None or shapes.hidden < MIN_HIDDEN
        if shapes is not None and (wants_bf16 or wants_loop or ("auto" in (rollout, learner)
                                                               and not small)):
            p = probe(shapes)  # small models: only to warn about what is asked for
        auto_rollout, auto_learner = (choose(p) if p is not None and not small
                                      else ("float32", "float32"))
        if p is not None and ((wants_bf16 and not p.native_bf16) or wants_loop):
            _warn_emulated(p, rollout, learner, echo, int8_loop=wants_loop)
    if engine != "native":  # the HF engine samples from the model as it is
        auto_rollout = "float32"
    r = auto_rollout if rollout == "auto" else rollout
    lr = auto_learner if learner == "auto" else learner
    c = default_correction(r, lr) if correction == "auto" else correction
    return PrecisionChoice(rollout=r, learner=lr, correction=c, source=source, probe=p)


def _int8_on_loop() -> bool:
    from rollwise.engine.projections import int8_kernel

    return int8_kernel("cpu") == "loop"


def _warn_emulated(p: Probe, rollout: str, learner: str, echo, int8_loop: bool = False
                   ) -> None:
    """Warn once that what was asked for is emulated here (bfloat16 without native
    bfloat16, int8 on torch's reference loop), with the probe's measured speed."""
    slow, lacks = [], []
    if rollout == "bfloat16" and not p.native_bf16:
        slow.append(f"engine.dtype='bfloat16' ran at {p.speedup('rollout', 'bfloat16'):.2f}x "
                    "float32's speed")
    if learner == "bf16-autocast" and not p.native_bf16:
        slow.append(f"learner.precision='bf16-autocast' at "
                    f"{p.speedup('learner', 'bf16-autocast'):.2f}x")
    if slow:
        lacks.append("no native bfloat16")
    if rollout == "int8" and int8_loop:
        slow.append(f"engine.dtype='int8' ran at {p.speedup('rollout', 'int8'):.2f}x "
                    "float32's speed (torch's reference integer loop)")
        lacks.append("no fast int8 kernel (no VNNI, no FBGEMM)")
    message = (f"this CPU ({p.cpu}, {p.isa}) has " + " and ".join(lacks)
               + ", so it is emulated: " + "; ".join(slow) + " in the probe. 'auto' would "
               "pick " + "/".join(choose(p)) + ".")
    if message in _warned:
        return
    _warned.add(message)
    if echo is not None:
        echo(f"warning: {message}")
    else:
        warnings.warn(message, stacklevel=3)
