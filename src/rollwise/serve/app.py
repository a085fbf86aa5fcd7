"""The OpenAI-compatible HTTP server over the native engine (FastAPI).

    server = RolloutServer(policy, engine, name="tiny")
    url = server.start()                    # uvicorn on 127.0.0.1, a free port, in a thread
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    ...
    server.publish(version)                 # new weights are in place (in-process training)
    calls = server.episodes.pop("episode-7")  # what an agent's calls under that id sampled
    server.stop()

Endpoints (docs/serve.md): /v1/models, /v1/chat/completions, /v1/completions (streaming or
not), /v1/rollouts (submit, poll, cancel a batch of episodes), /v1/episodes (calls recorded
under an episode id), /v1/stats, /health. Besides OpenAI's fields every choice carries
`token_ids` (the sampled ids, the stop token included) and the response `prompt_token_ids`,
so a client can keep its trajectories token for token.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollwise.engine.base import RequestEngine, SamplingParams
from rollwise.engine.sampling import derive_seed
from rollwise.serve.choices import ChoiceResult, EngineFailure, run_choice, start_sync
from rollwise.serve.driver import EngineDriver
from rollwise.serve.records import EpisodeLog, RolloutJobs
from rollwise.serve.schemas import ChatBody, CompletionBody, RolloutBody, SamplingBody
from rollwise.serve.text import DEFAULT_CHAT_TEMPLATE, BadRequest, parse_tool_calls, render_chat

EPISODE_HEADER = "x-episode-id"


@dataclass
class Limits:
    """What one request may ask for; over a limit is a 4xx naming it."""

    max_body_bytes: int = 1 << 20  # request body (413 beyond)
    max_tokens: int = 4096  # max_tokens per choice (the context may allow less)
    max_n: int = 16  # choices per prompt
    max_prompts: int = 256  # prompts of one /v1/completions call, episodes of one rollout job
    max_pending: int = 4096  # sequences queued or running at once (429 beyond)


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def _error_body(message: str, kind: str, param: str | None = None, code: Any = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


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
        body = json.dumps(_error_body(f"request body over {self.limit} bytes",
                                      "invalid_request_error", code="body_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _replay(messages: list[dict], receive):
    async def replayed():
        return messages.pop(0) if messages else await receive()
    return replayed


class RolloutServer:
    """The server's state: the engine's driver thread, the tokenizer edge, the records."""

    def __init__(self, policy, engine: RequestEngine, *, name: str, api_key: str | None = None,
                 limits: Limits | None = None, source: str = ""):
        self.policy, self.engine, self.name, self.source = policy, engine, name, source
        self.tokenizer = policy.tokenizer
        self.template = getattr(self.tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
        self.api_key = api_key or None
        self.limits = limits or Limits()
        self.max_context = int(getattr(engine, "max_context", policy.max_context))
        self.driver = EngineDriver(engine)
        self.rollouts = RolloutJobs()
        self.episodes = EpisodeLog()
        self.created = int(time.time())
        self.served_requests = 0
        self.app = build_app(self)
        self._uvicorn = None
        self._thread: threading.Thread | None = None

    # -- in-process use (tests, a trainer beside the server) -------------------------------

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve in a background thread; returns the base URL (http://host:port)."""
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on")
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [sock]},
                                        name="rollwise-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return f"http://{host}:{sock.getsockname()[1]}"

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            self._thread.join(timeout=30)
            self._uvicorn = self._thread = None
        self.driver.stop()

    def publish(self, version: int) -> None:
        """New weights are in place: later tokens carry `version` (applied by the driver
        thread between steps when it runs; directly otherwise)."""
        if self.driver.running:
            self.driver.call(lambda e: e.publish(version)).result()
        else:
            self.engine.publish(version)

    # -- request helpers -------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise APIError(404, f"model '{model}' is not served here; this server serves "
                           f"'{self.name}'", param="model")

    def params(self, body: SamplingBody, prompt_len: int, max_tokens: int | None,
               where: str = "prompt") -> SamplingParams:
        lim = self.limits
        if body.n > lim.max_n:
            raise APIError(400, f"n={body.n} is over this server's limit of {lim.max_n}",
                           param="n")
        room = self.max_context - prompt_len
        if room < 1:
            raise APIError(400, f"{where} has {prompt_len} tokens; the model's context is "
                           f"{self.max_context} tokens, leaving no room to generate",
                           param="messages" if where == "messages" else "prompt")
        if max_tokens is None:
            max_tokens = min(lim.max_tokens, room)
        elif max_tokens > lim.max_tokens:
            raise APIError(400, f"max_tokens={max_tokens} is over this server's limit of "
                           f"{lim.max_tokens}", param="max_tokens")
        elif max_tokens > room:
            raise APIError(400, f"{where} ({prompt_len} tokens) + max_tokens ({max_tokens}) "
                           f"is over the model's context of {self.max_context} tokens",
                           param="max_tokens")
        temperature = 1.0 if body.temperature is None else body.temperature
        return SamplingParams(n=1, temperature=temperature,
                              top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k,
                              max_tokens=max_tokens, ignore_eos=body.ignore_eos)

    def reserve(self, sequences: int) -> None:
        if self.driver.pending + sequences > self.limits.max_pending:
            raise APIError(429, f"server busy: {self.driver.pending} sequences pending, limit "
                           f"{self.limits.max_pending}; retry later", kind="rate_limit_error")

    def encode_text(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text, add_special_tokens=True)["input_ids"]]

    def check_ids(self, ids: list[int], where: str) -> list[int]:
        vocab = len(self.tokenizer)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise APIError(400, f"{where}: token id {bad[0]} is outside the vocabulary "
                           f"(0..{vocab - 1})", param="prompt")
        if not ids:
            raise APIError(400, f"{where} is empty", param="prompt")
        return ids

    def token_text(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def chat_logprobs(self, r: ChoiceResult) -> dict:
        out = []
        for tid, lp in zip(r.token_ids, r.logprobs):
            tok = self.token_text(tid)
            out.append({"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")),
                        "top_logprobs": []})
        return {"content": out}

    def completion_logprobs(self, ids: list[int], lps: list[float], offset: int = 0) -> dict:
        tokens = [self.token_text(t) for t in ids]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": None,
                "text_offset": offsets}

    def record(self, episode: str | None, record: dict) -> None:
        if episode:
            self.episodes.add(episode, record)


