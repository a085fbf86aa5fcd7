"""One sampled sequence ("choice") from submission to result, on top of the driver: stop
strings end it early (the driver aborts it), text comes out as it may be shown, and the
top log-probs a request asked for travel with their tokens (cut where the ids are cut).

Imports `engine.base`, `engine.sampling` and the serve driver and text edge.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from rollwise.engine.base import SamplingParams
from rollwise.engine.sampling import derive_seed
from rollwise.serve.driver import Done, EngineDriver, Event, Failed, Handle, Tokens
from rollwise.serve.text import TextTracker

# text, the token ids behind it, their log-probs, their top log-probs (None: not asked)
Delta = tuple[str, list[int], list[float], list | None]


class EngineFailure(RuntimeError):
    """The engine refused (status 400) or failed (500) a request; the message says why."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


@dataclass
class ChoiceResult:
    """A finished sequence: exactly the sampled tokens (the stop token included when one was
    sampled; cut after the token that completed a stop string), their behaviour log-probs
    and policy versions, and the text shown for them."""

    prompt_ids: list[int]  # [P]
    token_ids: list[int]  # [T]
    logprobs: list[float]  # [T]
    versions: list[int]  # [T]
    finish_reason: str  # "stop" | "length" | "abort"
    text: str
    extra: dict = field(default_factory=dict)
    # [T] the k most likely (id, log-prob) per token, when the request asked (else None)
    top_logprobs: list[list[tuple[int, float]]] | None = None

    def record(self) -> dict:
        return {"prompt_token_ids": self.prompt_ids, "token_ids": self.token_ids,
                "logprobs": self.logprobs, "versions": self.versions,
                "finish_reason": self.finish_reason, "text": self.text, **self.extra}


class ChoiceState:
    """Folds a request's events into text and a result (no threading of its own)."""

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str]):
        self.prompt_ids = prompt_ids
        self.tracker = TextTracker(tokenizer, stop)
        self.seen = 0  # engine tokens fed to the tracker
        self.tops: list | None = None  # top log-probs of every engine token (when asked)
        self.result: ChoiceResult | None = None
        self.error: str | None = None
        self.error_status = 500

    def feed(self, event: Event) -> bool:
        """Take one event; True when a stop string has just matched (abort the request)."""
        t = self.tracker
        if isinstance(event, Tokens):
            if t.stopped:
                return False
            self.seen += len(event.ids)
            self._add_tops(event.top)
            t.add(event.ids, event.logprobs, event.versions)
            return t.stopped
        if isinstance(event, Failed):
            self.error, self.error_status = event.message, event.status
            return False
        c = event.completion
        if not t.stopped:
            s = self.seen
            self.seen = len(c.token_ids)
            self._add_tops(None if c.top_logprobs is None else c.top_logprobs[s:])
            t.add(c.token_ids[s:], c.logprobs[s:], c.versions[s:], final=True)
        reason = "stop" if t.stopped else c.finish_reason
        tops = None if self.tops is None else self.tops[:len(t.ids)]  # cut as the ids are
        self.result = ChoiceResult(self.prompt_ids, list(t.ids), list(t.logprobs),
                                   list(t.versions), reason, t.text, top_logprobs=tops)
        return False

    def _add_tops(self, tops: list | None) -> None:
        if tops is not None:
            if self.tops is None:
                self.tops = []
            self.tops.extend(tops)

    def take(self, final: bool = False) -> Delta:
        """The tracker's next piece of text with the ids behind it, their log-probs and
        (when asked) their top log-probs."""
        text, ids, lps = self.tracker.take(final)
        end = self.tracker.given
        tops = None if self.tops is None else self.tops[end - len(ids):end]
        return text, ids, lps, tops


def sequence_seed(base: int | None, index: int) -> int:
    """The seed of sequence `index` of a call seeded `base`: the same as the engine's own
    `generate(prompts, SamplingParams(n=n, seed=base))` gives that sequence. Unseeded calls
    draw from the OS, never from torch's global generator (a trainer in the same process
    keeps its own random stream)."""
    return secrets.randbits(62) if base is None else derive_seed(base % 2**64, index)


def start_sync(driver: EngineDriver, tokenizer, prompt_ids: list[int], params: SamplingParams,
               seed: int | None, stop: list[str],
               on_result: Callable[[ChoiceState], None]) -> Handle:
    """Submit a choice whose events are folded on the driver thread; `on_result` is called
    there once it has a result or an error (rollout jobs use this)."""
    state = ChoiceState(tokenizer, prompt_ids, stop)
    handle: list[Handle] = []

    def sink(event: Event) -> None:
        if state.feed(event):
            driver.abort(handle[0])
        if isinstance(event, (Done, Failed)):
            on_result(state)

    handle.append(driver.submit(prompt_ids, params, seed, sink, watch=bool(stop)))
    return handle[0]




async def run_choice(driver: EngineDriver, tokenizer, prompt_ids: list[int],
                     params: SamplingParams, seed: int | None, stop: list[str],
                     on_delta: Callable[[Delta], Awaitable[None]] | None = None,
                     ) -> ChoiceResult:
    """Generate one choice; `on_delta` (streaming) gets the text as it may be shown. A
    cancelled caller (client gone) aborts the request."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()

    def sink(event: Event) -> None:
        loop.call_soon_threadsafe(events.put_nowait, event)

    state = ChoiceState(tokenizer, prompt_ids, stop)
    h = driver.submit(prompt_ids, params, seed, sink, watch=bool(stop) or on_delta is not None)
    try:
        while True:
            event = await events.get()
            if state.feed(event):
                driver.abort(h)
            if state.error is not None:
                raise EngineFailure(state.error, state.error_status)
            if state.result is not None:
                if on_delta is not None:
                    delta = state.take(final=True)
                    if delta[0] or delta[1]:
                        await on_delta(delta)
                return state.result
            if on_delta is not None:
                delta = state.take()
                if delta[0]:
                    await on_delta(delta)
    finally:
        if not h.finished:
            driver.abort(h)
