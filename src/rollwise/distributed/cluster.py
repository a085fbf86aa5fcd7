"""Joining (or starting) the Ray cluster a run uses, with clear errors instead of hangs."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from rollwise.compose.config import ConfigError

INSTALL = "pip install 'rollwise[ray]'"


def import_ray():
    """The `ray` module, or a ConfigError naming the command that installs it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(f"run.backend='ray' needs Ray, which is not installed: {INSTALL}"
                          ) from None
    return ray


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of a Ray address: 'host:port', 'ray://host:port'; the GCS default port
    6379 when none is given."""
    rest = address.split("://", 1)[-1].rstrip("/")
    host, _, port = rest.rpartition(":")
    if not host:
        return rest, 6379
    try:
        return host, int(port)
    except ValueError:
        raise ConfigError(f"ray.address = '{address}': expected host:port, e.g. "
                          "'10.0.0.5:6379'") from None


def probe(address: str, timeout_s: float = 3.0) -> None:
    """Fail within `timeout_s` when nothing listens at the address (ray.init would wait
    for a minute or more before giving up)."""
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        raise ConfigError(
            f"ray.address = '{address}': no Ray cluster answers at {host}:{port} ({e}); "
            "start one with `ray start --head` on that machine, fix the address, or leave "
            "ray.address (and RAY_ADDRESS) unset to start a local cluster") from None


def worker_env() -> dict:
    """The runtime environment of every actor: rollwise importable from the same source
    tree as the driver (a development checkout as much as an installed package)."""
    src = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
    return {"env_vars": {"PYTHONPATH": path, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
                         "TOKENIZERS_PARALLELISM": "false"}}


def connect(address: str | None = None, *, num_cpus: int | None = None):
    """The `ray` module, initialised: an already initialised one as it is; else the
    cluster at `address` (or $RAY_ADDRESS), probed first; else a new local cluster.
    Returns (ray, started): whether this call started the connection (its owner shuts
    it down)."""
    ray = import_ray()
    if ray.is_initialized():
        return ray, False
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address and address not in ("auto", "local"):
        probe(address)
    options = {"num_cpus": num_cpus} if not address or address == "local" else {}
    ray.init(address=address, include_dashboard=False, logging_level="ERROR",
             runtime_env=worker_env(), **options)
    return ray, True
