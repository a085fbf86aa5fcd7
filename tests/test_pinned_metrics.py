"""Behaviour pinned across refactors, in two layers that together hold on every CPU kind.

(a) Exact pins, per CPU kind. Short tiny runs (float32, one thread) give the metrics recorded
    before, to the last bit (1e-9 relative only absorbs a differently ordered Python float
    sum over a step's records). Float32 kernels differ between CPU kinds (vector width and
    blocking change summation order, and sampling or a greedy argmax amplifies the last bit),
    so the pins are kept per kind: `pin_kind()`, which names torch's dispatch capability
    (it honours ATEN_CPU_CAPABILITY), the CPU's own best ISA from its flags (a cap does not
    hide hardware checks, so a capped AVX-512 CPU is not a real AVX2 one), torch's version
    and MKL's reproducibility mode where MKL runs the products (rollwise sets MKL_CBWR on
    import, which changes the float32 bits against MKL's default). A kind with no pin skips
    this layer with one line naming its key.

(b) A replay that runs on every kind. The tokens the pinned default run sampled (recorded
    once, tests/data/pinned_replay.json) are fed back teacher-forced: no sampling, no argmax.
    The same weights on every kind (an integer-valued uniform init: no library's random
    normal, whose vectorised code differs by ISA), then per step: score (rewards recomputed
    from the text), advantages, one update with a KL term, an entropy bonus, TIS against the
    recorded behaviour log-probs and two PPO epochs (so the ratio, clipping and KL move).
    Group structure, rewards and token counts must be equal exactly; the figures within the
    float32 bound below.

    The bound. u = 2^-24; the tiny model has L = 4 layers and its longest reduction is
    n = 384 (the MLP's down projection). A float32 forward pass computes a log-prob within
    about (L + 2) sqrt(n) u of exact, relative (each chained reduction adds sqrt(n) u for
    rounding errors of random sign; the embedding, the final norm and the output layer are
    the +2), so two CPU kinds agree within twice that: eps = 2 (L + 2) sqrt(n) u ~ 1.4e-5.
    Each update carries the previous steps' differences forward (Adam divides a gradient by
    its own scale, so a relative change of a gradient moves the weights by at most that
    relative change of the step), so step k (from 0) is held to (k + 1) eps, relative to the
    figure's own scale (its magnitude, or the advantages' scale, 1, for sums that cancel).
    A 4x margin covers the sqrt(n) law's tails. The clip fraction is a count: a ratio within
    the bound of a clip edge may fall either side, so it may differ by one token per epoch.
    The float64 replay in this file checks the bound against this machine's own rounding.

To re-record after an intended change: ROLLWISE_PIN_WRITE=1 pytest tests/test_pinned_metrics.py
(layer (a) for this machine's kind, layer (b)'s tokens and figures; the quickstart pin, on
SmolLM2, is slow: `-m slow`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from rollwise.compose.config import load_config, to_toml
from rollwise.compose.precision import best_isa, cpu_flags
from rollwise.pipeline.build import build
from rollwise.pipeline.loop import train
from rollwise.run.rundir import Run
from rollwise.types import Group

CONFIG = Path(__file__).parents[1] / "configs" / "tiny_arith.toml"
FIXTURE = Path(__file__).parent / "data" / "pinned_metrics.json"
REPLAY = Path(__file__).parent / "data" / "pinned_replay.json"
QUICKSTART = Path(__file__).parents[1] / "configs" / "quickstart.toml"
QUICKSTART_FIXTURE = Path(__file__).parent / "data" / "pinned_quickstart.json"
WRITE = bool(os.environ.get("ROLLWISE_PIN_WRITE"))
pytestmark = pytest.mark.precision  # `make test` runs them capped to AVX2 too

# Each variant walks a different path through the stages: the default native scheduler,
# the HF engine's plain generation, partial rollouts with speculative reuse (pool carried
# across steps) and the adaptive allocator's extra rounds.
VARIANTS = {
    "default": [],
    "hf": ["engine.name='hf'"],
    "partial_reuse": ["schedule.strategy='partial'", "speculation.reuse=true"],
    "dynamic": ["control.allocator='dynamic'"],
}
# measurements of this machine, not arithmetic: times, and the process's memory peaks
TIMING = ("time_", "wall_time", "_per_s", "seconds", "makespan", "tail_s", "eta", "peak_rss_",
          "cuda_max_allocated")
# the replay's settings: every term of the update moves (module docstring, layer (b))
REPLAY_SETTINGS = ["algorithm.kl_coef=0.05", "algorithm.entropy_coef=0.01",
                   "learner.ppo_epochs=2", "algorithm.correction='tis'", "model.tiny.sft_steps=0"]
U, LAYERS, LONGEST = 2.0**-24, 4, 384
EPS = 2 * (LAYERS + 2) * math.sqrt(LONGEST) * U  # two kinds' float32 forward passes
MARGIN = 4.0
# the update's figures the replay compares, and the scale of each one's terms
REPLAY_FIGURES = {"loss": 1.0, "kl": None, "entropy": None, "grad_norm": None,
                  "ratio_mean": None, "ratio_max": None, "correction_weight_mean": None}


def pin_kind(flags: set[str] | None = None, capability: str | None = None) -> str:
    """The key of this process's exact pins: what changes the float32 bits (docstring)."""
    flags = cpu_flags() if flags is None else flags
    capability = capability or torch.backends.cpu.get_cpu_capability()
    kind = f"{capability} on {best_isa(flags)} torch {torch.__version__}"
    mode = os.environ.get("MKL_CBWR") if torch.backends.mkl.is_available() else None
    return f"{kind} mkl {mode}" if mode else kind