def _seed(base: int | None, index: int) -> int:
    """The seed of sequence `index` of a call seeded `base`: the same as the engine's own
    `generate(prompts, SamplingParams(n=n, seed=base))` gives that sequence. Unseeded calls
    draw from the OS, never from torch's global generator (a trainer in the same process
    keeps its own random stream)."""
    return secrets.randbits(62) if base is None else derive_seed(base % 2**64, index)


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def build_app(server: RolloutServer) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.driver.start()
        yield
        server.driver.stop()

    app = FastAPI(title="rollwise", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.add_middleware(BodyLimit, limit=server.limits.max_body_bytes)

    _error_handlers(app)
    auth = [Depends(_authorizer(server))]
    _info_routes(app, server, auth)
    _generation_routes(app, server, auth)
    _rollout_routes(app, server, auth)
    _episode_routes(app, server, auth)
    return app


def _error_handlers(app: FastAPI) -> None:
    """Every refusal is an OpenAI-style error body with a 4xx (5xx: the engine failed)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(_error_body(e.message, e.kind, e.param), status_code=e.status,
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
        return JSONResponse(_error_body("invalid request: " + "; ".join(problems),
                                        "invalid_request_error"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        # unknown paths (404), wrong methods (405), an unreadable body (400)
        return JSONResponse(_error_body(str(e.detail), "invalid_request_error"),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, e: BadRequest):
        return JSONResponse(_error_body(str(e), "invalid_request_error"), status_code=400)

    @app.exception_handler(EngineFailure)
    async def _engine(request: Request, e: EngineFailure):
        kind = "invalid_request_error" if e.status < 500 else "server_error"
        return JSONResponse(_error_body(str(e), kind), status_code=e.status)


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


def _info_routes(app: FastAPI, server: RolloutServer, auth: list) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=auth)
    async def models():
        return {"object": "list", "data": [{
            "id": server.name, "object": "model", "created": server.created,
            "owned_by": "rollwise", "max_model_len": server.max_context,
            "policy_version": server.engine.version, "source": server.source}]}

    @app.get("/v1/stats", dependencies=auth)
    async def stats():
        return {"engine": dataclasses.asdict(server.engine.stats),
                "policy_version": server.engine.version, "pending": server.driver.pending,
                "served_requests": server.served_requests,
                "recorded_calls": server.episodes.calls,
                "limits": dataclasses.asdict(server.limits), "max_context": server.max_context}


def _generation_routes(app: FastAPI, server: RolloutServer, auth: list) -> None:
    """/v1/chat/completions and /v1/completions, streamed or whole."""

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(body: ChatBody, request: Request):
        server.check_model(body.model)
        if (why := body.unsupported()) is not None:
            raise APIError(400, why)
        prompt = render_chat(server.tokenizer, body.messages, body.tools, server.template)
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = server.params(body, len(prompt), max_tokens, where="messages")
        server.reserve(body.n)
        server.served_requests += 1
        tools = bool(body.tools) and body.tool_choice != "none"
        episode = body.episode_id or request.headers.get(EPISODE_HEADER)
        call_id = f"chatcmpl-{secrets.token_hex(12)}"
        meta = {"endpoint": "chat.completions", "messages": body.messages, "tools": body.tools}
        if body.stream:
            return StreamingResponse(
                _chat_stream(server, body, prompt, params, tools, call_id, episode, meta),
                media_type="text/event-stream")
        results = await _unless_gone(request, [
            run_choice(server.driver, server.tokenizer, prompt, params, _seed(body.seed, k),
                       body.stop_list()) for k in range(body.n)])
        choices = []
        for k, r in enumerate(results):
            message, finish = _chat_message(r, tools)
            choices.append({"index": k, "message": message, "finish_reason": finish,
                            "logprobs": server.chat_logprobs(r) if body.logprobs else None,
                            "token_ids": r.token_ids})
        server.record(episode, meta | _record(prompt, results, choices))
        return {"id": call_id, "object": "chat.completion", "created": int(time.time()),
                "model": server.name, "choices": choices, "prompt_token_ids": prompt,
                "usage": _usage(len(prompt), results)}

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionBody, request: Request):
        server.check_model(body.model)
        if (why := body.unsupported()) is not None:
            raise APIError(400, why)
        prompts = _prompts(server, body.prompt)
        plist = [server.params(body, len(p), body.max_tokens,
                               where=f"prompt[{i}]" if len(prompts) > 1 else "prompt")
                 for i, p in enumerate(prompts)]
        server.reserve(body.n * len(prompts))
        server.served_requests += 1
        episode = body.episode_id or request.headers.get(EPISODE_HEADER)
        call_id = f"cmpl-{secrets.token_hex(12)}"
        jobs = [(i, k) for i in range(len(prompts)) for k in range(body.n)]
        if body.stream:
            return StreamingResponse(
                _completion_stream(server, body, prompts, plist, jobs, call_id, episode),
                media_type="text/event-stream")
        results = await _unless_gone(request, [
            run_choice(server.driver, server.tokenizer, prompts[i], plist[i],
                       _seed(body.seed, i * body.n + k), body.stop_list()) for i, k in jobs])
        choices = [_completion_choice(server, body, idx, r) for idx, r in enumerate(results)]
        server.record(episode, {"endpoint": "completions", "prompt": body.prompt}
                      | _record(prompts[0] if len(prompts) == 1 else prompts, results, choices))
        out = {"id": call_id, "object": "text_completion", "created": int(time.time()),
               "model": server.name, "choices": choices,
               "usage": _usage(sum(map(len, prompts)), results)}
        if len(prompts) == 1:
            out["prompt_token_ids"] = prompts[0]
        return out


async def _unless_gone(request: Request, coros: list) -> list[ChoiceResult]:
    """The choices' results; a client that hangs up meanwhile has its requests aborted
    (an agent that timed out does not keep the engine busy)."""
    work = asyncio.gather(*coros)
    while True:
        done, _ = await asyncio.wait([work], timeout=0.5)
        if done:
            return work.result()
        if await request.is_disconnected():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
            raise APIError(499, "client disconnected")


def _prompts(server: RolloutServer, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts = [server.encode_text(prompt)]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = [server.encode_text(p) for p in prompt]
    else:
        prompts = [list(p) for p in prompt]
    if not prompts:
        raise APIError(400, "prompt is empty", param="prompt")
    if len(prompts) > server.limits.max_prompts:
        raise APIError(400, f"{len(prompts)} prompts is over this server's limit of "
                       f"{server.limits.max_prompts}", param="prompt")
    return [server.check_ids(p, f"prompt[{i}]") for i, p in enumerate(prompts)]


def _chat_message(r: ChoiceResult, tools: bool) -> tuple[dict, str]:
    content, calls = parse_tool_calls(r.text) if tools else (r.text, [])
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
        r.extra["tool_calls"] = calls
    return message, "tool_calls" if calls else r.finish_reason


def _completion_choice(server: RolloutServer, body: CompletionBody, idx: int,
                       r: ChoiceResult) -> dict:
    lp = server.completion_logprobs(r.token_ids, r.logprobs) if body.logprobs is not None else None
    choice = {"index": idx, "text": r.text, "finish_reason": r.finish_reason, "logprobs": lp,
              "token_ids": r.token_ids}
    if isinstance(body.prompt, list) and len(body.prompt) > 1 and not isinstance(
            body.prompt[0], int):
        choice["prompt_token_ids"] = r.prompt_ids
    return choice


def _usage(prompt_tokens: int, results: list[ChoiceResult]) -> dict:
    done = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": done,
            "total_tokens": prompt_tokens + done}


def _record(prompt, results: list[ChoiceResult], choices: list[dict]) -> dict:
    """An episode's record of one call: prompt ids and, per choice, ids, log-probs, versions."""
    return {"prompt_token_ids": prompt, "choices": [
        {"index": c["index"], **r.record()} for c, r in zip(choices, results)]}


async def _fan_in(server: RolloutServer, specs: list[tuple], streamed: list[bool]):
    """Run choices concurrently; yield ("delta", k, delta) and ("done", k, result) events
    in arrival order. Cancelling the consumer aborts every choice."""
    events: asyncio.Queue = asyncio.Queue()

    async def one(k, prompt, params, seed, stop):
        async def on_delta(delta):
            await events.put(("delta", k, delta))
        try:
            r = await run_choice(server.driver, server.tokenizer, prompt, params, seed, stop,
                                 on_delta if streamed[k] else None)
            await events.put(("done", k, r))
        except EngineFailure as e:
            await events.put(("error", k, e))

    tasks = [asyncio.create_task(one(k, *spec)) for k, spec in enumerate(specs)]
    try:
        for _ in range(len(specs)):
            while True:
                event = await events.get()
                yield event
                if event[0] != "delta":
                    break
    finally:
        for t in tasks:
            t.cancel()


async def _chat_stream(server: RolloutServer, body: ChatBody, prompt: list[int],
                       params: SamplingParams, tools: bool, call_id: str, episode: str | None,
                       meta: dict) -> AsyncIterator[str]:
    created = int(time.time())
    head = {"id": call_id, "object": "chat.completion.chunk", "created": created,
            "model": server.name}
    results: dict[int, ChoiceResult] = {}
    for k in range(body.n):
        yield _sse(head | {"choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}],
                           "prompt_token_ids": prompt})
    specs = [(prompt, params, _seed(body.seed, k), body.stop_list()) for k in range(body.n)]
    async for kind, k, x in _fan_in(server, specs, [not tools] * body.n):
        if kind == "error":
            yield _sse(_error_body(str(x), "server_error" if x.status >= 500
                                   else "invalid_request_error"))
            yield _sse("[DONE]")
            return
        if kind == "delta":
            text, ids, lps = x
            chunk = ChoiceResult(prompt, ids, lps, [], "", text)
            yield _sse(head | {"choices": [{
                "index": k, "delta": {"content": text}, "finish_reason": None,
                "logprobs": server.chat_logprobs(chunk) if body.logprobs else None,
                "token_ids": ids}]})
            continue
        results[k] = x
        delta: dict[str, Any] = {}
        ids: list[int] = []
        if tools:  # buffered: the whole reply at the end, tool calls parsed out of it
            message, finish = _chat_message(x, True)
            delta = {k2: v for k2, v in message.items() if k2 != "role"}
            ids = x.token_ids
            lp = server.chat_logprobs(x) if body.logprobs else None
        else:
            finish, lp = x.finish_reason, None
        yield _sse(head | {"choices": [{"index": k, "delta": delta, "finish_reason": finish,
                                        "logprobs": lp, "token_ids": ids}]})
    ordered = [results[k] for k in range(body.n)]
    if (body.stream_options or {}).get("include_usage"):
        yield _sse(head | {"choices": [], "usage": _usage(len(prompt), ordered)})
    server.record(episode, meta | _record(prompt, ordered, [{"index": k} for k in range(body.n)]))
    yield _sse("[DONE]")


async def _completion_stream(server: RolloutServer, body: CompletionBody,
                             prompts: list[list[int]], plist: list[SamplingParams],
                             jobs: list[tuple[int, int]], call_id: str,
                             episode: str | None) -> AsyncIterator[str]:
    head = {"id": call_id, "object": "text_completion", "created": int(time.time()),
            "model": server.name}
    results: dict[int, ChoiceResult] = {}
    offsets = [0] * len(jobs)
    specs = [(prompts[i], plist[i], _seed(body.seed, i * body.n + k), body.stop_list())
             for i, k in jobs]
    async for kind, idx, x in _fan_in(server, specs, [True] * len(jobs)):
        if kind == "error":
            yield _sse(_error_body(str(x), "server_error" if x.status >= 500
                                   else "invalid_request_error"))
            yield _sse("[DONE]")
            return
        if kind == "delta":
            text, ids, lps = x
            lp = (server.completion_logprobs(ids, lps, offsets[idx])
                  if body.logprobs is not None else None)
            offsets[idx] += len(text)
            yield _sse(head | {"choices": [{"index": idx, "text": text, "finish_reason": None,
                                            "logprobs": lp, "token_ids": ids}]})
            continue
        results[idx] = x
        yield _sse(head | {"choices": [{"index": idx, "text": "", "logprobs": None,
                                        "finish_reason": x.finish_reason, "token_ids": []}]})
    ordered = [results[i] for i in range(len(jobs))]
    if (body.stream_options or {}).get("include_usage"):
        yield _sse(head | {"choices": [], "usage": _usage(sum(map(len, prompts)), ordered)})
    server.record(episode, {"endpoint": "completions", "prompt": body.prompt} | _record(
        prompts[0] if len(prompts) == 1 else prompts, ordered,
        [{"index": i} for i in range(len(jobs))]))
    yield _sse("[DONE]")


def _rollout_routes(app: FastAPI, server: RolloutServer, auth: list) -> None:
    @app.post("/v1/rollouts", dependencies=auth)
    async def submit(body: RolloutBody):
        server.check_model(body.model)
        if (why := body.unsupported()) is not None:
            raise APIError(400, why)
        if body.stream:
            raise APIError(400, "/v1/rollouts does not stream; poll GET /v1/rollouts/{id}",
                           param="stream")
        if len(body.episodes) > server.limits.max_prompts:
            raise APIError(400, f"{len(body.episodes)} episodes is over this server's limit "
                           f"of {server.limits.max_prompts}", param="episodes")
        prompts, plist = [], []
        for j, ep in enumerate(body.episodes):
            if (ep.messages is None) == (ep.prompt is None):
                raise APIError(400, f"episodes[{j}]: give exactly one of 'prompt' (text or "
                               "token ids) and 'messages'", param="episodes")
            if ep.messages is not None:
                ids = render_chat(server.tokenizer, ep.messages, ep.tools, server.template)
            elif isinstance(ep.prompt, str):
                ids = server.encode_text(ep.prompt)
            else:
                ids = server.check_ids(list(ep.prompt), f"episodes[{j}].prompt")
            prompts.append(ids)
            plist.append(server.params(body, len(ids), body.max_tokens, where=f"episodes[{j}]"))
        server.reserve(body.n * len(prompts))
        job = server.rollouts.new([{"id": ep.id, "prompt_token_ids": p}
                                   for ep, p in zip(body.episodes, prompts)], body.n)
        for j, ids in enumerate(prompts):
            for k in range(body.n):
                job.handles[(j, k)] = start_sync(
                    server.driver, server.tokenizer, ids, plist[j], _seed(body.seed, j * body.n + k),
                    body.stop_list(), partial(job.on_result, j, k))
        return job.view(results=False)

    @app.get("/v1/rollouts", dependencies=auth)
    async def list_jobs():
        with server.rollouts.lock:
            jobs = list(server.rollouts.jobs.values())
        return {"object": "list", "data": [j.view(results=False) for j in jobs]}

    def _job(job_id: str):
        job = server.rollouts.get(job_id)
        if job is None:
            raise APIError(404, f"no rollout job '{job_id}' (finished jobs are kept until "
                           "deleted, up to a limit)")
        return job

    @app.get("/v1/rollouts/{job_id}", dependencies=auth)
    async def poll(job_id: str, wait: float = 0.0):
        """`wait`: seconds (at most 60) to wait for the job to finish before answering."""
        job = _job(job_id)
        deadline = time.monotonic() + min(max(wait, 0.0), 60.0)
        while job.status in ("running", "cancelling") and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return job.view()

    @app.post("/v1/rollouts/{job_id}/cancel", dependencies=auth)
    async def cancel(job_id: str):
        job = _job(job_id)
        if job.status == "running":
            job.cancelled = True
        for h in list(job.handles.values()):
            if not h.finished:
                server.driver.abort(h)
        deadline = time.monotonic() + 10  # aborts are applied before the next step
        while job.status == "cancelling" and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return job.view()

    @app.delete("/v1/rollouts/{job_id}", dependencies=auth)
    async def delete(job_id: str):
        """Cancel what still runs and forget the job; its results come back."""
        view = await cancel(job_id)
        server.rollouts.pop(job_id)
        return view


def _episode_routes(app: FastAPI, server: RolloutServer, auth: list) -> None:
    @app.get("/v1/episodes", dependencies=auth)
    async def episodes():
        return {"object": "list", "data": server.episodes.ids()}

    @app.get("/v1/episodes/{episode_id}", dependencies=auth)
    async def episode(episode_id: str):
        calls = server.episodes.get(episode_id)
        if calls is None:
            raise APIError(404, f"no calls recorded under episode '{episode_id}'")
        return {"id": episode_id, "object": "episode", "calls": calls}

    @app.delete("/v1/episodes/{episode_id}", dependencies=auth)
    async def collect(episode_id: str):
        calls = server.episodes.pop(episode_id)
        if calls is None:
            raise APIError(404, f"no calls recorded under episode '{episode_id}'")
        return {"id": episode_id, "object": "episode", "calls": calls}
