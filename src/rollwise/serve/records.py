"""What the server keeps for training: rollout jobs (/v1/rollouts) and the calls recorded
under an episode id (OpenAI calls made with an `episode_id`).

Both are in memory and bounded: the oldest finished jobs and the oldest episodes are dropped
past their limits (and counted), so a trainer that never collects cannot exhaust memory.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from rollwise.serve.choices import ChoiceState
from rollwise.serve.driver import Handle


@dataclass
class RolloutJob:
    """A batch of episodes x n samples submitted at once."""

    id: str
    episodes: list[dict]  # [{"id", "prompt_token_ids"}] per episode
    n: int
    created: float = field(default_factory=time.time)
    handles: dict[tuple[int, int], Handle] = field(default_factory=dict)
    results: dict[tuple[int, int], dict] = field(default_factory=dict)
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def total(self) -> int:
        return len(self.episodes) * self.n

    @property
    def status(self) -> str:
        if len(self.results) < self.total:
            return "cancelling" if self.cancelled else "running"
        return "cancelled" if self.cancelled else "completed"

    def on_result(self, episode: int, sample: int, state: ChoiceState) -> None:
        """Called on the driver thread when one sequence ends."""
        meta = {"episode": episode, "sample": sample, "episode_id": self.episodes[episode]["id"]}
        if state.error is not None:
            record = meta | {"error": state.error, "finish_reason": "error"}
        else:
            record = meta | state.result.record()
        with self.lock:
            self.results[(episode, sample)] = record

    def view(self, results: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "object": "rollout", "status": self.status,
                               "created": int(self.created), "total": self.total,
                               "done": len(self.results), "n": self.n,
                               "episodes": len(self.episodes)}
        if results:
            with self.lock:
                out["results"] = [self.results[k] for k in sorted(self.results)]
        return out


class RolloutJobs:
    def __init__(self, max_jobs: int = 1000):
        self.jobs: OrderedDict[str, RolloutJob] = OrderedDict()
        self.max_jobs = max_jobs
        self.dropped = 0
        self.lock = threading.Lock()

    def new(self, episodes: list[dict], n: int) -> RolloutJob:
        job = RolloutJob(f"ro-{secrets.token_hex(8)}", episodes, n)
        with self.lock:
            self.jobs[job.id] = job
            finished = [k for k, j in self.jobs.items() if j.status in ("completed", "cancelled")]
            while len(self.jobs) > self.max_jobs and finished:
                self.jobs.pop(finished.pop(0))
                self.dropped += 1
        return job

    def get(self, job_id: str) -> RolloutJob | None:
        with self.lock:
            return self.jobs.get(job_id)

    def pop(self, job_id: str) -> RolloutJob | None:
        with self.lock:
            return self.jobs.pop(job_id, None)


class EpisodeLog:
    """OpenAI calls grouped by episode id, in call order. Each call's record carries what
    a trainer needs to rebuild the trajectory token for token: the prompt ids and, per
    choice, the sampled ids, their log-probs and policy versions."""

    def __init__(self, max_calls: int = 100_000):
        self.episodes: OrderedDict[str, list[dict]] = OrderedDict()
        self.max_calls = max_calls
        self.calls = 0
        self.dropped_episodes = 0
        self.lock = threading.Lock()

    def add(self, episode_id: str, record: dict) -> None:
        with self.lock:
            calls = self.episodes.setdefault(episode_id, [])
            record = {"call": len(calls), "created": int(time.time())} | record
            calls.append(record)
            self.calls += 1
            while self.calls > self.max_calls and len(self.episodes) > 1:
                _, old = self.episodes.popitem(last=False)
                self.calls -= len(old)
                self.dropped_episodes += 1

    def ids(self) -> list[dict]:
        with self.lock:
            return [{"id": k, "calls": len(v)} for k, v in self.episodes.items()]

    def get(self, episode_id: str) -> list[dict] | None:
        with self.lock:
            calls = self.episodes.get(episode_id)
            return list(calls) if calls is not None else None

    def pop(self, episode_id: str) -> list[dict] | None:
        """Collect an episode: its calls, forgotten by the server."""
        with self.lock:
            calls = self.episodes.pop(episode_id, None)
            if calls is not None:
                self.calls -= len(calls)
            return calls


def as_trajectory(record: dict, sample, prompt_ids: list[int] | None = None):
    """A rollwise `Trajectory` (unscored) from one recorded sequence: a /v1/rollouts result,
    or one choice of a recorded call (pass the call's `prompt_token_ids`). The ids, log-probs
    and versions are the sampled ones, so the learner trains on exactly what was sampled.

    >>> from rollwise.types import Sample
    >>> t = as_trajectory({"prompt_token_ids": [1, 5], "token_ids": [7, 2], "logprobs":
    ...     [-0.5, -0.1], "versions": [3, 3], "finish_reason": "stop", "text": "x"},
    ...     Sample(id="s", prompt="1+", answer="1"))
    >>> t.response_ids, t.versions, t.finish_reason
    ([7, 2], [3, 3], 'stop')
    """
    from rollwise.types import Trajectory

    finish = record["finish_reason"] if record["finish_reason"] in ("stop", "length") else "abort"
    return Trajectory(sample=sample,
                      prompt_ids=list(prompt_ids if prompt_ids is not None
                                      else record["prompt_token_ids"]),
                      response_ids=list(record["token_ids"]), logprobs=list(record["logprobs"]),
                      versions=list(record["versions"]), finish_reason=finish,
                      text=record.get("text", ""))
