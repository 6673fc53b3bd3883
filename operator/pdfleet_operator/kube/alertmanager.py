"""The operator's Alertmanager webhook receiver: validate payloads, turn pdfleet alerts into rollback triggers.

Alertmanager posts (webhook payload version 4) to `POST /alerts`. A payload that is not valid JSON,
not the documented shape, or that carries no pdfleet rollback alert is answered 400 and changes
nothing; a valid one becomes `RollbackTrigger`s that the operator feeds to the same analysis its
Prometheus timer runs (`rollback.health_from_alert` then `rollback.analyze`).

With a token (`--alertmanager-token-file`), every `POST /alerts` must carry `Authorization: Bearer
TOKEN` (Alertmanager's `http_config.authorization`), else 401 and nothing changes. `pdfleet operator` refuses to
serve the receiver without one (`check_receiver`) unless told `--alertmanager-unauthenticated`: anyone who reaches
an open receiver makes the operator act on alerts it forged. The chart always makes or mounts a token. An alert's
startsAt is taken as no earlier than ALERT_CREDIT_S before it arrived, and no later than its arrival:
a forged or replayed alert cannot claim a longer failure than a fresh one could.

The receiver runs on the leader only. A standby serves `make_relay_app` on the same port: it checks the
bearer token itself, as the receiver does (401 otherwise: it relays nothing unauthenticated, and with no
token configured it relays nothing at all), then posts the body and the Authorization header to the URL
the leader published in the Lease it holds (`leader.ALERTMANAGER_URL_ANNOTATION`, never a URL from the
request; redirects are not followed) and answers with the leader's status and body; 503 with Retry-After
when no leader is known or it cannot be reached, so that Alertmanager retries.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hmac
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

import aiohttp
import pydantic
from aiohttp import web
from yarl import URL as yarl_url

from pdfleet_operator.api.meta import DNS_LABEL_PATTERN
from pdfleet_operator.gen import alerts
from pdfleet_operator.kube import exporter

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20  # Alertmanager batches; a megabyte is thousands of alerts
# How far before its arrival an alert's startsAt is believed. Alertmanager posts a new alert after
# group_wait (seconds) and re-posts it every repeat_interval keeping the first startsAt; five minutes
# covers a fresh alert's delays with room, and caps what a back-dated startsAt can claim.
ALERT_CREDIT_S = 300.0


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="ignore", populate_by_name=True)


class Alert(_Strict):
    """One alert of the payload (the fields pdfleet reads; others are ignored)."""

    status: Literal["firing", "resolved"]
    labels: dict[str, str]
    annotations: dict[str, str] = {}
    starts_at: dt.datetime = pydantic.Field(alias="startsAt")
    ends_at: dt.datetime | None = pydantic.Field(None, alias="endsAt")
    fingerprint: str = ""


class WebhookPayload(_Strict):
    """Alertmanager's webhook body, version 4."""

    version: Literal["4"]
    status: Literal["firing", "resolved"]
    receiver: str = ""
    group_key: str = pydantic.Field(alias="groupKey")
    alerts: list[Alert] = pydantic.Field(min_length=1)


@dataclass(frozen=True)
class RollbackTrigger:
    """A pdfleet rollback alert about one deployment."""

    namespace: str
    deployment: str
    firing: bool
    starts_at: float  # unix seconds: when the alert went from pending to firing
    fingerprint: str


class PayloadError(ValueError):
    """The payload is malformed or not a pdfleet rollback alert (the receiver answers 400)."""


