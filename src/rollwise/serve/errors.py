"""Refusals: `APIError` and the OpenAI-style error body every refusal carries, the handlers
that turn exceptions into those bodies, and `BodyLimit` (413 before a large body is parsed).

Imports FastAPI and Starlette, `serve.choices` (`EngineFailure`) and `serve.text`
(`BadRequest`); every other serve module may import this one.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollwise.serve.choices import EngineFailure
from rollwise.serve.text import BadRequest


class APIError(Exception):
    """A refusal: HTTP `status`, the message, OpenAI's error `type` and `param`; `phase`,
    for a weight update, the phase that failed (an extra field of the error body)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, phase: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param
        self.phase = phase


def error_body(message: str, kind: str, param: str | None = None, code: Any = None,
               phase: str | None = None) -> dict:
    body = {"message": message, "type": kind, "param": param, "code": code}
    return {"error": body | ({"phase": phase} if phase else {})}


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets 413 before it is parsed."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(send)
        # read the whole body first (it is at most `limit` bytes), then replay it to the app
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message)
            seen += len(message.get("body", b""))
            if seen > self.limit:
                return await self._refuse(send)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(chunks, receive), send)

    async def _refuse(self, send):
        body = json.dumps(error_body(f"request body over {self.limit} bytes",
                                     "invalid_request_error", code="body_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _replay(messages: list[dict], receive):
    async def replayed():
        return messages.pop(0) if messages else await receive()
    return replayed


def add_error_handlers(app: FastAPI) -> None:
    """Every refusal is an OpenAI-style error body with a 4xx (5xx: the engine failed)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(error_body(e.message, e.kind, e.param, phase=e.phase),
                            status_code=e.status,
                            headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        problems = []
        for err in e.errors()[:5]:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            if err.get("type") == "json_invalid":
                problems.append(f"malformed JSON body ({err.get('ctx', {}).get('error', '')})")
            else:
                problems.append(f"{loc or 'body'}: {err.get('msg')}")
        return JSONResponse(error_body("invalid request: " + "; ".join(problems),
                                       "invalid_request_error"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        # unknown paths (404), wrong methods (405), an unreadable body (400)
        return JSONResponse(error_body(str(e.detail), "invalid_request_error"),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, e: BadRequest):
        return JSONResponse(error_body(str(e), "invalid_request_error"), status_code=400)

    @app.exception_handler(EngineFailure)
    async def _engine(request: Request, e: EngineFailure):
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        return JSONResponse(error_body(str(e), kind), status_code=e.status)
