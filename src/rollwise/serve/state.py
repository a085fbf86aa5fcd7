"""The server's state and the checks every route shares: `Limits` (what one request may ask
for) and `ServerState` (the engine's driver thread, the tokenizer edge, the records, the weight
store, the metrics, and the helpers that turn a request body into engine parameters or a
4xx). `server.py` puts the HTTP app and uvicorn over it; the routes read it.

Imports `engine.base` and the serve modules below the routes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rollwise.engine.base import RequestEngine, SamplingParams
from rollwise.serve.driver import EngineDriver
from rollwise.serve.errors import APIError
from rollwise.serve.metrics import ServerMetrics
from rollwise.serve.records import EpisodeLog, RolloutJobs
from rollwise.serve.schemas import Refusal
from rollwise.serve.text import DEFAULT_CHAT_TEMPLATE
from rollwise.serve.weights import WeightStore


@dataclass
class Limits:
    """What one request may ask for; over a limit is a 4xx naming it."""

    max_body_bytes: int = 1 << 20  # request body (413 beyond)
    max_tokens: int = 4096  # max_tokens per choice (the context may allow less)
    max_n: int = 16  # choices per prompt
    max_prompts: int = 256  # prompts of one /v1/completions call, episodes of one rollout job
    max_pending: int = 4096  # sequences queued or running at once (429 beyond)


class ServerState:
    """The server's state: the engine's driver thread, the tokenizer edge, the records."""

    def __init__(self, policy, engine: RequestEngine, *, name: str, api_key: str | None = None,
                 limits: Limits | None = None, source: str = "",
                 aliases: tuple[str, ...] = ()):
        """`name`: the model id clients see; `aliases`: other ids accepted for it."""
        self.policy, self.engine, self.name, self.source = policy, engine, name, source
        self.aliases = tuple(a for a in aliases if a != name)
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
        self.weights = WeightStore(policy.model)
        self.metrics = ServerMetrics(engine, self.driver)
        self.generating: dict[str, list] = {}  # /v1/generate request id -> its driver handles

    def publish(self, version: int) -> None:
        """New weights are in place: later tokens carry `version` (applied by the driver
        thread between steps when it runs; directly otherwise)."""
        if self.driver.alive:
            self.driver.call(lambda e: e.publish(version)).result()
        else:
            self.engine.publish(version)

    # -- request helpers -------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name and model not in self.aliases:
            also = f" (also accepted: {', '.join(self.aliases)})" if self.aliases else ""
            raise APIError(404, f"model '{model}' is not served here; this server serves "
                           f"'{self.name}'{also}", param="model")

    @staticmethod
    def refuse(refusal: Refusal | None) -> None:
        """A body's `refusal()` as a 400 naming the field."""
        if refusal is not None:
            raise APIError(400, refusal[1], param=refusal[0])

    def params(self, body, prompt_len: int, max_tokens: int | None,
               where: str = "prompt", top: int = 0) -> SamplingParams:
        """The engine's parameters for one sequence of `body`; `top`: top log-probs per
        token (checked by the body's refusal)."""
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
                              max_tokens=max_tokens, ignore_eos=body.ignore_eos,
                              stop_token_ids=self.stop_ids(body.stop_token_ids),
                              top_logprobs=top)

    def stop_ids(self, extra: list[int] | None) -> tuple[int, ...] | None:
        """The ids that end a choice: the model's EOS ids and `extra` (None: EOS only)."""
        if not extra:
            return None
        self.check_ids(extra, "stop_token_ids", param="stop_token_ids")
        return tuple(sorted(set(self.policy.stop_ids) | set(extra)))

    def reserve(self, sequences: int) -> None:
        if self.driver.pending + sequences > self.limits.max_pending:
            raise APIError(429, f"server busy: {self.driver.pending} sequences pending, limit "
                           f"{self.limits.max_pending}; retry later", kind="rate_limit_error")

    def encode_text(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text, add_special_tokens=True)["input_ids"]]

    def check_ids(self, ids: list[int], where: str, param: str = "prompt") -> list[int]:
        vocab = len(self.tokenizer)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise APIError(400, f"{where}: token id {bad[0]} is outside the vocabulary "
                           f"(0..{vocab - 1})", param=param)
        if not ids:
            raise APIError(400, f"{where} is empty", param=param)
        return ids

    def token_text(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def chat_token(self, tid: int, lp: float) -> dict:
        """One token of a chat `logprobs.content` list (its text, log-prob, UTF-8 bytes)."""
        tok = self.token_text(tid)
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

    def chat_logprobs(self, ids: list[int], lps: list[float],
                      tops: list[list[tuple[int, float]]] | None = None) -> dict:
        """Chat `logprobs`: per token its entry and `top_logprobs`, the candidates the
        request asked for, most likely first (empty when it asked for none)."""
        out = []
        for t, (tid, lp) in enumerate(zip(ids, lps)):
            top = tops[t] if tops is not None else []
            out.append(self.chat_token(tid, lp)
                       | {"top_logprobs": [self.chat_token(i, v) for i, v in top]})
        return {"content": out}

    def completion_logprobs(self, ids: list[int], lps: list[float], offset: int = 0,
                            tops: list[list[tuple[int, float]]] | None = None) -> dict:
        """Legacy completions `logprobs`; `top_logprobs` per token is {text: log-prob} of
        the candidates asked for (None when none were): candidates whose texts coincide
        keep the likelier one's value, as one JSON object cannot hold a key twice."""
        tokens = [self.token_text(t) for t in ids]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        top = None
        if tops is not None:
            top = []
            for row in tops:
                texts: dict[str, float] = {}
                for tid, v in row:  # most likely first
                    texts.setdefault(self.token_text(tid), v)
                top.append(texts)
        return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top,
                "text_offset": offsets}

    def record(self, episode: str | None, record: dict) -> None:
        if episode:
            self.episodes.add(episode, record)
