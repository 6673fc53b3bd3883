"""Rollback analysis reads the revision under test: the real router's per-revision counters, scraped by a real
Prometheus, read back by PrometheusSource. Another revision's 5xx and the router's load shedding do not count;
answers no worker gave do (an outage while a revision serves is its own); a router without those series is read
whole."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, generate_latest

from pdfleet_operator.prometheus import PrometheusSource
from pdfleet_worker.router.router_metrics import NO_REVISION, RouterMetrics
from tests.support.components import free_port

WINDOW = "6s"


def serve(exposition) -> tuple[ThreadingHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = exposition()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"127.0.0.1:{server.server_address[1]}"


def target(address: str, deployment: str) -> dict:
    return {"targets": [address], "labels": {"namespace": "default", "pdfleet_deployment": deployment}}


def test_the_revision_under_test_is_judged_on_its_own_answers_without_shedding(prometheus_factory):
    router = RouterMetrics(["default"], lambda: [], lambda: {"1", "2"})
    legacy_registry = CollectorRegistry()
    legacy = Counter(
        "pdfleet_router_requests", "a router without per-revision series", ["code", "tier"], registry=legacy_registry
    )
    for code in ("200", "503"):
        legacy.labels(code=code, tier="default")
    servers = [serve(router.exposition), serve(lambda: generate_latest(legacy_registry))]
    try:
        prom = prometheus_factory(
            extra_scrape_configs=[
                {
                    "job_name": "routers",
                    "scrape_interval": "1s",
                    "static_configs": [target(servers[0][1], "demo"), target(servers[1][1], "legacy")],
                }
            ]
        )
        prom.wait_for('pdfleet_router_revision_requests_total{pdfleet_deployment="demo",revision="2",code="200"}')
        prom.wait_for('pdfleet_router_requests_total{pdfleet_deployment="legacy",code="503"}')
        # Revision 1 (the old pods, draining) fails; revision 2 serves; a burst is shed; no worker answers twice.
        for _ in range(40):
            router.finished("default", 503, 0.0, "1")
        for _ in range(100):
            router.finished("default", 200, 0.0, "2")
        for _ in range(60):
            router.finished("default", 503, 0.0, "2", shed=True)
        for _ in range(2):
            router.finished("default", 503, 0.0, NO_REVISION)
        legacy.labels(code="200", tier="default").inc(90)
        legacy.labels(code="503", tier="default").inc(10)
        prom.wait_for(
            'increase(pdfleet_router_revision_requests_total{pdfleet_deployment="demo",revision="2",code="200"}[6s])'
            " > 0"
        )
        prom.wait_for('increase(pdfleet_router_requests_total{pdfleet_deployment="legacy",code="200"}[6s]) > 0')
        source = PrometheusSource(prom.url)

        total2, errors2, why = source.router_requests("demo", "default", WINDOW, revision=2)
        assert why == "" and total2 > 0
        assert 0 < errors2 / total2 < 0.05, "revision 2: its own 200s and the 2 no worker answered; shedding excluded"
        total1, errors1, _ = source.router_requests("demo", "default", WINDOW, revision=1)
        assert errors1 / total1 > 0.9, "revision 1 is judged on its own 5xx"
        whole, whole_errors, _ = source.router_requests("demo", "default", WINDOW)
        assert whole_errors / whole > 0.4, "without a revision: every answer, shedding included (today's reading)"
        legacy_total, legacy_errors, why = source.router_requests("legacy", "default", WINDOW, revision=2)
        assert why == "" and 0.05 < legacy_errors / legacy_total < 0.2, "no per-revision series: read whole"
        assert source.router_requests("absent", "default", WINDOW, revision=2)[2].startswith(
            "no pdfleet_router_requests_total"
        )
    finally:
        for server, _ in servers:
            server.shutdown()