def _run(tmp_path: Path, extra: list[str], config: Path = CONFIG, stages_hook=None
         ) -> list[dict]:
    cfg = load_config(config, [f"run.output_dir='{tmp_path}'", "run.num_steps=6",
                               "run.threads=1", "rollout.prompts_per_step=6",
                               "task.num_eval=24", "eval.every=3", *extra])
    stages = build(cfg)
    if stages_hook is not None:
        stages_hook(stages)
    run = Run(tmp_path / cfg.run.name, resume=False, config_toml=to_toml(cfg),
              echo=lambda s: None)
    train(stages, run, cfg.run.num_steps, eval_every=cfg.eval.every)
    lines = (tmp_path / cfg.run.name / "metrics.jsonl").read_text().splitlines()
    return [_figures(json.loads(x)) for x in lines]


def _figures(record: dict) -> dict:
    return {k: v for k, v in sorted(record.items())
            if k == "kind" or (isinstance(v, (int, float)) and not any(t in k for t in TIMING))}


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def _pins(path: Path, kind: str, what: str) -> dict | list:
    """This kind's pins in `path`, or a skip naming the key and how to record it."""
    pinned = json.loads(path.read_text()) if path.exists() else {}
    if kind not in pinned:
        pytest.skip(f"no {what} pin for CPU kind '{kind}' (recorded: {sorted(pinned)}); "
                    "ROLLWISE_PIN_WRITE=1 records one (layer (b), the replay, still runs)")
    return pinned[kind]


def _write_pin(path: Path, kind: str, value, variant: str | None = None) -> None:
    pinned = json.loads(path.read_text()) if path.exists() else {}
    if variant is None:
        pinned[kind] = value
    else:
        pinned.setdefault(kind, {})[variant] = value
    path.write_text(json.dumps(pinned, indent=1, sort_keys=True) + "\n")


# -- layer (a): exact, per CPU kind ------------------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_metrics_match_the_pinned_run(tmp_path, variant):
    kind = pin_kind()
    if not WRITE:
        expected = _pins(FIXTURE, kind, "exact")[variant]
    capture = variant == "default" and WRITE  # the replay's tokens come from this run
    records = _run(tmp_path, VARIANTS[variant], stages_hook=_capture if capture else None)
    if WRITE:
        _write_pin(FIXTURE, kind, records, variant)
        return
    assert len(records) == len(expected)
    for got, want in zip(records, expected, strict=True):
        assert sorted(got) == sorted(want), (got.get("step"), set(got) ^ set(want))
        diff = {k: (got[k], want[k]) for k in want if not _same(got[k], want[k])}
        assert not diff, f"step {want.get('step')} ({want.get('kind')}) on {kind}: {diff}"
    train_steps = [r for r in expected if r["kind"] == "train"]
    assert len(train_steps) == 6 and any(r["loss"] != 0 for r in train_steps)


