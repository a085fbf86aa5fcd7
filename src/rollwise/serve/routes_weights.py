"""The weight routes: POST /v1/weights/update (new weights from a folder of safetensors,
while serving), GET /v1/weights (the version, whether an update runs) and GET /version.

An update runs in phases, each bounded by the request's `timeout_s`:

    load   the folder is read and checked against the model (names, shapes) off the engine
           thread, while requests keep being served
    pause  the engine's driver thread stops stepping at the next step boundary; with mode
           "abort" the running requests are aborted (their tokens so far come back with
           finish_reason "abort"), with "pause" they keep their KV cache and wait
    load   the weights are written into the model's tensors in place, one at a time
           (`write_s`), and the engine publishes `version` (`publish_s`: a converted
           bfloat16/int8 copy is refreshed, cached prompts are dropped), so every later
           token carries it
    resume the driver steps again

The answer times each: `read_s`, `pause_s`, `load_s` (= `write_s` + `publish_s`) and
`resume_s`. GET /v1/weights and GET /version say the precision the engine samples in
(`dtype`): a trainer writes the weights it publishes in it (learner/files.py).

A failure in any phase is an error naming it (4xx: the folder; 504: out of time; 500: the
engine), after which the server serves on with its old weights and version.

Imports FastAPI, `serve.errors`, `serve.schemas`, `serve.weights`; `serve.state`
(`ServerState`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version

from fastapi import FastAPI

from rollwise.serve.errors import APIError
from rollwise.serve.schemas import WeightsBody
from rollwise.serve.state import ServerState
from rollwise.serve.weights import UpdateError


def add_weight_routes(app: FastAPI, server: ServerState, auth: list) -> None:
    lock = asyncio.Lock()

    @app.post("/v1/weights/update", dependencies=auth)
    async def update(body: WeightsBody):
        if lock.locked():
            raise APIError(409, "a weight update is already running; retry when GET "
                           "/v1/weights says updating: false", param="path")
        async with lock:
            start = time.perf_counter()
            try:
                out = await _update(server, body)
            except UpdateError as e:
                server.metrics.weight_update(time.perf_counter() - start, ok=False)
                kind = "server_error" if e.status >= 500 else "invalid_request_error"
                raise APIError(e.status, f"weight update to version {body.version} failed in "
                               f"phase {e}; still serving version {server.engine.version}",
                               kind=kind, param="path", phase=e.phase) from None
            server.metrics.weight_update(time.perf_counter() - start, ok=True)
            return out

    @app.get("/v1/weights", dependencies=auth)
    async def weights():
        return {"version": server.engine.version, "updating": lock.locked(),
                "dtype": _dtype(server.engine)}

    @app.get("/version", dependencies=auth)
    async def served_version():
        return {"version": server.engine.version, "rollwise": _package_version(),
                "model": server.name, "dtype": _dtype(server.engine)}


async def _update(server: ServerState, body: WeightsBody) -> dict:
    deadline = time.monotonic() + body.timeout_s
    t0 = time.perf_counter()
    staged = await _within(asyncio.to_thread(server.weights.stage, body.path), deadline, "load")
    read_s = time.perf_counter() - t0
    gate = _Gate()
    queued = time.perf_counter()

    def paused(engine) -> tuple[int, float, float, float, float]:
        """On the driver thread, between steps: (aborted, pause_s, write_s, publish_s,
        when done)."""
        aborted = server.driver.abort_live() if body.mode == "abort" else 0
        loading = time.perf_counter()
        server.weights.apply(staged, deadline, keep_old=not _own_copy(engine))
        written = time.perf_counter()
        try:
            engine.publish(body.version)
        except Exception as e:
            raise UpdateError("load", f"the new weights are in place but publishing them "
                              f"failed ({type(e).__name__}: {e})", status=500) from e
        done = time.perf_counter()
        return aborted, loading - queued, written - loading, done - written, done

    fut = asyncio.wrap_future(server.driver.call(gate.guard(paused)))
    try:
        aborted, pause_s, write_s, publish_s, done = await asyncio.wait_for(
            asyncio.shield(fut), max(deadline - time.monotonic(), 0))
    except TimeoutError:
        if gate.cancel():
            staged.close()
            raise UpdateError("pause", f"the engine did not reach a step boundary within "
                              f"timeout_s={body.timeout_s}", status=504) from None
        # writing: it stops at the deadline itself
        aborted, pause_s, write_s, publish_s, done = await fut
    return {"version": server.engine.version, "aborted": aborted, "dtype": _dtype(server.engine),
            "phases": {"read_s": read_s, "pause_s": pause_s, "load_s": write_s + publish_s,
                       "write_s": write_s, "publish_s": publish_s,
                       "resume_s": time.perf_counter() - done}}


def _dtype(engine) -> str:
    """The precision `engine` samples in, as torch names it ('float32' when it does not
    say; an int8 engine says float32: it converts from float32 weights)."""
    return str(getattr(engine, "dtype", "float32")).removeprefix("torch.")


def _own_copy(engine) -> bool:
    """Whether `engine` samples from its own converted copy of the weights (so the model's
    tensors are not what it serves until it publishes), not from the model's tensors."""
    decoder = getattr(engine, "decoder", None)
    if decoder is None or getattr(engine, "borrowed", False) or getattr(decoder, "shared", True):
        return False
    # int8 reads the float32 norms and embedding in place unless it owns its weights
    return not getattr(decoder, "int8", False) or bool(getattr(decoder, "own_weights", False))


async def _within(work, deadline: float, phase: str):
    """`work` awaited until `deadline`; past it an UpdateError naming `phase` (the work's
    thread finishes on its own; its result is dropped)."""
    try:
        return await asyncio.wait_for(work, max(deadline - time.monotonic(), 0))
    except TimeoutError:
        raise UpdateError(phase, "timed out reading the folder", status=504) from None


class _Gate:
    """A command for the driver thread that the waiter can withdraw until it starts."""

    def __init__(self):
        self._lock = threading.Lock()
        self._state = "queued"  # -> "started" (the driver runs it) | "cancelled"

    def cancel(self) -> bool:
        with self._lock:
            if self._state == "queued":
                self._state = "cancelled"
            return self._state == "cancelled"

    def guard(self, fn):
        def run(engine):
            with self._lock:
                if self._state == "cancelled":
                    return None
                self._state = "started"
            return fn(engine)
        return run


def _package_version() -> str:
    try:
        return package_version("rollwise")
    except PackageNotFoundError:
        return "unknown"
