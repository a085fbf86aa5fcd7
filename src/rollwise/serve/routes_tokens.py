"""The token routes trainers call: POST /v1/generate (prompt token ids in; per sample the
sampled ids, their behaviour log-probs and the policy version of each token out), POST
/v1/abort (stop a generate call: its samples come back with the tokens so far), and POST
/tokenize, /detokenize (the served model's tokenizer and chat template).

A sample seeded `seeds[k]` is exactly the engine's request with that seed, so a client that
seeds like the in-process scheduler gets its samples token for token; `resume` continues
partial samples (an aborted call's, or one cut by a weight update) as the engine's
`submit(resume=...)` does. `top_logprobs: k` adds, per sampled token, the k most likely
[id, log-prob] pairs of the model's temperature-1 distribution before truncation (a resumed
sample with it carries its own lists, as a previous call returned them).

Imports FastAPI, `serve.choices`, `serve.driver`, `serve.errors`, `serve.routes_openai`
(`unless_gone`), `serve.schemas`, `serve.text` and `types`; `serve.state` (`ServerState`).
"""

from __future__ import annotations

import asyncio
import secrets

from fastapi import FastAPI, Request

from rollwise.serve.choices import sequence_seed
from rollwise.serve.driver import Done, Event, Failed, Handle
from rollwise.serve.errors import APIError
from rollwise.serve.routes_openai import unless_gone
from rollwise.serve.schemas import AbortBody, DetokenizeBody, GenerateBody, TokenizeBody
from rollwise.serve.state import ServerState
from rollwise.serve.text import render_chat
from rollwise.types import Completion


def add_token_routes(app: FastAPI, server: ServerState, auth: list) -> None:
    @app.post("/v1/generate", dependencies=auth)
    async def generate(body: GenerateBody, request: Request):
        server.check_model(body.model)
        server.refuse(body.refusal())
        prompt = server.check_ids(body.prompt_token_ids, "prompt_token_ids",
                                  param="prompt_token_ids")
        params = server.params(body, len(prompt), body.max_tokens, where="prompt_token_ids",
                               top=body.top_logprobs or 0)
        resumes = [_partial(server, k, part) for k, part in enumerate(body.resume or [])]
        server.reserve(body.n)
        server.served_requests += 1
        request_id = body.request_id or f"gen-{secrets.token_hex(8)}"
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(body.n)]
        handles = [server.driver.submit(
            prompt, params, body.seeds[k] if body.seeds else sequence_seed(body.seed, k),
            _settler(loop, futures[k]), resume=resumes[k] if resumes else None,
            priority=body.priority) for k in range(body.n)]
        server.generating.setdefault(request_id, []).extend(handles)
        try:
            events = await unless_gone(request, futures)
        finally:
            _forget(server, request_id, handles)
        failed = [e for e in events if isinstance(e, Failed)]
        if failed:
            kind = "server_error" if failed[0].status >= 500 else "invalid_request_error"
            raise APIError(failed[0].status, failed[0].message, kind=kind)
        return {"request_id": request_id, "version": server.engine.version,
                "choices": [_choice(k, e.completion, h) for k, (e, h) in
                            enumerate(zip(events, handles))],
                "timings": max((h.timings() for h in handles), key=lambda t: sum(t.values()))}

    @app.post("/v1/abort", dependencies=auth)
    async def abort(body: AbortBody):
        live = [h for h in server.generating.get(body.request_id, []) if not h.finished]
        for h in live:
            server.driver.abort(h)
        return {"aborted": len(live)}

    _add_tokenizer_routes(app, server, auth)


def _partial(server: ServerState, k: int, part) -> Completion:
    if part.token_ids:
        server.check_ids(part.token_ids, f"resume[{k}].token_ids", param="resume")
    versions = list(part.versions) or [server.engine.version] * len(part.token_ids)
    top = None if part.top_logprobs is None else [list(row) for row in part.top_logprobs]
    return Completion(0, list(part.token_ids), list(part.logprobs), "abort", versions,
                      top_logprobs=top)


def _settler(loop: asyncio.AbstractEventLoop, fut: asyncio.Future):
    """A driver sink that settles `fut` with the request's last event (Done or Failed)."""

    def settle(event: Event) -> None:
        if not fut.done():
            fut.set_result(event)

    def sink(event: Event) -> None:
        if isinstance(event, (Done, Failed)):
            loop.call_soon_threadsafe(settle, event)

    return sink


def _forget(server: ServerState, request_id: str, handles: list[Handle]) -> None:
    """The call is over (answered, failed or its client gone): abort what still runs."""
    for h in handles:
        if not h.finished:
            server.driver.abort(h)
    kept = [h for h in server.generating.get(request_id, []) if h not in handles]
    if kept:
        server.generating[request_id] = kept
    else:
        server.generating.pop(request_id, None)


def _choice(k: int, c: Completion, h: Handle) -> dict:
    out = {"index": k, "token_ids": c.token_ids, "logprobs": c.logprobs,
           "versions": c.versions, "finish_reason": c.finish_reason, "timings": h.timings()}
    if h.params.top_logprobs:  # per token, [[id, log-prob], ...] most likely first
        out["top_logprobs"] = [[list(p) for p in row] for row in c.top_logprobs or []]
    return out


def _add_tokenizer_routes(app: FastAPI, server: ServerState, auth: list) -> None:
    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeBody):
        server.check_model(body.model)
        if (body.text is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'text' and 'messages'", param="text")
        if body.text is not None:
            ids = server.tokenizer(body.text, add_special_tokens=body.add_special_tokens)
            tokens = [int(i) for i in ids["input_ids"]]
        else:
            tokens = render_chat(server.tokenizer, body.messages, body.tools, server.template)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": server.max_context}

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: DetokenizeBody):
        server.check_model(body.model)
        if body.tokens:
            server.check_ids(body.tokens, "tokens", param="tokens")
        return {"text": server.tokenizer.decode(body.tokens, skip_special_tokens=True,
                                                clean_up_tokenization_spaces=False)}