def test_pin_kind_tells_a_capped_cpu_from_a_real_one(monkeypatch):
    if torch.backends.mkl.is_available():  # and MKL's reproducibility mode, which moves bits
        assert pin_kind().endswith(f" mkl {os.environ['MKL_CBWR']}")
        monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
        assert pin_kind().endswith(" mkl COMPATIBLE")
        monkeypatch.delenv("MKL_CBWR")
        assert " mkl " not in pin_kind()
    real = pin_kind({"avx2", "fma", "f16c"}, "AVX2")
    capped = pin_kind({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}, "AVX2")
    assert real.startswith("AVX2 on avx2 ") and capped.startswith("AVX2 on avx512_bf16 ")
    assert best_isa({"avx2", "avx512f", "amx_bf16", "avx512_bf16"}) == "amx"


def test_an_unknown_kind_skips_layer_a_with_its_key(tmp_path, monkeypatch):
    """A kind with no pin: one line naming its key and how to record it (the replay below
    runs on it all the same)."""
    monkeypatch.delenv("ROLLWISE_PIN_WRITE", raising=False)
    kind = pin_kind({"avx2", "sse4_2"}, "ZVECTOR")
    with pytest.raises(pytest.skip.Exception) as skipped:
        _pins(FIXTURE, kind, "exact")
    line = str(skipped.value)
    assert f"'{kind}'" in line and "ROLLWISE_PIN_WRITE=1" in line and "\n" not in line


# -- layer (b): teacher-forced replay, every kind ----------------------------------------------

def _capture(stages) -> None:
    """Record the groups each step trains on, as plain data (ROLLWISE_PIN_WRITE only)."""
    steps: list[list[dict]] = []
    advantages = stages.advantages

    def recording(groups):
        steps.append([g.to_plain() for g in groups])
        return advantages(groups)

    stages.advantages = recording
    _capture.steps = steps


def fixed_init(model: torch.nn.Module) -> None:
    """The same weights on every CPU kind: uniform on [-0.04, 0.04) in steps of 2^-15 x 0.04
    from integer draws (exact in float32), norms 1; the tied embedding once."""
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                k = rng.integers(0, 2**16, size=tuple(p.shape), dtype=np.int64)
                p.copy_(torch.from_numpy((k.astype(np.float64) / 2**15 - 1) * 0.04))


def replay(tmp_path: Path, steps: list[list[dict]], dtype=torch.float32,
           extra: tuple[str, ...] = ()) -> list[dict]:
    """Each recorded step's groups through score -> advantages -> update from `fixed_init`
    weights: the figures of every step (module docstring, layer (b))."""
    cfg = load_config(CONFIG, [f"run.output_dir='{tmp_path}'", "run.threads=1",
                               "task.num_eval=8", *REPLAY_SETTINGS, *extra])
    stages = build(cfg)
    learner = stages.learner
    for model in (learner.model, learner.ref_model):
        fixed_init(model)
        model.to(dtype)
    samples = stages.samples_by_id()
    out = []
    try:
        for plain in steps:
            groups = [Group.from_plain(g, samples) for g in plain]
            for t in (t for g in groups for t in g.trajectories):
                t.reward, t.scores, t.advantage = 0.0, {}, None  # recomputed below
            stages.score(groups)
            batch = stages.advantages(groups)
            update = stages.update(batch)
            trajs = [t for g in groups for t in g.trajectories]
            out.append({"group_sizes": [len(g.trajectories) for g in groups],
                        "rewards": [t.reward for t in trajs],
                        "tokens": int(batch.loss_mask.sum()),
                        "advantages": [t.advantage for t in trajs],
                        "clip_frac": update.get("clip_frac", 0.0)}
                       | {k: float(update[k]) for k in REPLAY_FIGURES if k in update})
    finally:
        stages.close()
    return out


def _within(got: float, want: float, tol: float, scale: float | None) -> bool:
    return abs(got - want) <= tol * max(abs(want), scale or 0.0)


