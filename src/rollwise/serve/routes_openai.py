"""The OpenAI-compatible routes: /v1/models, /v1/chat/completions and /v1/completions,
streamed (server-sent events) or whole, and the record each call leaves under its episode id
(the `episode_id` field or the x-episode-id header).

Imports FastAPI, `engine.base`, `serve.choices`, `serve.errors`, `serve.schemas`,
`serve.text`; `serve.state` (`ServerState`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from rollwise.engine.base import SamplingParams
from rollwise.serve.choices import ChoiceResult, EngineFailure, run_choice, sequence_seed
from rollwise.serve.errors import APIError, error_body
from rollwise.serve.schemas import ChatBody, CompletionBody
from rollwise.serve.state import ServerState
from rollwise.serve.text import parse_tool_calls, render_chat

EPISODE_HEADER = "x-episode-id"


def add_openai_routes(app: FastAPI, server: ServerState, auth: list) -> None:
    """/v1/models, /v1/chat/completions and /v1/completions, streamed or whole."""

    def card() -> dict:
        return {"id": server.name, "object": "model", "created": server.created,
                "owned_by": "rollwise", "max_model_len": server.max_context,
                "policy_version": server.engine.version, "source": server.source,
                "aliases": list(server.aliases)}

    @app.get("/v1/models", dependencies=auth)
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model(model_id: str):
        server.check_model(model_id)
        return card()

    _add_chat_route(app, server, auth)
    _add_completions_route(app, server, auth)


def _add_chat_route(app: FastAPI, server: ServerState, auth: list) -> None:
    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(body: ChatBody, request: Request):
        server.check_model(body.model)
        server.refuse(body.refusal())
        prompt = render_chat(server.tokenizer, body.messages, body.tools, server.template)
        max_tokens = body.max_completion_tokens or body.max_tokens
        params = server.params(body, len(prompt), max_tokens, where="messages",
                               top=body.top_k_logprobs)
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
        results = await unless_gone(request, [
            run_choice(server.driver, server.tokenizer, prompt, params,
                       sequence_seed(body.seed, k), body.stop_list()) for k in range(body.n)])
        choices = []
        for k, r in enumerate(results):
            message, finish = _chat_message(r, tools)
            choices.append({"index": k, "message": message, "finish_reason": finish,
                            "logprobs": _chat_logprobs(server, body, r),
                            "token_ids": r.token_ids})
        server.record(episode, meta | _record(prompt, results, choices))
        return {"id": call_id, "object": "chat.completion", "created": int(time.time()),
                "model": server.name, "choices": choices, "prompt_token_ids": prompt,
                "usage": _usage(len(prompt), results)}


def _add_completions_route(app: FastAPI, server: ServerState, auth: list) -> None:
    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionBody, request: Request):
        server.check_model(body.model)
        server.refuse(body.refusal())
        prompts = _prompts(server, body.prompt)
        plist = [server.params(body, len(p), body.max_tokens,
                               where=f"prompt[{i}]" if len(prompts) > 1 else "prompt",
                               top=body.top_k_logprobs)
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
        results = await unless_gone(request, [
            run_choice(server.driver, server.tokenizer, prompts[i], plist[i],
                       sequence_seed(body.seed, i * body.n + k), body.stop_list())
            for i, k in jobs])
        choices = [_completion_choice(server, body, idx, r) for idx, r in enumerate(results)]
        server.record(episode, {"endpoint": "completions", "prompt": body.prompt}
                      | _record(prompts[0] if len(prompts) == 1 else prompts, results, choices))
        out = {"id": call_id, "object": "text_completion", "created": int(time.time()),
               "model": server.name, "choices": choices,
               "usage": _usage(sum(map(len, prompts)), results)}
        if len(prompts) == 1:
            out["prompt_token_ids"] = prompts[0]
        return out


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _sse_failure(e: EngineFailure) -> str:
    """The events that end a stream whose choice the engine refused or failed."""
    kind = "server_error" if e.status >= 500 else "invalid_request_error"
    return _sse(error_body(str(e), kind)) + _sse("[DONE]")


async def unless_gone(request: Request, coros: list) -> list[ChoiceResult]:
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


def _prompts(server: ServerState, prompt) -> list[list[int]]:
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


def _chat_logprobs(server: ServerState, body: ChatBody, r: ChoiceResult) -> dict | None:
    """A chat choice's (or chunk's) `logprobs`, when the request asked for them."""
    return server.chat_logprobs(r.token_ids, r.logprobs, r.top_logprobs) if body.logprobs else None


def _completion_choice(server: ServerState, body: CompletionBody, idx: int,
                       r: ChoiceResult) -> dict:
    lp = (server.completion_logprobs(r.token_ids, r.logprobs, tops=r.top_logprobs)
          if body.logprobs is not None else None)
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


async def _fan_in(server: ServerState, specs: list[tuple], streamed: list[bool]):
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


async def _chat_stream(server: ServerState, body: ChatBody, prompt: list[int],
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
    specs = [(prompt, params, sequence_seed(body.seed, k), body.stop_list())
             for k in range(body.n)]
    async for kind, k, x in _fan_in(server, specs, [not tools] * body.n):
        if kind == "error":
            yield _sse_failure(x)
            return
        if kind == "delta":
            text, ids, lps, tops = x
            chunk = ChoiceResult(prompt, ids, lps, [], "", text, top_logprobs=tops)
            yield _sse(head | {"choices": [{
                "index": k, "delta": {"content": text}, "finish_reason": None,
                "logprobs": _chat_logprobs(server, body, chunk), "token_ids": ids}]})
            continue
        results[k] = x
        delta: dict[str, Any] = {}
        ids: list[int] = []
        if tools:  # buffered: the whole reply at the end, tool calls parsed out of it
            message, finish = _chat_message(x, True)
            delta = {k2: v for k2, v in message.items() if k2 != "role"}
            if "tool_calls" in delta:  # a streamed call says which call it continues
                delta["tool_calls"] = [{"index": j} | c for j, c in enumerate(delta["tool_calls"])]
            ids = x.token_ids
            lp = _chat_logprobs(server, body, x)
        else:
            finish, lp = x.finish_reason, None
        yield _sse(head | {"choices": [{"index": k, "delta": delta, "finish_reason": finish,
                                        "logprobs": lp, "token_ids": ids}]})
    ordered = [results[k] for k in range(body.n)]
    if (body.stream_options or {}).get("include_usage"):
        yield _sse(head | {"choices": [], "usage": _usage(len(prompt), ordered)})
    server.record(episode, meta | _record(prompt, ordered, [{"index": k} for k in range(body.n)]))
    yield _sse("[DONE]")


async def _completion_stream(server: ServerState, body: CompletionBody,
                             prompts: list[list[int]], plist: list[SamplingParams],
                             jobs: list[tuple[int, int]], call_id: str,
                             episode: str | None) -> AsyncIterator[str]:
    head = {"id": call_id, "object": "text_completion", "created": int(time.time()),
            "model": server.name}
    results: dict[int, ChoiceResult] = {}
    offsets = [0] * len(jobs)
    specs = [(prompts[i], plist[i], sequence_seed(body.seed, i * body.n + k), body.stop_list())
             for i, k in jobs]
    async for kind, idx, x in _fan_in(server, specs, [True] * len(jobs)):
        if kind == "error":
            yield _sse_failure(x)
            return
        if kind == "delta":
            text, ids, lps, tops = x
            lp = (server.completion_logprobs(ids, lps, offsets[idx], tops)
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
