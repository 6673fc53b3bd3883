"""The operator's own Prometheus series (scaling decisions, desired replicas, P:D ratio) and the /metrics server for
them."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from pdfleet_operator.decide import metric_names as names
from pdfleet_operator.decide.autoscaler import ScalingDecision, pd_ratio

# The classic text format, whatever the scraper asks for (see `serve`).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class OperatorMetrics:
    """The operator's series in their own registry (one per process; tests make their own)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.decisions = Counter(
            names.SCALING_DECISIONS_TOTAL,
            "Autoscaler decisions by role, direction (up, down, hold) and reason.",
            [names.LABEL_ROLE_OWN, names.LABEL_DIRECTION, names.LABEL_REASON],
            registry=self.registry,
        )
        self.desired = Gauge(
            names.DESIRED_REPLICAS,
            "Replicas the autoscaler asks for, per deployment and role.",
            [names.LABEL_NAMESPACE, names.LABEL_DEPLOYMENT_OWN, names.LABEL_ROLE_OWN],
            registry=self.registry,
        )
        self.ratio = Gauge(
            names.PD_RATIO,
            "Desired prefill replicas / desired decode replicas.",
            [names.LABEL_NAMESPACE, names.LABEL_DEPLOYMENT_OWN],
            registry=self.registry,
        )

    def record(self, namespace: str, deployment: str, decisions: Mapping[str, ScalingDecision]) -> None:
        """Count one round of decisions and set the deployment's desired replicas and P:D ratio."""
        for d in decisions.values():
            self.decisions.labels(d.role, d.direction, d.reason).inc()
            self.desired.labels(namespace, deployment, d.role).set(d.desired)
        ratio = pd_ratio(decisions)
        if ratio is None:
            self.forget_ratio(namespace, deployment)
        else:
            self.ratio.labels(namespace, deployment).set(ratio)

    def forget(
        self, namespace: str, deployment: str, roles: tuple[str, ...] = ("prefill", "decode", "colocated")
    ) -> None:
        """Drop a deleted deployment's series (the counter is per role, not per deployment, and stays)."""
        for role in roles:
            try:
                self.desired.remove(namespace, deployment, role)
            except KeyError:
                pass
        self.forget_ratio(namespace, deployment)

    def forget_ratio(self, namespace: str, deployment: str) -> None:
        try:
            self.ratio.remove(namespace, deployment)
        except KeyError:
            pass

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def serve(metrics: OperatorMetrics, port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Serve `metrics` at http://host:port/metrics on a daemon thread; `.shutdown()` stops it.

    NOTE: not prometheus_client.start_http_server: it answers Prometheus' OpenMetrics Accept header
    with `:` escaped in names, so every pdfleet endpoint serves the classic text format instead.
    """

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            body = metrics.exposition()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="pdfleet-operator-metrics", daemon=True).start()
    return server
