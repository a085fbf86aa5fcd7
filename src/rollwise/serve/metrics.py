"""The server's Prometheus metrics (GET /metrics, text format): requests by route and status,
prompt and generated tokens, sequences queued and running, KV cache use, the policy version,
weight updates and their seconds.

Counters the server moves itself live in a registry of its own (one per server, so several
servers in one process do not mix); the engine's figures are read at scrape time from what
the driver thread noted after its last step.

Imports prometheus_client only.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Summary, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class ServerMetrics:
    def __init__(self, engine, driver):
        """`engine`: the served engine (its stats, version, KV budget); `driver`: its
        thread's figures after the last step (running, pending, KV tokens)."""
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("rollwise_requests", "HTTP requests answered, by route and "
                                "status.", ["route", "status"], registry=self.registry)
        self.updates = Counter("rollwise_weight_updates", "Weight updates, by result.",
                               ["result"], registry=self.registry)
        self.update_seconds = Summary("rollwise_weight_update_seconds", "Seconds per weight "
                                      "update (all phases).", registry=self.registry)
        self.registry.register(_EngineCollector(engine, driver))

    def request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def weight_update(self, seconds: float, ok: bool) -> None:
        self.updates.labels(result="ok" if ok else "failed").inc()
        self.update_seconds.observe(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine's figures at scrape time."""

    def __init__(self, engine, driver):
        self.engine, self.driver = engine, driver

    def describe(self):
        return []

    def collect(self):
        engine, driver = self.engine, self.driver
        stats, budget = engine.stats, getattr(engine, "kv_budget_tokens", 0)
        yield _counter("rollwise_prompt_tokens", "Prompt tokens computed (prefill).",
                       stats.prefill_tokens)
        yield _counter("rollwise_generation_tokens", "Tokens generated.",
                       stats.generated_tokens)
        yield _gauge("rollwise_requests_running", "Sequences holding a row of the batch.",
                     driver.running)
        yield _gauge("rollwise_requests_waiting", "Sequences submitted, not yet running.",
                     max(driver.pending - driver.running, 0))
        yield _gauge("rollwise_kv_cache_tokens", "Tokens held in the KV cache.",
                     driver.kv_tokens)
        yield _gauge("rollwise_kv_cache_usage_ratio", "KV cache tokens held / budget.",
                     driver.kv_tokens / budget if budget else 0.0)
        yield _gauge("rollwise_weight_version", "Policy version of the served weights.",
                     engine.version)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class RequestCounter:
    """ASGI middleware: counts each HTTP request by its route's path template and status."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def noting(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noting)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.request(route, status[0])
