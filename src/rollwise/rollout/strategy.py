"""What each rollout strategy is made of, decided once: the scheduler runs it, the config
checks (compose/preflight.py), the builders (compose/parts.py) and the Ray driver read it.

    >>> STRATEGIES["partial+context"].pools_partials, strategy("sync").needs_request_engine
    (True, False)

Imports nothing of rollwise: a plain table of facts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Strategy:
    """One rollout strategy. `static_batch`: one batch at a time, the step ends with its
    last sequence; `pools_partials`: over-provisions and keeps unfinished responses for the
    next step (APRIL), so groups outlive a step and a step's groups are not numbered by
    request; `orders_by_context`: probes first, then longest-predicted-first in chunks
    (Seer)."""

    name: str
    static_batch: bool = False
    pools_partials: bool = False
    orders_by_context: bool = False

    @property
    def needs_request_engine(self) -> bool:
        """Whether it needs an engine with the request-level API (the native engine): the
        pool and the chunked order resume and re-queue single requests."""
        return self.pools_partials or self.orders_by_context


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("sync", static_batch=True),
    Strategy("continuous"),
    Strategy("partial", pools_partials=True),
    Strategy("context", orders_by_context=True),
    Strategy("partial+context", pools_partials=True, orders_by_context=True),
)}


def strategy(name: str) -> Strategy:
    """The strategy called `name`; a ValueError listing the strategies otherwise."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown rollout strategy '{name}'; "
                         f"available: {', '.join(STRATEGIES)}")
    return STRATEGIES[name]
