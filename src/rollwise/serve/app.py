"""The FastAPI app of `RolloutServer` (`serve/server.py`): its lifespan (the engine's driver
thread), the body-size limit, the error handlers, the API-key check, and the routes of each
API family: `routes_status.py` (/health, /v1/stats), `routes_openai.py` (/v1/models,
/v1/chat/completions, /v1/completions), `routes_rollouts.py` (/v1/rollouts, /v1/episodes).

Imports FastAPI, `serve.errors` and the route modules; `RolloutServer` only for annotations.
"""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI, Request

from rollwise.serve.errors import APIError, BodyLimit, add_error_handlers
from rollwise.serve.routes_openai import add_openai_routes
from rollwise.serve.routes_rollouts import add_episode_routes, add_rollout_routes
from rollwise.serve.routes_status import add_status_routes

if TYPE_CHECKING:
    from rollwise.serve.server import RolloutServer


def build_app(server: RolloutServer) -> FastAPI:
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

    add_error_handlers(app)
    auth = [Depends(_authorizer(server))]
    add_status_routes(app, server, auth)
    add_openai_routes(app, server, auth)
    add_rollout_routes(app, server, auth)
    add_episode_routes(app, server, auth)
    return app


def _authorizer(server: RolloutServer):
    """The dependency that checks `Authorization: Bearer KEY` when the server has a key."""

    async def authorize(request: Request) -> None:
        if server.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                                 server.api_key.encode()):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                           kind="authentication_error")

    return authorize
