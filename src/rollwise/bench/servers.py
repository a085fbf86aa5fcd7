"""`rollwise serve` subprocesses for benchmarks that train against a server
(`engine.name = "remote"`): started on a free localhost port with the model, precision and
threads of the training config, ready once `/health` answers, stopped at the end.

    with serve_for(cfg, dtype="bfloat16", log=Path("server.log")) as url:
        ...  # train with engine.remote_urls = [url]

Imports only the standard library and httpx (the config is read by attribute).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

SERVE_DTYPES = ("float32", "bfloat16")  # what `rollwise serve --dtype` accepts


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_command(cfg, port: int, dtype: str) -> list[str]:
    """The `rollwise serve` command line matching `cfg`: its model, `dtype` (the precision
    the training run's engine would sample in), its threads and its engine's batch and KV
    budget, so the server decodes as the in-process engine would."""
    if dtype not in SERVE_DTYPES:
        raise ValueError(f"rollwise serve samples in {' or '.join(SERVE_DTYPES)}, not "
                         f"{dtype!r}: set engine.dtype to one of them for remote variants")
    return [sys.executable, "-m", "rollwise", "serve", "--model", str(cfg.model.name),
            "--port", str(port), "--dtype", dtype, "--threads", str(cfg.run.threads),
            "--max-num-seqs", str(cfg.engine.batch_size),
            "--kv-budget-tokens", str(cfg.engine.kv_budget_tokens)]


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Return once `url`/health answers 200; raise when the process exits or time runs out
    (the log's tail in the message)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rollwise serve exited ({proc.returncode}): "
                               f"{log.read_text(errors='replace')[-1500:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"rollwise serve did not answer {url}/health within {timeout_s:g}s: "
                       f"{log.read_text(errors='replace')[-1500:]}")


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM (uvicorn shuts down cleanly), SIGKILL past `timeout_s`."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)


@contextlib.contextmanager
def serve_for(cfg, *, dtype: str, log: Path, timeout_s: float = 300.0) -> Iterator[str]:
    """A `rollwise serve` process for `cfg` on a free port for the `with` block; its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(serve_command(cfg, port, dtype), stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc, log, timeout_s)
        yield url
    finally:
        stop(proc)