def parse(body: bytes, received_at: float | None = None) -> list[RollbackTrigger]:
    """Rollback triggers in a webhook body; PayloadError when it is malformed or carries none.

    `received_at` (unix seconds) bounds each startsAt to [received_at - ALERT_CREDIT_S, received_at].
    """
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PayloadError(f"body is not JSON: {exc}") from exc
    try:
        payload = WebhookPayload.model_validate(data)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise PayloadError(f"not an Alertmanager v4 payload: {where}: {first['msg']}") from exc

    triggers, unknown = [], []
    for alert in payload.alerts:
        labels = alert.labels
        if labels.get("alertname") != alerts.ROLLBACK_ALERT or labels.get("pdfleet_alert") != "rollback":
            unknown.append(labels.get("alertname", "<no alertname>"))
            continue
        namespace, deployment = labels.get("namespace", ""), labels.get("pdfleet_deployment", "")
        if not (_is_label(namespace) and _is_label(deployment)):
            raise PayloadError(
                f"alert {alerts.ROLLBACK_ALERT} must carry namespace and pdfleet_deployment labels "
                f"naming a deployment, got {namespace!r}/{deployment!r}"
            )
        starts_at = alert.starts_at.timestamp()
        if received_at is not None:
            starts_at = min(max(starts_at, received_at - ALERT_CREDIT_S), received_at)
        triggers.append(RollbackTrigger(namespace, deployment, alert.status == "firing", starts_at, alert.fingerprint))
    if not triggers:
        raise PayloadError(
            f"no pdfleet rollback alert in the payload (got {', '.join(sorted(set(unknown)))}); "
            f"route only {alerts.ROLLBACK_ALERT} to this receiver"
        )
    return triggers


def check_receiver(port: int | None, token_file: str | None, unauthenticated: bool) -> None:
    """ValueError when the receiver would serve without a bearer token and nobody asked for that explicitly."""
    if port and not token_file and not unauthenticated:
        raise ValueError(
            f"--alertmanager-port {port} without --alertmanager-token-file: the receiver would act on "
            f"alerts from anyone who reaches it; give it a token file (the chart mounts one), or pass "
            f"--alertmanager-unauthenticated to accept that"
        )
    if token_file and unauthenticated:
        raise ValueError("--alertmanager-token-file and --alertmanager-unauthenticated contradict each other")


def _is_label(text: str) -> bool:
    return bool(text) and len(text) <= 63 and re.fullmatch(DNS_LABEL_PATTERN, text) is not None


Handler = Callable[[RollbackTrigger], Awaitable[None]]
RELAY_TIMEOUT_S = 30.0  # an analysis on the leader awaits Prometheus; Alertmanager's own webhook timeout is longer
RELAYED_HEADER = "X-Pdfleet-Relayed-By"  # set on relayed posts: a standby never relays a relayed post again
_SESSION = web.AppKey("session", aiohttp.ClientSession)


def _expected(token: str | None) -> bytes | None:
    return f"Bearer {token}".encode() if token else None


def _refuse_unauthorized(request: web.Request, expected: bytes | None) -> web.Response | None:
    """401 unless the request carries `Authorization: Bearer <token>` (None: it does, or no token is configured)."""
    if expected is not None and not hmac.compare_digest(request.headers.get("Authorization", "").encode(), expected):
        log.warning("rejected an Alertmanager payload without the bearer token from %s", request.remote)
        return web.json_response(
            {"error": "missing or wrong bearer token"}, status=401, headers={"WWW-Authenticate": "Bearer"}
        )
    return None


