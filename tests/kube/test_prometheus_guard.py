"""A CR's prometheusUrl is read only when the admin allows it: otherwise held, said in status, and never fetched."""

from __future__ import annotations

import asyncio
import http.server
import threading

import pytest
import yaml

from pdfleet_operator.api import InferenceDeployment
from pdfleet_operator.decide import guardrails
from pdfleet_operator.kube import revisions, scaling
from pdfleet_operator.kube.options import OPTIONS


def test_only_the_operators_own_and_the_allowed_prefixes_are_read() -> None:
    allowed = ("http://prometheus.monitoring.svc:9090", "http://127.0.0.1")
    ok = guardrails.prometheus_url_problem
    assert ok("http://mine:9090", "http://mine:9090/", ()) is None
    assert ok("http://prometheus.monitoring.svc:9090/", None, allowed) is None
    assert ok("http://prometheus.monitoring.svc:9090/prom", None, allowed) is None
    assert ok("http://127.0.0.1:41234", None, allowed) is None
    for attack in (
        "http://169.254.169.254/latest/meta-data",
        "http://prometheus.monitoring.svc:90901",
        "http://prometheus.monitoring.svc:9090.evil.com",
        "http://127.0.0.1.evil.com:80",
        "http://kubernetes.default.svc",
    ):
        why = ok(attack, "http://mine:9090", allowed)
        assert why and why.startswith("spec.autoscaling.prometheusUrl: ") and "not fetched" in why, attack


def test_urls_are_compared_parsed_and_user_info_is_refused() -> None:
    """HEAD matched strings: with http://prometheus.monitoring allowed, ...:9090@evil.example/api passed, and the
    operator fetched it from evil.example (user info `prometheus.monitoring:9090`)."""
    ok = guardrails.prometheus_url_problem
    allowed = ("http://prometheus.monitoring", "https://thanos.monitoring.svc:10902/prom")
    for attack in (
        "http://prometheus.monitoring:9090@evil.example/api",
        "http://prometheus.monitoring@evil.example",
        "http://user:pw@prometheus.monitoring:9090",
        "http://prometheus.monitoring\\@evil.example",
        "http://prometheus.monitoring.evil.example",
        "https://prometheus.monitoring",
        "https://thanos.monitoring.svc:10902/prometheus",
        "https://thanos.monitoring.svc:10902/prom/../x",
        "https://thanos.monitoring.svc:10902/prom/%2e%2e/admin",
        "https://thanos.monitoring.svc:10902/prom%2fx",
        "https://thanos.monitoring.svc/prom",
        "http://prometheus.monitoring/api?x=http://evil",
        "http://prometheus.monitoring#@evil.example",
        "ftp://prometheus.monitoring",
        "http://",
    ):
        why = ok(attack, None, allowed)
        assert why and "not fetched" in why, attack
    assert "user info" in ok("http://prometheus.monitoring:9090@evil.example/api", None, allowed)
    for fine in (
        "http://prometheus.monitoring",
        "http://prometheus.monitoring:9090/",
        "http://PROMETHEUS.monitoring/x",
        "https://thanos.monitoring.svc:10902/prom",
        "https://thanos.monitoring.svc:10902/prom/v1",
    ):
        assert ok(fine, None, allowed) is None, fine
    assert ok("http://mine", "http://mine:80/", ()) is None, "the default port is the same port"
    with pytest.raises(ValueError, match="user info"):
        guardrails.check_url_prefix("http://a@b")


@pytest.fixture
def recorder():
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            hits.append(self.path)
            self.send_response(500)
            self.end_headers()

        def log_message(self, *_):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", hits
    server.shutdown()


def test_a_url_the_admin_did_not_allow_is_never_fetched_and_holds_with_the_reason(recorder, monkeypatch) -> None:
    url, hits = recorder
    doc = yaml.safe_load(open("examples/qwen2-7b.yaml"))
    doc["metadata"].update(namespace="team-a", generation=1)
    doc["spec"]["autoscaling"] = {"prometheusUrl": url}
    dep = InferenceDeployment.model_validate(doc)
    monkeypatch.setattr(OPTIONS, "prometheus_allowed", ())
    snap = asyncio.run(scaling.snapshot(dep, "http://the-operators-own:9090", "pdfleet"))
    assert not snap.ok and snap.error.startswith("spec.autoscaling.prometheusUrl: " + url)
    sample = asyncio.run(revisions.sample(dep, "http://the-operators-own:9090", "pdfleet"))
    assert sample.requests is None and "not fetched" in sample.error
    assert hits == []
    # Allowed, it is read (this one answers 500: unavailable, but fetched).
    monkeypatch.setattr(OPTIONS, "prometheus_allowed", (url,))
    snap = asyncio.run(scaling.snapshot(dep, None, "pdfleet"))
    assert not snap.ok and hits


def test_https_prometheus_is_verified_by_default_and_trusts_the_given_ca(tmp_path) -> None:
    import ssl
    import subprocess

    from pdfleet_operator import prometheus
    from tests.support.components import binary

    openssl = binary("openssl")  # Debian's openssl makes the test certificate; missing: skipped here, failed in CI
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = b'{"status":"success","data":{"resultType":"vector","result":[]}}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"https://127.0.0.1:{server.server_address[1]}"
    try:
        strict = prometheus.PrometheusSource(url).snapshot("d", "ns", ["colocated"])
        assert not strict.ok and "CERTIFICATE_VERIFY_FAILED" in strict.error.upper().replace(" ", "_")
        trusted = prometheus.PrometheusSource(url, verify=str(cert)).snapshot("d", "ns", ["colocated"])
        assert "CERTIFICATE" not in (trusted.error or "").upper()  # reached it (no series: unavailable for that)
    finally:
        server.shutdown()
