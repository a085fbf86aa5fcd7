"""The worker extension's direct full-weight load against vLLM's stock `reload_weights`, in
one vLLM process (the engine in process; runs with `.venv-vllm`'s python, `make vllm`).

    .venv-vllm/bin/python scripts/vllm_reload.py FOLDER [--rounds 5] [--json out.json]

FOLDER is a folder `rollwise serve-vllm` serves (untied, float32: `rollwise serve-vllm
smollm2-135m` leaves one under the rollwise cache, ~/.cache/rollwise/vllm/). A second
version is that folder's weights with noise of 1% of each tensor's spread, written to a
temporary folder. Each round loads the second version and then the first, once by each
loader, the loaders alternating which goes first; after every load the prompt log-probs of
a fixed text are taken. Printed, and written to --json: the seconds of each loader
(median, min, max), their median ratio, and whether the direct load's log-probs equal the
stock load's and the start-up's bit for bit (with the largest difference).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

TEXT = ("Question: what is 17 + 25? Answer: 17 + 25 = 42, so the answer is 42. The quick "
        "brown fox jumps over the lazy dog. ") * 3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_SERVER_DEV_MODE="1",
                      HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    import torch
    from safetensors.torch import load_file, save_file
    from vllm import LLM, SamplingParams

    first = args.folder.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        second = Path(tmp) / "second"
        second.mkdir()
        for f in first.iterdir():
            if f.name != "model.safetensors":
                (second / f.name).write_bytes(f.read_bytes())
        g = torch.Generator().manual_seed(0)
        tensors = load_file(str(first / "model.safetensors"))
        save_file({k: (v + 0.01 * v.float().std() * torch.randn(v.shape, generator=g))
                   .to(v.dtype).contiguous() for k, v in tensors.items()},
                  str(second / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        llm = LLM(model=str(first), dtype="float32", enforce_eager=True, max_model_len=1024,
                  worker_extension_cls="rollwise.rollout.vllm_worker.VLLMFolderWeights")
        worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)

        def logprobs() -> list[float]:
            llm.reset_prefix_cache()
            out = llm.generate([TEXT], params, use_tqdm=False)[0]
            return [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]

        start = logprobs()

        def load(folder: Path, loader: str) -> tuple[float, list[float]]:
            t = time.perf_counter()
            said = worker.rollwise_reload(str(folder), "auto" if loader == "direct" else loader)
            seconds = time.perf_counter() - t
            assert said["loader"] == loader, said
            return seconds, logprobs()

        seconds: dict[str, list[float]] = {"direct": [], "stock": []}
        got: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            for loader in (("direct", "stock") if r % 2 == 0 else ("stock", "direct")):
                for name, folder in (("second", second), ("first", first)):
                    s, got[loader, name] = load(folder, loader)
                    seconds[loader].append(s)

    def largest(a: list[float], b: list[float]) -> float:
        return max(abs(x - y) for x, y in zip(a, b, strict=True))

    from rollwise.compose.precision import best_isa, cpu_name

    result = {
        "machine": {"cpu": cpu_name(), "cpu_kind": best_isa(),
                    "dispatch": torch.backends.cpu.get_cpu_capability(),
                    "caps": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY",
                                                         "ONEDNN_MAX_CPU_ISA")
                             if k in os.environ},  # a capped run is not a real CPU of that kind
                    "cores": os.cpu_count(), "torch": torch.__version__},
        "folder": str(first), "rounds": args.rounds, "probe_tokens": len(start),
        **{f"{k}_s": {"median": statistics.median(v), "min": min(v), "max": max(v)}
           for k, v in seconds.items()},
        "stock_over_direct": statistics.median(
            s / d for s, d in zip(seconds["stock"], seconds["direct"], strict=True)),
        "direct_equals_stock": got["direct", "second"] == got["stock", "second"],
        "direct_vs_stock_max_diff": largest(got["direct", "second"], got["stock", "second"]),
        "direct_back_equals_startup": got["direct", "first"] == start,
        "versions_differ_by": largest(got["direct", "second"], start)}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