def compare_replay(got: list[dict], want: list[dict], margin: float = MARGIN) -> list[str]:
    """Where `got` leaves the bounds around `want` (module docstring): [] when it holds."""
    bad = []
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        tol = margin * (k + 1) * EPS
        for key in ("group_sizes", "rewards", "tokens"):  # exact
            if g[key] != w[key]:
                bad.append(f"step {k}: {key} {g[key]} != {w[key]}")
        for i, (a, b) in enumerate(zip(g["advantages"], w["advantages"], strict=True)):
            if not _within(a, b, tol, 1.0):
                bad.append(f"step {k}: advantage {i} {a} vs {b}")
        for key, scale in REPLAY_FIGURES.items():
            if (key in w) != (key in g):
                bad.append(f"step {k}: {key} present in one replay only")
            elif key in w and not _within(g[key], w[key], tol, scale):
                bad.append(f"step {k}: {key} {g[key]} vs {w[key]} (bound {tol:.2g} rel)")
        if abs(g["clip_frac"] - w["clip_frac"]) > 2 / max(w["tokens"], 1) + 1e-12:
            bad.append(f"step {k}: clip_frac {g['clip_frac']} vs {w['clip_frac']}")
    return bad


@pytest.fixture(scope="module")
def pinned_replay() -> dict:
    if WRITE:
        pytest.skip("the replay is re-recorded by test_replay_matches_on_every_cpu_kind")
    return json.loads(REPLAY.read_text())


def test_replay_matches_on_every_cpu_kind(tmp_path, request):
    if WRITE:  # the default variant's tokens (recorded by layer (a) in this session)
        steps = getattr(_capture, "steps", None)
        if steps is None:
            pytest.skip("run with test_metrics_match_the_pinned_run[default] to re-record")
        figures = replay(tmp_path, steps)
        REPLAY.write_text(json.dumps({"recorded_on": pin_kind(), "steps": steps,
                                      "figures": figures}, sort_keys=True) + "\n")
        return
    pinned = request.getfixturevalue("pinned_replay")
    got = replay(tmp_path, pinned["steps"])
    bad = compare_replay(got, pinned["figures"])
    assert not bad, f"on {pin_kind()} against {pinned['recorded_on']}: " + "; ".join(bad)
    # the replay exercises what it claims: KL and clipping moved, rewards vary
    assert any(f.get("kl", 0) > 0 for f in got) and any(f["clip_frac"] > 0 for f in got)
    assert len({r for f in got for r in f["rewards"]}) > 1


def test_the_replay_bound_holds_this_machines_rounding(tmp_path, pinned_replay):
    """Float32 against a float64 replay of the same tokens: this machine's own float32
    error stays within half the bound, so two kinds (each within it) stay within it all."""
    steps = pinned_replay["steps"][:3]
    f32 = replay(tmp_path / "f32", steps)
    f64 = replay(tmp_path / "f64", steps, dtype=torch.float64)
    assert not compare_replay(f32, f64, margin=MARGIN / 2)
    # and it has teeth: a learning rate 0.1% off leaves it
    nudged = replay(tmp_path / "lr", steps, extra=("learner.lr=4.004e-4",))
    assert compare_replay(nudged, f32)


@pytest.mark.slow
def test_quickstart_first_steps_match_the_pinned_run(tmp_path):
    """The quickstart's first two steps on SmolLM2, in float32, per CPU kind (layer (a))."""
    kind = pin_kind()
    records = _run(tmp_path, ["run.num_steps=2", "rollout.prompts_per_step=4",
                              "task.num_eval=16", "eval.every=0", "engine.dtype='float32'",
                              "learner.precision='float32'", "algorithm.correction='none'"],
                   config=QUICKSTART)
    if WRITE:
        _write_pin(QUICKSTART_FIXTURE, kind, records)
        return
    for got, want in zip(records, _pins(QUICKSTART_FIXTURE, kind, "quickstart"), strict=True):
        diff = {k: (got.get(k), want[k]) for k in want if not _same(got.get(k), want[k])}
        assert not diff, f"step {want.get('step')} ({want.get('kind')}): {diff}"
    assert [r["kind"] for r in records].count("train") == 2
