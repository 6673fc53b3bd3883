"""The router's Prometheus registry (requests by code and tier, latency, TTFT, upstream errors, retries, workers by
health) and the middleware that counts every answer once; the proxy records into them."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdfleet_worker import metrics as m

OUTCOME = "pdfleet.outcome"  # the request scope key of its Outcome
NO_REVISION = "none"  # answers no worker gave (no worker in rotation, a timeout, the router's own refusals)
# Probes and scrapes are not client requests: counting them would dilute the error ratio rollbacks read.
UNCOUNTED_PATHS = frozenset({"/health", "/ready", "/metrics", "/workers"})
# Why one role served a PD request whole (pdfleet_router_pd_fallbacks_total's reason).
NO_PREFILL, NO_PAIR, NO_DECODE = "no_prefill", "no_pair", "no_decode"
PREFILL_POOL, SHORT_PROMPT = "prefill_pool", "short_prompt"  # pdfleet_router_pd_routes_total{route}


@dataclasses.dataclass
class Outcome:
    """What the status line does not say about an answer: its tier (the proxy sets it once known)
    and a stream's final code (how it ended: 200, an error event's code, 502, or 499 if the client left)."""

    tier: str
    code: int | None = None
    start: float = dataclasses.field(default_factory=time.monotonic)
    revision: str = NO_REVISION  # of the worker whose answer the client got; none: no worker answered
    shed: bool = False  # every worker tried answered 503 (busy or draining): load shedding, by design

    def served_by(self, revision: str | None, *, shed: bool = False) -> None:
        self.revision, self.shed = str(revision) if revision else NO_REVISION, shed


class CountResponses:
    """ASGI middleware: every answer the router gives a client is counted once in
    pdfleet_router_requests_total{code, tier} -- the proxy's, its own errors and bugs (500), unknown
    paths (404) and methods (405), /v1/models -- except probes and scrapes (UNCOUNTED_PATHS)."""

    def __init__(self, app: ASGIApp, metrics: Callable[[], "RouterMetrics | None"], default_tier: str):
        self.app, self.metrics, self.default_tier = app, metrics, default_tier

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        outcome = scope[OUTCOME] = Outcome(self.default_tier)
        status: int | None = None

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except Exception:
            status = status or 500  # the app's error handler answers it outside this middleware
            raise
        except BaseException:
            status = status or 499  # cancelled: the server is stopping or the client left
            raise
        finally:
            metrics = self.metrics()
            if metrics is not None:
                metrics.finished(
                    outcome.tier, outcome.code or status or 500, outcome.start, outcome.revision, outcome.shed
                )


class RouterMetrics:
    def __init__(
        self,
        tiers: list[str],
        workers: Callable[[], list[tuple[str, str, bool]]],
        revisions: Callable[[], Iterable[str]] = lambda: (),
    ):
        """workers: (tier, role, healthy) of every known worker, read at scrape time; revisions: those the
        workers report (their series are created at 0 as soon as a scrape sees them)."""
        self._worker_revisions = revisions
        self.registry = m.new_registry()
        self._requests = m.make(m.ROUTER_REQUESTS_TOTAL, self.registry)
        self._duration = m.make(m.ROUTER_REQUEST_DURATION, self.registry)
        self._ttft = m.make(m.ROUTER_TIME_TO_FIRST_TOKEN, self.registry)
        self._upstream_errors = m.make(m.ROUTER_UPSTREAM_ERRORS_TOTAL, self.registry)
        self._retries = m.make(m.ROUTER_RETRIES_TOTAL, self.registry)
        self._routed = m.make(m.ROUTER_ROUTED_REQUESTS_TOTAL, self.registry)
        self._local_prefills = m.make(m.ROUTER_LOCAL_PREFILLS_TOTAL, self.registry)
        self._pd_fallbacks = m.make(m.ROUTER_PD_FALLBACKS_TOTAL, self.registry)
        self._pd_routes = m.make(m.ROUTER_PD_ROUTES_TOTAL, self.registry)
        # NOTE: the labelled counters a short prompt's route bumps, bound once: labels() validates and looks up
        # under a lock each call, ~10 us of a route that must cost no more than a colocated request
        self._pd_route_counts: dict[tuple[str, str], Any] = {}
        self._by_revision = m.make(m.ROUTER_REVISION_REQUESTS_TOTAL, self.registry)
        self._revisions: set[str] = set()
        self.known_revision(NO_REVISION)
        self._workers = workers
        # NOTE: the codes the rollback ratio reads exist at 0 from the start: a 5xx series that
        # appears only with the first error makes increase() miss that error and leaves the
        # ratio empty (not 0) while all is well.
        for tier in tiers:
            self._local_prefills.labels(tier=tier)
            for reason in (NO_PREFILL, NO_PAIR, NO_DECODE):
                self._pd_fallbacks.labels(tier=tier, reason=reason)
            for route in (PREFILL_POOL, SHORT_PROMPT):
                self._pd_route_counts[(tier, route)] = self._pd_routes.labels(tier=tier, route=route)
            for code in ("200", "400", "401", "500", "502", "503", "504"):
                self._requests.labels(code=code, tier=tier)
        self.registry.register(m.SnapshotCollector(self._snapshot))

    def finished(self, tier: str, code: int, start: float, revision: str = NO_REVISION, shed: bool = False) -> None:
        self._requests.labels(code=str(code), tier=tier).inc()
        self.known_revision(revision)
        self._by_revision.labels(revision=revision, code=str(code), shed="true" if shed else "false").inc()
        self._duration.labels(tier=tier).observe(time.monotonic() - start)

    def first_token(self, tier: str, start: float) -> None:
        self._ttft.labels(tier=tier).observe(time.monotonic() - start)

    def upstream_error(self, role: str, reason: str) -> None:
        self._upstream_errors.labels(upstream_role=role, reason=reason).inc()

    def retry(self, role: str) -> None:
        self._retries.labels(upstream_role=role).inc()

    def known_revision(self, revision: str) -> None:
        """Create a revision's series at 0 (when the router first sees a worker of it): a series born with its
        first error would hide that error from increase()."""
        if revision in self._revisions:
            return
        self._revisions.add(revision)
        for code in ("200", "400", "500", "502", "503", "504"):
            self._by_revision.labels(revision=revision, code=code, shed="false")
        self._by_revision.labels(revision=revision, code="503", shed="true")

    def local_prefill(self, tier: str, reason: str = NO_PREFILL) -> None:
        """A decode worker computes a PD request's prompt itself."""
        self._local_prefills.labels(tier=tier).inc()
        self._pd_fallbacks.labels(tier=tier, reason=reason).inc()

    def pd_route(self, tier: str, route: str) -> None:
        """The path a PD request took: through the prefill pool, or straight to a decode worker (a short prompt)."""
        counter = self._pd_route_counts.get((tier, route))
        (counter if counter is not None else self._pd_routes.labels(tier=tier, route=route)).inc()

    def local_decode(self, tier: str) -> None:
        """A prefill worker serves a PD request whole."""
        self._pd_fallbacks.labels(tier=tier, reason=NO_DECODE).inc()

    def routed(self, route: str, reason: str, n: int = 1) -> None:
        self._routed.labels(route=route, reason=reason).inc(n)

    def exposition(self) -> bytes:
        for revision in self._worker_revisions():
            self.known_revision(revision)
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
