"""The operator's Alertmanager receiver: payload validation, and the whole chain from real Prometheus + Alertmanager."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest

from pdfleet_operator.gen import alerts
from pdfleet_operator.kube import alertmanager
from tests.support.components import free_port

GOOD = {
    "version": "4",
    "status": "firing",
    "receiver": "pdfleet",
    "groupKey": '{}:{alertname="PdfleetHigh5xxRatio"}',
    "commonLabels": {},
    "externalURL": "http://am",
    "alerts": [
        {
            "status": "firing",
            "labels": {
                "alertname": "PdfleetHigh5xxRatio",
                "pdfleet_alert": "rollback",
                "severity": "critical",
                "namespace": "prod",
                "pdfleet_deployment": "chat",
            },
            "annotations": {"summary": "x"},
            "startsAt": "2026-11-30T10:00:00Z",
            "endsAt": "0001-01-01T00:00:00Z",
            "fingerprint": "abc123",
            "generatorURL": "http://prom",
        }
    ],
}


def _with(**changes):
    payload = json.loads(json.dumps(GOOD))
    for path, value in changes.items():
        node = payload
        *head, leaf = path.split("__")
        for key in head:
            node = node[int(key)] if key.isdigit() else node[key]
        if value is _DELETE:
            del node[leaf]
        else:
            node[leaf] = value
    return json.dumps(payload).encode()


_DELETE = object()


def test_parse_good_payload():
    [trigger] = alertmanager.parse(json.dumps(GOOD).encode())
    assert trigger == alertmanager.RollbackTrigger("prod", "chat", True, 1796032800.0, "abc123")


@pytest.mark.parametrize(
    "body,words",
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "Alertmanager v4"),
        (_with(version="3"), "version"),
        (_with(alerts=[]), "alerts"),
        (_with(alerts__0__startsAt="yesterday"), "startsAt"),
        (_with(alerts__0__status="maybe"), "status"),
        (_with(alerts__0__labels__alertname="DiskFull"), "no pdfleet rollback alert"),
        (_with(alerts__0__labels__pdfleet_alert=_DELETE), "no pdfleet rollback alert"),
        (_with(alerts__0__labels__pdfleet_deployment=_DELETE), "pdfleet_deployment"),
        (_with(alerts__0__labels__namespace="Not A Namespace"), "namespace"),
    ],
)
def test_malformed_or_unknown_payloads_are_rejected(body, words):
    with pytest.raises(alertmanager.PayloadError, match=words):
        alertmanager.parse(body)


class _Served:
    """An aiohttp app served on a free loopback port from a background thread (its own event loop)."""

    def __init__(self, app: web.Application, what: str) -> None:
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.app = app
        threading.Thread(target=self._run, daemon=True).start()
        assert self.ready.wait(10), f"{what} did not start"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(self.app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self.ready.set()
        self.loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/alerts"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


class _Receiver(_Served):
    """The receiver app, recording what it was handed."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.triggers: list[tuple[float, alertmanager.RollbackTrigger]] = []
        super().__init__(alertmanager.make_app(self._record, token), "receiver")

    async def _record(self, trigger):
        self.triggers.append((time.monotonic(), trigger))


@pytest.fixture
def receiver():
    r = _Receiver()
    yield r
    r.close()