async def _read_body(request: web.Request) -> bytes | web.Response:
    """The body, or 413 when it is larger than MAX_BODY_BYTES."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        return web.json_response({"error": f"body larger than {MAX_BODY_BYTES} bytes"}, status=413)
    body = await request.content.read(MAX_BODY_BYTES + 1)
    if len(body) > MAX_BODY_BYTES:
        return web.json_response({"error": f"body larger than {MAX_BODY_BYTES} bytes"}, status=413)
    return body


def relay_target(url: str | None) -> str | None:
    """`<url>/alerts` for a published receiver URL of the form http://HOST:PORT (nothing else: no path, query, user
    info or other scheme), else None."""
    if not url:
        return None
    try:
        parsed = yarl_url(url)
    except ValueError:
        return None
    if (
        parsed.scheme != "http"
        or not parsed.host
        or parsed.explicit_port is None
        or parsed.user
        or parsed.password
        or parsed.path not in ("", "/")
        or parsed.query_string
        or parsed.fragment
    ):
        return None
    return f"http://{parsed.raw_authority}/alerts"


def make_relay_app(
    leader_url: Callable[[], str | None], token: str | None, retry_after: float = 2.0, timeout: float = RELAY_TIMEOUT_S
) -> web.Application:
    """A standby's `POST /alerts` (and `GET /healthz`): the same bearer-token check as `make_app`, then the body and
    Authorization header posted to `leader_url()` + /alerts, answering with the leader's status and body; 503 with
    Retry-After when no leader is known, its URL is malformed, or it cannot be reached. Without `token` nothing is
    relayed (503): a standby is never an unauthenticated relay."""
    expected = _expected(token)
    wait = {"Retry-After": str(max(1, math.ceil(retry_after)))}

    def unavailable(why: str, outcome: str) -> web.Response:
        exporter.ALERTS_RELAYED.labels(outcome).inc()
        log.warning("standby: Alertmanager payload not relayed (503, Alertmanager retries): %s", why)
        return web.json_response({"error": f"this replica is a standby and {why}; retry"}, status=503, headers=wait)

    async def relay(request: web.Request) -> web.Response:
        if expected is None:
            return unavailable("relays only authenticated alerts, but no --alertmanager-token-file is set", "no_token")
        refused = _refuse_unauthorized(request, expected)
        if refused is not None:
            exporter.ALERTS_RELAYED.labels("unauthorized").inc()
            return refused
        if RELAYED_HEADER in request.headers:
            return unavailable("the leader's published URL leads to a standby", "loop")
        body = await _read_body(request)
        if isinstance(body, web.Response):
            return body
        published = leader_url()
        target = relay_target(published)
        if target is None:
            return unavailable(
                "no leader is known"
                if published is None
                else f"the leader published a malformed receiver URL {published!r}",
                "no_leader",
            )
        headers = {
            "Authorization": request.headers["Authorization"],
            RELAYED_HEADER: "standby",
            "Content-Type": request.headers.get("Content-Type", "application/json"),
        }
        try:
            async with request.app[_SESSION].post(target, data=body, headers=headers, allow_redirects=False) as resp:
                answer = await resp.read()
                status, content_type = resp.status, resp.headers.get("Content-Type", "application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return unavailable(f"the leader at {target} cannot be reached ({type(exc).__name__}: {exc})", "unreachable")
        exporter.ALERTS_RELAYED.labels("relayed").inc()
        log.info("standby: relayed an Alertmanager payload to the leader at %s: %d", target, status)
        return web.Response(status=status, body=answer, headers={"Content-Type": content_type})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def open_session(app: web.Application) -> None:
        app[_SESSION] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout))

    async def close_session(app: web.Application) -> None:
        await app[_SESSION].close()

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/alerts", relay)
    app.router.add_get("/healthz", healthz)
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    return app


def make_app(on_trigger: Handler, token: str | None = None) -> web.Application:
    """An aiohttp app serving `POST /alerts` (and `GET /healthz`); each trigger is awaited in order.
    With `token`, `/alerts` answers 401 unless the request carries `Authorization: Bearer <token>`."""
    expected = _expected(token)

    async def receive(request: web.Request) -> web.Response:
        refused = _refuse_unauthorized(request, expected)
        if refused is not None:
            return refused
        body = await _read_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            triggers = parse(body, received_at=time.time())
        except PayloadError as exc:
            log.warning("rejected Alertmanager payload: %s", exc)
            return web.json_response({"error": str(exc)}, status=400)
        for trigger in triggers:
            await on_trigger(trigger)
        return web.json_response({"accepted": len(triggers)})

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/alerts", receive)
    app.router.add_get("/healthz", healthz)
    return app
