"""The FastAPI app of `RolloutServer` (`serve/server.py`): its lifespan (the engine's driver
thread), the body-size limit, the request counter, the error handlers, the API-key check, and
the routes of each API family: `routes_status.py` (/health, /v1/stats, /metrics),
`routes_openai.py` (/v1/models, /v1/chat/completions, /v1/completions), `routes_rollouts.py`
(/v1/rollouts, /v1/episodes), `routes_tokens.py` (/v1/generate, /v1/abort, /tokenize,
/detokenize), `routes_weights.py` (/v1/weights, /version).

Imports FastAPI, `serve.errors`, `serve.metrics`, the route modules and `serve.state`
(`ServerState`, what the routes read).
"""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request

from rollwise.serve.errors import APIError, BodyLimit, add_error_handlers
from rollwise.serve.metrics import RequestCounter
from rollwise.serve.routes_openai import add_openai_routes
from rollwise.serve.routes_rollouts import add_episode_routes, add_rollout_routes
from rollwise.serve.routes_status import add_status_routes
from rollwise.serve.routes_tokens import add_token_routes
from rollwise.serve.routes_weights import add_weight_routes
from rollwise.serve.state import ServerState


def build_app(server: ServerState) -> FastAPI:
    """The FastAPI app over `server`: the driver thread runs while the app does; every route
    but /health checks the API key when the server has one."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.driver.start()
        yield
        server.driver.stop()

    app = FastAPI(title="rollwise", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.add_middleware(BodyLimit, limit=server.limits.max_body_bytes)
    app.add_middleware(RequestCounter, metrics=server.metrics)

    add_error_handlers(app)
    auth = [Depends(_authorizer(server))]
    add_status_routes(app, server, auth)
    add_openai_routes(app, server, auth)
    add_rollout_routes(app, server, auth)
    add_episode_routes(app, server, auth)
    add_token_routes(app, server, auth)
    add_weight_routes(app, server, auth)
    return app


def _authorizer(server: ServerState):
    """The dependency that checks the key when the server has one: `Authorization: Bearer
    KEY` or `x-api-key: KEY` (Anthropic-style clients)."""

    async def authorize(request: Request) -> None:
        if server.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            key = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(key.strip().encode(), server.api_key.encode()):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY' "
                           "or 'x-api-key: KEY')", kind="authentication_error")

    return authorize
