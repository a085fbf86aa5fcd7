"""The rollout service's routes: /v1/rollouts (submit a batch of episodes, list, poll, cancel,
delete the jobs) and /v1/episodes (the calls recorded under an episode id).

Imports FastAPI, `serve.choices`, `serve.errors`, `serve.schemas`, `serve.text`;
`serve.state` (`ServerState`).
"""

from __future__ import annotations

import asyncio
import time
from functools import partial

from fastapi import FastAPI

from rollwise.engine.base import SamplingParams
from rollwise.serve.choices import sequence_seed, start_sync
from rollwise.serve.errors import APIError
from rollwise.serve.schemas import RolloutBody
from rollwise.serve.state import ServerState
from rollwise.serve.text import render_chat


def add_rollout_routes(app: FastAPI, server: ServerState, auth: list) -> None:
    """/v1/rollouts: submit a batch of episodes, list the jobs; and each job's own routes."""

    @app.post("/v1/rollouts", dependencies=auth)
    async def submit(body: RolloutBody):
        server.check_model(body.model)
        server.refuse(body.refusal())
        if body.stream:
            raise APIError(400, "/v1/rollouts does not stream; poll GET /v1/rollouts/{id}",
                           param="stream")
        if len(body.episodes) > server.limits.max_prompts:
            raise APIError(400, f"{len(body.episodes)} episodes is over this server's limit "
                           f"of {server.limits.max_prompts}", param="episodes")
        prompts, plist = _episode_prompts(server, body)
        server.reserve(body.n * len(prompts))
        job = server.rollouts.new([{"id": ep.id, "prompt_token_ids": p}
                                   for ep, p in zip(body.episodes, prompts)], body.n)
        for j, ids in enumerate(prompts):
            for k in range(body.n):
                job.handles[(j, k)] = start_sync(
                    server.driver, server.tokenizer, ids, plist[j],
                    sequence_seed(body.seed, j * body.n + k), body.stop_list(),
                    partial(job.on_result, j, k))
        return job.view(results=False)

    @app.get("/v1/rollouts", dependencies=auth)
    async def list_jobs():
        with server.rollouts.lock:
            jobs = list(server.rollouts.jobs.values())
        return {"object": "list", "data": [j.view(results=False) for j in jobs]}

    _add_job_routes(app, server, auth)


def _add_job_routes(app: FastAPI, server: ServerState, auth: list) -> None:
    """/v1/rollouts/{job_id}: poll, cancel, delete one job."""

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


def _episode_prompts(server: ServerState, body: RolloutBody
                     ) -> tuple[list[list[int]], list[SamplingParams]]:
    """Each episode's prompt ids (from its messages, text or token ids) and sampling params."""
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
    return prompts, plist


def add_episode_routes(app: FastAPI, server: ServerState, auth: list) -> None:
    """/v1/episodes: the episode ids with recorded calls; one episode's calls, kept or taken."""

    @app.get("/v1/episodes", dependencies=auth)
    async def episodes():
        return {"object": "list", "data": server.episodes.ids()}

    @app.get("/v1/episodes/{episode_id}", dependencies=auth)
    async def episode(episode_id: str):
        return _episode(episode_id, server.episodes.get(episode_id))

    @app.delete("/v1/episodes/{episode_id}", dependencies=auth)
    async def collect(episode_id: str):
        return _episode(episode_id, server.episodes.pop(episode_id))


def _episode(episode_id: str, calls: list | None) -> dict:
    if calls is None:
        raise APIError(404, f"no calls recorded under episode '{episode_id}'")
    return {"id": episode_id, "object": "episode", "calls": calls}
