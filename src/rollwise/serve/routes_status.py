"""The status routes: /health (is the server up), /v1/stats (the engine's counters, the
pending sequences, the limits) and /metrics (Prometheus text, `serve/metrics.py`).

Imports FastAPI and prometheus_client; `serve.state` (`ServerState`).
"""

from __future__ import annotations

import dataclasses

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST

from rollwise.serve.state import ServerState


def add_status_routes(app: FastAPI, server: ServerState, auth: list) -> None:
    """/health (no key needed), /v1/stats and /metrics."""

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

    @app.get("/metrics", dependencies=auth)
    async def metrics():
        return Response(server.metrics.text(), media_type=CONTENT_TYPE_LATEST)
