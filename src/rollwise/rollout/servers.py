"""HTTP to inference servers in other processes: a request sent again (to the next server
when there are several) a bounded number of times when a server is unreachable or answers
5xx, then one error naming the server, the route and the cause; a request that outlasts
its time limit is an error at once (never a hang).

Imports httpx only; the rollout port over these servers is rollout/remote.py.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx


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
             spread: bool = True) -> tuple[dict[str, Any], float]:
        """POST `body` to server `first` (modulo their number); a failure is sent again to
        the next one (`spread`) or to the same. (the answer, the round-trip seconds)."""
        failures: list[str] = []
        for attempt in range(self.retries + 1):
            url = self.urls[(first + (attempt if spread else 0)) % len(self.urls)]
            cause = self._attempt(url, route, body)
            if isinstance(cause, tuple):
                return cause
            failures.append(f"{url}: {cause}")
            if attempt < self.retries:
                with self._lock:
                    self.retried += 1
                time.sleep(self.backoff_s * 2**attempt)
        raise RemoteError(f"POST {route} failed {len(failures)} time(s): "
                          + "; ".join(dict.fromkeys(failures)))

    def _attempt(self, url: str, route: str, body: dict[str, Any]):
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
            return r.json(), seconds
        if r.status_code < 500:
            raise RemoteError(f"{url}{route} answered {r.status_code}: {error_message(r)}")
        return f"answered {r.status_code}: {error_message(r)}"

    def get(self, index: int, route: str) -> dict[str, Any]:
        """GET `route` of server `index` (no retry: a probe)."""
        url = self.urls[index]
        try:
            r = self.client.get(url + route)
        except httpx.HTTPError as e:
            raise RemoteError(f"{url}{route}: {type(e).__name__}: {e}") from None
        if r.status_code >= 400:
            raise RemoteError(f"{url}{route} answered {r.status_code}: {error_message(r)}")
        return r.json()

    def take_retries(self) -> int:
        with self._lock:
            out, self.retried = self.retried, 0
        return out

    def close(self) -> None:
        self.client.close()


def error_message(r: httpx.Response) -> str:
    """The server's own message (`{"error": {"message", "phase"?}}`), else the body's start."""
    try:
        error = r.json().get("error", {})
    except ValueError:
        return r.text[:300] or r.reason_phrase
    if not isinstance(error, dict):
        return str(error)[:300]
    message = str(error.get("message", "")) or r.reason_phrase
    phase = error.get("phase")
    return f"{message} (phase: {phase})" if phase and str(phase) not in message else message
