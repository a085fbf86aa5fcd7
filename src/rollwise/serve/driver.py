"""The engine's own thread: the one place the engine is touched while the server runs.

Request handlers (asyncio) and the rollout jobs never call the engine; they hand the driver
commands (submit, abort, or any function of the engine such as `publish`) through a queue.
The thread applies the commands, then runs `engine.step()` while anything is unfinished, so
requests that arrive together share forward passes (the engine's continuous batching).
Each request has a `sink`, called on the driver thread with its events:

    Tokens(ids, logprobs, versions, top)  new tokens (only for requests that asked to watch);
                                      `top`: their top log-probs when the params ask
    Done(completion)                  finished, stopped by a stop token/length, or aborted
    Failed(message, status)           refused (400) or the engine raised (500); gone

Each handle records when it was submitted, when the step that gave its first token began
and ended, and when it finished: its queue, prefill and decode seconds (`Handle.timings`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from rollwise.engine.base import RequestEngine, SamplingParams
from rollwise.types import Completion

log = logging.getLogger("rollwise.serve")


@dataclass
class Tokens:
    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    top: list[list[tuple[int, float]]] | None = None  # per token, when the params ask


@dataclass
class Done:
    completion: Completion


@dataclass
class Failed:
    message: str
    status: int = 500  # 400: the engine refused the request (context, budget)


Event = Tokens | Done | Failed


@dataclass(eq=False)
class Handle:
    """One engine request as the server sees it."""

    prompt: list[int]
    params: SamplingParams
    seed: int | None
    sink: Callable[[Event], None]
    watch: bool  # send Tokens events as tokens arrive (streaming, stop strings)
    resume: Completion | None = None  # a partial sample to continue
    priority: float = 0.0
    rid: int | None = None  # the engine's id once submitted
    sent: int = 0  # tokens already sent as Tokens events
    cancelled: bool = False
    finished: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    submitted: float = field(default_factory=time.perf_counter)
    first_step: tuple[float, float] | None = None  # (start, end) of the step with its 1st token
    ended: float | None = None

    def timings(self) -> dict[str, float]:
        """Seconds queued (submitted to the start of the step that gave its first token),
        in that step (its prefill) and decoding after it (to the end)."""
        end = self.ended if self.ended is not None else time.perf_counter()
        start, first = self.first_step or (end, end)
        return {"queue_s": start - self.submitted, "prefill_s": first - start,
                "decode_s": end - first}


class EngineDriver:
    def __init__(self, engine: RequestEngine, *, idle_poll_s: float = 0.05):
        if not isinstance(engine, RequestEngine):
            raise TypeError(f"{type(engine).__name__} lacks the request-level interface "
                            "(submit/step/abort/peek) the server drives; use the native engine")
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, Handle] = {}  # engine id -> handle
        self._stop = threading.Event()
        self._idle_poll_s = idle_poll_s
        self._thread: threading.Thread | None = None
        self.pending = 0  # handles submitted and not finished (read by the app for limits)
        self.running = 0  # sequences holding a row after the last step (for /metrics)
        self.kv_tokens = 0  # tokens held in the KV cache after the last step
        self._starting: set[Handle] = set()  # submitted, no token of their own yet
        self._lock = threading.Lock()

    # -- any thread ------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="rollwise-engine",
                                            daemon=True)
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._commands.put(("wake", None))
            self._thread.join(timeout=30)
            self._thread = None

    def submit(self, prompt: list[int], params: SamplingParams, seed: int | None,
               sink: Callable[[Event], None], *, watch: bool = False,
               resume: Completion | None = None, priority: float = 0.0) -> Handle:
        h = Handle(list(prompt), params, seed, sink, watch, resume, priority)
        with self._lock:
            self.pending += 1
        self._commands.put(("submit", h))
        return h

    def abort(self, h: Handle) -> None:
        """Stop a request; its sink gets Done with the tokens so far (finish 'abort'),
        unless it finished first."""
        h.cancelled = True
        self._commands.put(("abort", h))

    def call(self, fn: Callable[[RequestEngine], Any]) -> Future:
        """Run fn(engine) on the driver thread between steps (e.g. publish new weights)."""
        fut: Future = Future()
        self._commands.put(("call", (fn, fut)))
        return fut

    # -- the driver thread -----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            busy = self.engine.has_unfinished()
            try:
                cmd = self._commands.get(timeout=None if busy else self._idle_poll_s,
                                         block=not busy)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                self._apply(*cmd)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
            if self.engine.has_unfinished():
                self._step()
        for h in list(self._live.values()):  # shutting down: hand back what there is
            self._abort(h)

    def _apply(self, kind: str, arg: Any) -> None:
        if kind == "submit":
            h: Handle = arg
            if h.cancelled:  # aborted before it reached the engine: what it came with
                part = h.resume or Completion(0, [], [], "abort")
                top = part.top_logprobs
                if top is None and h.params.top_logprobs:
                    top = []
                self._done(h, Completion(0, list(part.token_ids), list(part.logprobs), "abort",
                                         list(part.versions),
                                         top_logprobs=None if top is None else list(top)))
                return
            try:
                h.rid = self.engine.submit(h.prompt, h.params, seed=h.seed, resume=h.resume,
                                           priority=h.priority)
            except ValueError as e:  # the engine's own refusal (context, budget)
                self._fail(h, str(e), 400)
                return
            self._live[h.rid] = h
            self._starting.add(h)
        elif kind == "abort":
            if arg.rid is not None and arg.rid in self._live:
                self._abort(arg)
        elif kind == "call":
            fn, fut = arg
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

    def abort_live(self) -> int:
        """On the driver thread: stop every running request (each sink gets Done with its
        tokens so far); how many there were."""
        live = list(self._live.values())
        for h in live:
            self._abort(h)
        return len(live)

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            finished = self.engine.step()
        except Exception as e:
            log.exception("engine step failed")
            for h in list(self._live.values()):
                with contextlib.suppress(Exception):  # the engine's state may be broken
                    self.engine.abort(h.rid)
                self._live.pop(h.rid, None)
                self._fail(h, f"engine error: {type(e).__name__}: {e}")
            return
        self._mark_first_tokens(start, finished)
        for c in finished:
            h = self._live.pop(c.request_id, None)
            if h is not None:
                self._send_new(h, c)
                self._done(h, c)
        for h in list(self._live.values()):
            if h.watch:
                self._send_new(h, self.engine.peek(h.rid))

    def _mark_first_tokens(self, start: float, finished: list[Completion]) -> None:
        """Note the step that gave each starting request its first token; the gauges."""
        end = time.perf_counter()
        done = {c.request_id: c for c in finished}
        for h in list(self._starting):
            c = done.get(h.rid) or (self.engine.peek(h.rid) if h.rid in self._live else None)
            base = len(h.resume.token_ids) if h.resume is not None else 0
            if c is not None and len(c.token_ids) > base:
                h.first_step = (start, end)
                self._starting.discard(h)
        count = getattr(self.engine, "num_running", None)
        held = getattr(self.engine, "kv_tokens", None)
        self.running = count() if count is not None else len(self._live)
        self.kv_tokens = held() if held is not None else 0

    def _send_new(self, h: Handle, c: Completion) -> None:
        if h.watch and len(c.token_ids) > h.sent:
            s = h.sent
            h.sent = len(c.token_ids)
            top = None if c.top_logprobs is None else c.top_logprobs[s:]
            self._emit(h, Tokens(c.token_ids[s:], c.logprobs[s:], c.versions[s:], top))

    def _abort(self, h: Handle) -> None:
        c = self.engine.abort(h.rid)
        self._live.pop(h.rid, None)
        self._send_new(h, c)
        self._done(h, c)

    def _done(self, h: Handle, c: Completion) -> None:
        h.finished, h.ended = True, time.perf_counter()
        self._starting.discard(h)
        with self._lock:
            self.pending -= 1
        self._emit(h, Done(c))

    def _fail(self, h: Handle, message: str, status: int = 500) -> None:
        h.finished, h.ended = True, time.perf_counter()
        self._starting.discard(h)
        with self._lock:
            self.pending -= 1
        self._emit(h, Failed(message, status))

    def _emit(self, h: Handle, event: Event) -> None:
        try:
            h.sink(event)
        except Exception:
            log.debug("request sink failed", exc_info=True)