def test_receiver_answers_400_and_records_nothing_for_bad_payloads(receiver):
    for body in (b"{", _with(alerts__0__labels__alertname="DiskFull"), _with(version="3")):
        resp = httpx.post(receiver.url, content=body, headers={"Content-Type": "application/json"}, timeout=5)
        assert resp.status_code == 400 and resp.json()["error"]
    huge = b"[" + b"0," * (alertmanager.MAX_BODY_BYTES // 2) + b"0]"
    assert httpx.post(receiver.url, content=huge, timeout=10).status_code == 413
    assert receiver.triggers == []
    resp = httpx.post(receiver.url, content=json.dumps(GOOD), timeout=5)
    assert resp.status_code == 200 and resp.json() == {"accepted": 1}
    assert [t.deployment for _, t in receiver.triggers] == ["chat"]


class _Router:
    """A stand-in router exporting pdfleet_router_requests_total; the test flips it to 5xx."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdfleet_router_requests", "Requests through the router", ["code", "tier"], registry=self.registry
        )
        self.failing = False
        registry = self.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = HTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.stop = threading.Event()
        threading.Thread(target=self._traffic, daemon=True).start()

    def _traffic(self) -> None:
        while not self.stop.wait(0.05):
            self.requests.labels(code="503" if self.failing else "200", tier="default").inc(5)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()


def test_real_alert_reaches_receiver_after_for(prometheus_factory, alertmanager_factory, receiver, tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        alerts.render_rule_file(alerts.RollbackRule(threshold=0.01, window="4s", for_="3s", min_requests=5))
    )
    router = _Router()
    try:
        am = alertmanager_factory(webhook_urls=[receiver.url])
        prom = prometheus_factory(
            rule_files=[rules],
            alertmanagers=[am.address],
            extra_scrape_configs=[
                {
                    "job_name": "router",
                    "static_configs": [
                        {"targets": [router.target], "labels": {"namespace": "prod", "pdfleet_deployment": "chat"}}
                    ],
                }
            ],
        )
        prom.wait_for('pdfleet_router_requests_total{code="200",pdfleet_deployment="chat"}')
        time.sleep(5)  # a healthy window first: nothing fires
        assert receiver.triggers == []

        router.failing = True
        began = time.monotonic()
        deadline = began + 40
        while not receiver.triggers and time.monotonic() < deadline:
            time.sleep(0.2)
        assert receiver.triggers, f"no alert reached the receiver; prometheus log:\n{prom.log()}\nam log:\n{am.log()}"
        at, trigger = receiver.triggers[0]
        assert (trigger.namespace, trigger.deployment, trigger.firing) == ("prod", "chat", True)
        delay = at - began
        # The ratio crosses 1% at the next scrape (1 s), then pends for `for` (3 s), is evaluated (1 s
        # interval) and grouped (group_wait 1 s): the alert cannot arrive before `for`.
        # NOTE: no upper bound but the 40 s deadline above: how soon after `for` it arrives is the machine's speed.
        print(f"\nalert reached the receiver {delay:.2f}s after the 5xx burst began (for: 3s)")
        assert delay >= 3.0, delay
    finally:
        router.close()


TOKEN = "s3cret-token-from-a-secret"


@pytest.fixture
def guarded():
    r = _Receiver(token=TOKEN)
    yield r
    r.close()


def test_with_a_token_unauthenticated_or_wrong_alerts_are_401_and_change_nothing(guarded):
    body = json.dumps(GOOD)
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": TOKEN},
        {"Authorization": f"Basic {TOKEN}"},
    ):
        resp = httpx.post(guarded.url, content=body, headers=headers, timeout=5)
        assert resp.status_code == 401 and resp.headers["WWW-Authenticate"] == "Bearer", headers
    assert guarded.triggers == []
    assert httpx.get(guarded.url.replace("/alerts", "/healthz"), timeout=5).status_code == 200  # probes need no token
    resp = httpx.post(guarded.url, content=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    assert resp.status_code == 200 and [t.deployment for _, t in guarded.triggers] == ["chat"]


def test_a_forged_starts_at_cannot_claim_more_than_a_fresh_alert():
    now = 1_800_000_000.0
    back_dated = _with(alerts__0__startsAt="2001-01-01T00:00:00Z")
    (t,) = alertmanager.parse(back_dated, received_at=now)
    assert t.starts_at == now - alertmanager.ALERT_CREDIT_S
    future = _with(alerts__0__startsAt="2100-01-01T00:00:00Z")
    (t,) = alertmanager.parse(future, received_at=now)
    assert t.starts_at == now
    honest = dt.datetime.fromtimestamp(now - 20, dt.timezone.utc).isoformat().replace("+00:00", "Z")
    (t,) = alertmanager.parse(_with(alerts__0__startsAt=honest), received_at=now)
    assert t.starts_at == now - 20


def test_real_alertmanager_with_the_bearer_token_is_accepted(
    prometheus_factory, alertmanager_factory, guarded, tmp_path
):
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        alerts.render_rule_file(alerts.RollbackRule(threshold=0.01, window="4s", for_="2s", min_requests=5))
    )
    router = _Router()
    try:
        am = alertmanager_factory(webhook_urls=[guarded.url], bearer_token=TOKEN)
        prom = prometheus_factory(
            rule_files=[rules],
            alertmanagers=[am.address],
            extra_scrape_configs=[
                {
                    "job_name": "router",
                    "static_configs": [
                        {"targets": [router.target], "labels": {"namespace": "prod", "pdfleet_deployment": "chat"}}
                    ],
                }
            ],
        )
        prom.wait_for('pdfleet_router_requests_total{code="200",pdfleet_deployment="chat"}')
        router.failing = True
        deadline = time.monotonic() + 40
        while not guarded.triggers and time.monotonic() < deadline:
            time.sleep(0.2)
        assert guarded.triggers, f"no alert reached the guarded receiver; am log:\n{am.log()}"
        assert guarded.triggers[0][1].deployment == "chat"
    finally:
        router.close()


class _Relay(_Served):
    """A standby's relay app; `published` is what the Lease names (None: no leader)."""

    def __init__(self, published: str | None, token: str | None = TOKEN) -> None:
        self.published = published
        super().__init__(
            alertmanager.make_relay_app(lambda: self.published, token, retry_after=2.0, timeout=10.0), "relay"
        )


def _relayed(outcome: str) -> float:
    from pdfleet_operator.kube import exporter

    return exporter.ALERTS_RELAYED.labels(outcome)._value.get()


def test_a_standby_relays_authenticated_alerts_to_the_published_leader_and_refuses_the_rest(guarded):
    relay = _Relay(f"http://127.0.0.1:{guarded.port}")
    try:
        body = json.dumps(GOOD)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            resp = httpx.post(relay.url, content=body, headers=headers, timeout=5)
            assert resp.status_code == 401 and resp.headers["WWW-Authenticate"] == "Bearer", headers
        assert guarded.triggers == []  # nothing reached the leader
        auth = {"Authorization": f"Bearer {TOKEN}"}
        relayed = _relayed("relayed")
        resp = httpx.post(relay.url, content=body, headers=auth, timeout=10)
        assert resp.status_code == 200 and resp.json() == {"accepted": 1}  # the leader's own answer
        assert [t.deployment for _, t in guarded.triggers] == ["chat"] and _relayed("relayed") == relayed + 1
        resp = httpx.post(relay.url, content=_with(version="3"), headers=auth, timeout=10)
        assert resp.status_code == 400 and "version" in resp.json()["error"]  # the leader's 400, passed back
        assert len(guarded.triggers) == 1
        # a URL from the request is never followed: the Host header and the query change nothing
        resp = httpx.post(
            relay.url + "?to=http://127.0.0.1:1", content=body, headers={**auth, "Host": "evil:1"}, timeout=10
        )
        assert resp.status_code == 200 and len(guarded.triggers) == 2
        # a post that a standby relayed already is not relayed again (a URL that leads to a standby cannot loop)
        resp = httpx.post(relay.url, content=body, headers={**auth, alertmanager.RELAYED_HEADER: "standby"}, timeout=5)
        assert resp.status_code == 503 and len(guarded.triggers) == 2
    finally:
        relay.close()


def test_a_standby_without_a_reachable_leader_answers_503_with_retry_after(guarded, caplog):
    dead = free_port()  # nothing listens there: the leader died with the Lease still unexpired
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for published, outcome, words in (
        (None, "no_leader", "no leader is known"),
        (f"http://127.0.0.1:{dead}", "unreachable", "cannot be reached"),
        (f"http://127.0.0.1:{guarded.port}/elsewhere", "no_leader", "malformed"),
        (f"https://127.0.0.1:{guarded.port}", "no_leader", "malformed"),
    ):
        relay = _Relay(published)
        try:
            before = _relayed(outcome)
            with caplog.at_level("WARNING", logger=alertmanager.log.name):
                resp = httpx.post(relay.url, content=json.dumps(GOOD), headers=auth, timeout=10)
            assert resp.status_code == 503 and resp.headers["Retry-After"] == "2", published
            assert words in resp.json()["error"] and _relayed(outcome) == before + 1
            assert any("not relayed" in r.getMessage() and words in r.getMessage() for r in caplog.records), published
        finally:
            relay.close()
    # no token configured: the standby relays nothing at all (never an unauthenticated relay)
    relay = _Relay(f"http://127.0.0.1:{guarded.port}", token=None)
    try:
        resp = httpx.post(relay.url, content=json.dumps(GOOD), headers=auth, timeout=10)
        assert resp.status_code == 503 and "only authenticated" in resp.json()["error"]
    finally:
        relay.close()
    assert guarded.triggers == []
