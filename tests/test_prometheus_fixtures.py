"""The real Prometheus/Alertmanager fixtures: scrape a prometheus_client exporter, read it back, route an alert."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
from prometheus_api_client import PrometheusConnect
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from tests.support.components import free_port
from tests.support.prometheus import pid_alive


def serve_text_metrics(registry: CollectorRegistry) -> HTTPServer:
    """Serve /metrics in the classic text format whatever the scraper asks for.

    NOTE: prometheus_client >= 0.22 answers an OpenMetrics Accept header (which Prometheus 2.42 sends
    first) with names escaped: `vllm:num_requests_waiting` becomes `vllm_num_requests_waiting`. The
    worker and operator serve text format 0.0.4 for the same reason; this test pins that behaviour.
    """

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_prometheus_scrapes_exporter_and_api_client_reads_it(prometheus_factory):
    registry = CollectorRegistry()
    waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", ["model_name", "role"], registry=registry)
    waiting.labels(model_name="tiny", role="prefill").set(7)
    server = serve_text_metrics(registry)
    port = server.server_address[1]
    try:
        prom = prometheus_factory(targets={"worker": [f"127.0.0.1:{port}"]})
        prom.wait_for('up{job="worker"} == 1')
        client = PrometheusConnect(url=prom.url, disable_ssl=True)
        result = prom.wait_for('vllm:num_requests_waiting{role="prefill"}')
        assert result[0]["metric"]["model_name"] == "tiny"
        values = client.custom_query('vllm:num_requests_waiting{role="prefill"}')
        assert [float(v["value"][1]) for v in values] == [7.0]

        waiting.labels(model_name="tiny", role="prefill").set(3)
        prom.wait_for('vllm:num_requests_waiting{role="prefill"} == 3')
        assert float(client.custom_query("vllm:num_requests_waiting")[0]["value"][1]) == 3.0
    finally:
        server.shutdown()


def test_prometheus_stops_by_pid_and_restarts_on_same_port(prometheus_factory):
    prom = prometheus_factory()
    pid, port = prom.proc.pid, prom.port
    prom.stop()
    assert not pid_alive(pid)
    try:
        httpx.get(f"{prom.url}/-/ready", timeout=1.0)
        raise AssertionError("Prometheus still answers after stop")
    except httpx.HTTPError:
        pass
    prom.restart()
    assert prom.port == port and prom.proc.pid != pid
    assert httpx.get(f"{prom.url}/-/ready", timeout=2.0).status_code == 200


class _Hook(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Hook.received.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_alertmanager_posts_alerts_to_webhook(alertmanager_factory):
    _Hook.received = []
    port = free_port()
    hook = HTTPServer(("127.0.0.1", port), _Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    try:
        am = alertmanager_factory(webhook_urls=[f"http://127.0.0.1:{port}/alerts"])
        alert = {
            "labels": {"alertname": "PdfleetHigh5xxRatio", "pdfleet_deployment": "demo", "namespace": "default"},
            "annotations": {"summary": "test"},
        }
        assert httpx.post(f"{am.url}/api/v2/alerts", json=[alert], timeout=5).status_code == 200
        deadline = time.monotonic() + 15
        while not _Hook.received and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _Hook.received, f"no webhook call; alertmanager log:\n{am.log()}"
        payload = _Hook.received[0]
        assert payload["version"] == "4" and payload["status"] == "firing"
        assert payload["alerts"][0]["labels"]["pdfleet_deployment"] == "demo"
    finally:
        hook.shutdown()
