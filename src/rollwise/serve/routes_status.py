"""The status routes: /health (is the server up) and /v1/stats (the engine's counters, the
pending sequences, the limits).

Imports FastAPI; `RolloutServer` only for annotations.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from fastapi import FastAPI

if TYPE_CHECKING:
    from rollwise.serve.server import RolloutServer


def add_status_routes(app: FastAPI, server: RolloutServer, auth: list) -> None:
    """/health (no key needed) and /v1/stats."""

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/stats", dependencies=auth)
    async def stats():
        return {"engine": dataclasses.asdict(server.engine.stats),
                "policy_version": server.engine.version, "pending": server.driver.pending,
                "served_requests": server.served_requests,
                "recorded_calls": server.episodes.calls,
                "limits": dataclasses.asdict(server.limits), "max_context": server.max_context}
