"""The router's Prometheus registry (requests by code and tier, latency, TTFT, upstream errors, retries, workers by health); the proxy records into it."""
from __future__ import annotations

import time
from collections.abc import Callable

from pdfleet_worker import metrics as m


class RouterMetrics:
    def __init__(self, tiers: list[str], workers: Callable[[], list[tuple[str, str, bool]]]):
        """workers: (tier, role, healthy) of every known worker, read at scrape time."""
        self.registry = m.new_registry()
        self._requests = m.make(m.ROUTER_REQUESTS_TOTAL, self.registry)
        self._duration = m.make(m.ROUTER_REQUEST_DURATION, self.registry)
        self._ttft = m.make(m.ROUTER_TIME_TO_FIRST_TOKEN, self.registry)
        self._upstream_errors = m.make(m.ROUTER_UPSTREAM_ERRORS_TOTAL, self.registry)
        self._retries = m.make(m.ROUTER_RETRIES_TOTAL, self.registry)
        self._workers = workers
        # NOTE: the codes the rollback ratio reads exist at 0 from the start: a 5xx series that
        # appears only with the first error makes increase() miss that error and leaves the
        # ratio empty (not 0) while all is well.
        for tier in tiers:
            for code in ("200", "400", "500", "502", "503", "504"):
                self._requests.labels(code=code, tier=tier)
        self.registry.register(m.SnapshotCollector(self._snapshot))

    def finished(self, tier: str, code: int, start: float) -> None:
        self._requests.labels(code=str(code), tier=tier).inc()
        self._duration.labels(tier=tier).observe(time.monotonic() - start)

    def first_token(self, tier: str, start: float) -> None:
        self._ttft.labels(tier=tier).observe(time.monotonic() - start)

    def upstream_error(self, role: str, reason: str) -> None:
        self._upstream_errors.labels(upstream_role=role, reason=reason).inc()

    def retry(self, role: str) -> None:
        self._retries.labels(upstream_role=role).inc()

    def exposition(self) -> bytes:
        return m.exposition(self.registry)

    def _snapshot(self) -> list:
        counts: dict[tuple[str, str, str], int] = {}
        for tier, role, healthy in self._workers():
            for state in ("healthy", "unhealthy"):
                counts.setdefault((tier, role, state), 0)
            counts[(tier, role, "healthy" if healthy else "unhealthy")] += 1
        fam = m.family(m.ROUTER_WORKERS)
        for labels, n in sorted(counts.items()):
            fam.add_metric(list(labels), n)
        return [fam]
