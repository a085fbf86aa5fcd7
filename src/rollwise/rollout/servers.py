"""HTTP to inference servers in other processes: a request sent again (to the next server
when there are several) a bounded number of times when a server is unreachable or answers
5xx or "busy" (409: a weight update already running; 429: queue full), then one error
naming the server, the route and the cause; a request that outlasts its time limit is an
error at once (never a hang). An answer is read by the caller's
parser; a body that is not JSON, or that the parser cannot read, is an error naming the
server and the route at once (a server speaking another protocol is not retried).

Imports httpx only; the rollout port over these servers is rollout/remote.py, what it says
to each kind of server rollout/dialects.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

# answers that say "not now" rather than "never": a weight update already running (a trainer
# resumed while its server still loads the last one), the server's queue full
BUSY = (409, 429)


class RemoteError(RuntimeError):
    """A server failed a request for good: the message names the server, the route and
    the cause (the server's own message when it answered)."""


class Servers:
    """The servers' base URLs and one HTTP client over them. `timeout_s`: the longest one
    request may take; `retries`: times a failed request is sent again."""

    def __init__(self, urls: list[str], *, timeout_s: float, retries: int,
                 backoff_s: float = 0.25):
        if not urls:
            raise ValueError("no server URLs")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.client = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=min(5.0, timeout_s)),
                                   limits=httpx.Limits(max_connections=None))
        self._lock = threading.Lock()
        self.retried = 0  # requests sent again (all routes), since the last `take_retries`

    def post(self, route: str, body: dict[str, Any], *, first: int = 0,
             spread: bool = True, parse: Callable[[Any], Any] | None = None,
             text_ok: bool = False) -> tuple[Any, float]:
        """POST `body` to server `first` (modulo their number); a failure is sent again to
        the next one (`spread`) or to the same. (the answer, read by `parse` when given;
        the round-trip seconds)."""
        failures: list[str] = []
        for attempt in range(self.retries + 1):
            url = self.urls[(first + (attempt if spread else 0)) % len(self.urls)]
            cause = self._attempt(url, route, body, text_ok)
            if isinstance(cause, tuple):
                return (cause if parse is None else
                        (_parsed(parse, cause[0], url + route), cause[1]))
            failures.append(f"{url}: {cause}")
            if attempt < self.retries:
                with self._lock:
                    self.retried += 1
                time.sleep(self.backoff_s * 2**attempt)
        raise RemoteError(f"POST {route} failed {len(failures)} time(s): "
                          + "; ".join(dict.fromkeys(failures)))

    def _attempt(self, url: str, route: str, body: dict[str, Any], text_ok: bool = False):
        """(answer, seconds), or the cause of a failure worth retrying (text); raises
        RemoteError for one that is not (a time-out, a 4xx answer)."""
        start = time.perf_counter()
        try:
            r = self.client.post(url + route, json=body)
        except httpx.TimeoutException as e:
            raise RemoteError(f"{url}{route}: no answer within engine.remote_timeout_s="
                              f"{self.timeout_s:g}s ({type(e).__name__})") from None
        except httpx.TransportError as e:
            return f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - start
        if r.status_code < 400:
            return _json(r, url + route, text_ok), seconds
        if r.status_code < 500 and r.status_code not in BUSY:
            raise RemoteError(f"{url}{route} answered {r.status_code}: {error_message(r)}")
        return f"answered {r.status_code}: {error_message(r)}"

    def get(self, index: int, route: str, parse: bool = True) -> Any:
        """GET `route` of server `index` (no retry: a probe): its JSON (`parse`), else
        None once it answered below 400."""
        url = self.urls[index]
        try:
            r = self.client.get(url + route)
        except httpx.HTTPError as e:
            raise RemoteError(f"{url}{route}: {type(e).__name__}: {e}") from None
        if r.status_code >= 400:
            raise RemoteError(f"{url}{route} answered {r.status_code}: {error_message(r)}")
        return r.json() if parse else None

    def take_retries(self) -> int:
        with self._lock:
            out, self.retried = self.retried, 0
        return out

    def close(self) -> None:
        self.client.close()


def _json(r: httpx.Response, where: str, text_ok: bool = False) -> Any:
    """A successful answer's JSON ({} for an empty body, as some control routes send; a
    plain-text confirmation, as vLLM's /v1/load_lora_adapter sends, as {"message": text}
    where `text_ok`: a control route's)."""
    if not r.content.strip():
        return {}
    if text_ok and not r.content.lstrip().startswith((b"{", b"[")):
        return {"message": r.text[:1000]}
    try:
        return r.json()
    except ValueError:
        raise RemoteError(f"{where} answered {r.status_code} with a body that is not JSON: "
                          f"{r.text[:200]!r}") from None


def _parsed(parse: Callable[[Any], Any], answer: Any, where: str) -> Any:
    """`parse(answer)`; an answer without the fields it reads is an error naming `where`."""
    try:
        return parse(answer)
    except RemoteError as e:
        raise RemoteError(f"{where}: {e}") from None
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise RemoteError(f"{where}: malformed answer ({type(e).__name__}: {e})") from None


def error_message(r: httpx.Response) -> str:
    """The server's own message (`{"error": {"message", "phase"?}}`, or a top-level
    `message` or `detail` as SGLang and FastAPI send), else the body's start."""
    try:
        answer = r.json()
        error = answer.get("error") or {k: answer[k] for k in ("message", "detail")
                                        if k in answer}
    except (ValueError, AttributeError):
        return r.text[:300] or r.reason_phrase
    if not isinstance(error, dict):
        return str(error)[:300]
    message = str(error.get("message") or error.get("detail") or "")[:300] or r.reason_phrase
    phase = error.get("phase")
    return f"{message} (phase: {phase})" if phase and str(phase) not in message else message
