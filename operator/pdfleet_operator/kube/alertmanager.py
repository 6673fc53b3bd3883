"""The operator's Alertmanager webhook receiver: validate payloads, turn pdfleet alerts into rollback triggers.

Alertmanager posts (webhook payload version 4) to `POST /alerts`. A payload that is not valid JSON,
not the documented shape, or that carries no pdfleet rollback alert is answered 400 and changes
nothing; a valid one becomes `RollbackTrigger`s that the operator feeds to the same analysis its
Prometheus timer runs (`rollback.health_from_alert` then `rollback.analyze`).

With a token (`--alertmanager-token-file`), every `POST /alerts` must carry `Authorization: Bearer
TOKEN` (Alertmanager's `http_config.authorization`), else 401 and nothing changes. An alert's
startsAt is taken as no earlier than ALERT_CREDIT_S before it arrived, and no later than its arrival:
a forged or replayed alert cannot claim a longer failure than a fresh one could.
"""

from __future__ import annotations

import datetime as dt
import hmac
import json
import time
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

import pydantic
from aiohttp import web

from pdfleet_operator.api.meta import DNS_LABEL_PATTERN
from pdfleet_operator.gen import alerts

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
    starts_at: float   # unix seconds: when the alert went from pending to firing
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
            raise PayloadError(f"alert {alerts.ROLLBACK_ALERT} must carry namespace and pdfleet_deployment labels "
                               f"naming a deployment, got {namespace!r}/{deployment!r}")
        starts_at = alert.starts_at.timestamp()
        if received_at is not None:
            starts_at = min(max(starts_at, received_at - ALERT_CREDIT_S), received_at)
        triggers.append(RollbackTrigger(namespace, deployment, alert.status == "firing", starts_at, alert.fingerprint))
    if not triggers:
        raise PayloadError(f"no pdfleet rollback alert in the payload (got {', '.join(sorted(set(unknown)))}); "
                           f"route only {alerts.ROLLBACK_ALERT} to this receiver")
    return triggers


def _is_label(text: str) -> bool:
    return bool(text) and len(text) <= 63 and re.fullmatch(DNS_LABEL_PATTERN, text) is not None


Handler = Callable[[RollbackTrigger], Awaitable[None]]


def make_app(on_trigger: Handler, token: str | None = None) -> web.Application:
    """An aiohttp app serving `POST /alerts` (and `GET /healthz`); each trigger is awaited in order.
    With `token`, `/alerts` answers 401 unless the request carries `Authorization: Bearer <token>`."""
    expected = f"Bearer {token}".encode() if token else None

    async def receive(request: web.Request) -> web.Response:
        if expected is not None and not hmac.compare_digest(request.headers.get("Authorization", "").encode(), expected):
            log.warning("rejected an Alertmanager payload without the bearer token from %s", request.remote)
            return web.json_response({"error": "missing or wrong bearer token"}, status=401,
                                     headers={"WWW-Authenticate": "Bearer"})
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            return web.json_response({"error": f"body larger than {MAX_BODY_BYTES} bytes"}, status=413)
        body = await request.content.read(MAX_BODY_BYTES + 1)
        if len(body) > MAX_BODY_BYTES:
            return web.json_response({"error": f"body larger than {MAX_BODY_BYTES} bytes"}, status=413)
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
