"""Leader election on a coordination.k8s.io/v1 Lease, with client-go's semantics, so several replicas of
`pdfleet operator` never act at once.

A replica that does not hold the Lease is a standby: it runs no kopf, watches nothing and writes nothing
but its attempts on the Lease; it serves /healthz (so the kubelet keeps it) and /metrics
(`pdfleet_operator_leader 0`). The holder renews every `retry_period`; a standby takes the Lease once it
has seen the same record unchanged for `lease_duration` (time measured on its own clock from when it
observed the record, as client-go does, so clock skew between nodes does not matter), or at once when
the holder released it. A holder that could not renew for `renew_deadline` (< `lease_duration`) exits
the process at once: it stops acting before any standby may start. A holder that stops (SIGTERM)
releases the Lease on its way out, so a rolling update hands over within one retry period.

The holder publishes where its Alertmanager receiver listens in the Lease's annotation
`pdfleet.io/alertmanager-url` (`http://<POD_IP>:<--alertmanager-port>`, written when it acquires and on each
renewal, removed on release, absent when the receiver is off or the pod IP unknown). A standby listens on the same
port and relays authenticated alerts to that URL only while the Lease it last read is unexpired on its own clock
(`alertmanager.make_relay_app`), so an alert the Service sends to a standby reaches the leader.

NOTE: why not kopf's peering: replicas of one Deployment have the same priority, and kopf freezes all
operators of equal priority ("the cluster becomes not served"); peering also pauses only kopf's resource
watches, not the operator's own loops (resync, autoscaler, AcceleratorClass status).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from pdfleet_operator.kube import alertmanager, client, exporter

logger = logging.getLogger("pdfleet.leader")
LEASES = "/apis/coordination.k8s.io/v1"
ALERTMANAGER_URL_ANNOTATION = "pdfleet.io/alertmanager-url"
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


@dataclasses.dataclass(frozen=True)
class LeaseConfig:
    namespace: str
    name: str
    identity: str
    lease_duration: float = 15.0  # a standby takes over after seeing the record unchanged this long
    renew_deadline: float = 10.0  # the holder gives up (exits) when it could not renew for this long
    retry_period: float = 2.0  # between attempts, holder and standby
    alertmanager_url: str | None = None  # published in the Lease while holding it (None: the annotation is removed)

    def __post_init__(self) -> None:
        if not self.namespace:
            raise ValueError("leader election: the Lease's namespace is empty (--leader-election-namespace)")
        if not self.name:
            raise ValueError("leader election: the Lease's name is empty (--leader-election-name)")
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(
                f"leader election: need 0 < --leader-election-retry-period ({self.retry_period}) < "
                f"--leader-election-renew-deadline ({self.renew_deadline}) < "
                f"--leader-election-lease-duration ({self.lease_duration})"
            )


def default_identity() -> str:
    """The pod's name (the chart passes POD_NAME) or the host name, plus a random suffix as client-go adds."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def default_namespace() -> str | None:
    """The pod's own namespace (POD_NAMESPACE, or the mounted service account's)."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def receiver_url(pod_ip: str | None, port: int | None) -> str | None:
    """The URL a leader publishes for its Alertmanager receiver: None when the receiver is off or the pod IP unknown."""
    if not port or not pod_ip:
        return None
    return f"http://[{pod_ip}]:{port}" if ":" in pod_ip else f"http://{pod_ip}:{port}"


def _annotate(metadata: dict[str, Any], url: str | None) -> None:
    """Set (url) or remove (None) the receiver's URL in a Lease's metadata."""
    annotations = dict(metadata.get("annotations") or {})
    if url:
        annotations[ALERTMANAGER_URL_ANNOTATION] = url
    else:
        annotations.pop(ALERTMANAGER_URL_ANNOTATION, None)
    metadata["annotations"] = annotations


def _micro_time(t: float) -> str:
    """A Kubernetes MicroTime (RFC 3339 with microseconds)."""
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Acquires and renews one Lease; `holding` tells whether this replica is the leader now."""

    def __init__(self, api: client.Api, config: LeaseConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.api, self.config, self.clock = api, config, clock
        self.holding = False
        self._observed: tuple[Any, ...] | None = None  # (holder, renewTime, leaseDurationSeconds) last seen
        self._observed_at = 0.0
        # (holder, its published receiver URL, when the record was first seen, its duration): one tuple, replaced whole,
        # so the standby's relay (another thread) reads a consistent snapshot
        self._seen: tuple[str | None, str | None, float, float] = (None, None, 0.0, 0.0)
        self._last_renew = 0.0
        self.transitions = 0

    @property
    def _path(self) -> str:
        return f"{LEASES}/namespaces/{self.config.namespace}/leases"

    def _spec(self, previous: dict[str, Any] | None) -> dict[str, Any]:
        now = _micro_time(time.time())
        before = previous or {}
        ours = before.get("holderIdentity") == self.config.identity
        return {
            "holderIdentity": self.config.identity,
            "leaseDurationSeconds": max(1, round(self.config.lease_duration)),
            "acquireTime": before.get("acquireTime") if ours and before.get("acquireTime") else now,
            "renewTime": now,
            "leaseTransitions": int(before.get("leaseTransitions") or 0) + (0 if ours or previous is None else 1),
        }

    async def try_acquire_or_renew(self) -> bool:
        """One attempt (client-go's tryAcquireOrRenew): True when this replica holds the Lease afterwards."""
        try:
            lease = await self.api.request("GET", f"{self._path}/{self.config.name}")
        except client.ApiError as exc:
            if exc.code != 404:
                logger.warning(
                    "leader election: reading Lease %s/%s failed: %s", self.config.namespace, self.config.name, exc
                )
                return False
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.config.name, "namespace": self.config.namespace},
                "spec": self._spec(None),
            }
            _annotate(body["metadata"], self.config.alertmanager_url)
            try:
                await self.api.request("POST", self._path, body=body)
            except client.ApiError as exc2:
                if exc2.code != 409:  # 409: another replica created it first
                    logger.warning(
                        "leader election: creating Lease %s/%s failed: %s",
                        self.config.namespace,
                        self.config.name,
                        exc2,
                    )
                return False
            self._became(None)
            return True
        spec = lease.get("spec") or {}
        record = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("leaseDurationSeconds"))
        now = self.clock()
        if record != self._observed:
            self._observed, self._observed_at = record, now
        holder = spec.get("holderIdentity")
        duration = float(spec.get("leaseDurationSeconds") or self.config.lease_duration)
        url = ((lease.get("metadata") or {}).get("annotations") or {}).get(ALERTMANAGER_URL_ANNOTATION)
        self._seen = (holder, url if holder else None, self._observed_at, duration)
        if holder and holder != self.config.identity and now < self._observed_at + duration:
            self.holding = False
            return False  # held by another replica that renewed within its lease duration
        lease["spec"] = self._spec(spec)
        lease["metadata"] = dict(lease.get("metadata") or {})
        _annotate(lease["metadata"], self.config.alertmanager_url)
        try:  # PUT with the resourceVersion we read: a concurrent taker gets 409
            await self.api.request("PUT", f"{self._path}/{self.config.name}", body=lease)
        except client.ApiError as exc:
            if exc.code != 409:
                logger.warning(
                    "leader election: updating Lease %s/%s failed: %s", self.config.namespace, self.config.name, exc
                )
            return False
        self._became(holder)
        return True

    def _became(self, previous_holder: str | None) -> None:
        self._last_renew = self.clock()
        if not self.holding:
            self.transitions += 1
            logger.info(
                "leader election: %s holds Lease %s/%s now (previous holder: %s)",
                self.config.identity,
                self.config.namespace,
                self.config.name,
                previous_holder or "none",
            )
        self.holding = True

    def leader_url(self) -> str | None:
        """The receiver URL another replica published in the Lease, while that Lease is unexpired on this replica's
        clock as of its last read (None: no other leader known, or it publishes none)."""
        holder, url, seen_at, duration = self._seen
        if not holder or holder == self.config.identity or not url or self.clock() >= seen_at + duration:
            return None
        return url

    async def acquire(self, stop: asyncio.Event | None = None) -> bool:
        """Try every retry period (with client-go's jitter) until this replica leads (True) or `stop` is set (False)."""
        logger.info(
            "leader election: %s waiting for Lease %s/%s", self.config.identity, self.config.namespace, self.config.name
        )
        while stop is None or not stop.is_set():
            if await self.try_acquire_or_renew():
                return True
            delay = self.config.retry_period * (1 + 0.2 * random.random())
            if stop is None:
                await asyncio.sleep(delay)
            else:
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                except asyncio.TimeoutError:
                    pass
        return False

    async def keep(self, on_lost: Callable[[str], None]) -> None:
        """Renew every retry period while leading; `on_lost` when the last renewal is `renew_deadline` old."""
        while True:
            await asyncio.sleep(self.config.retry_period)
            try:
                renewed = await asyncio.wait_for(
                    self.try_acquire_or_renew(),
                    max(0.1, self.config.renew_deadline - (self.clock() - self._last_renew)),
                )
            except asyncio.TimeoutError:
                renewed = False
            if not renewed and not self.holding:  # another replica holds it now (we were cut off): stop at once
                on_lost(
                    f"Lease {self.config.namespace}/{self.config.name} is held by "
                    f"{self._observed[0] if self._observed else '?'}"
                )
                return
            if not renewed and self.clock() - self._last_renew >= self.config.renew_deadline:
                self.holding = False
                on_lost(
                    f"could not renew Lease {self.config.namespace}/{self.config.name} for "
                    f"{self.config.renew_deadline:g} s"
                )
                return

    async def release(self) -> None:
        """Give the Lease up (holder cleared, duration 1 s) so a standby takes over at its next attempt."""
        if not self.holding:
            return
        self.holding = False
        try:
            lease = await self.api.request("GET", f"{self._path}/{self.config.name}")
            if (lease.get("spec") or {}).get("holderIdentity") != self.config.identity:
                return
            spec = {k: v for k, v in lease["spec"].items() if k != "holderIdentity"}
            lease["spec"] = {**spec, "leaseDurationSeconds": 1, "renewTime": _micro_time(time.time())}
            lease["metadata"] = dict(lease.get("metadata") or {})
            _annotate(lease["metadata"], None)
            await self.api.request("PUT", f"{self._path}/{self.config.name}", body=lease)
            logger.info(
                "leader election: %s released Lease %s/%s",
                self.config.identity,
                self.config.namespace,
                self.config.name,
            )
        except client.ApiError as exc:
            logger.warning(
                "leader election: releasing Lease %s/%s failed (a standby takes over after %g s): %s",
                self.config.namespace,
                self.config.name,
                self.config.lease_duration,
                exc,
            )


class LeaseThread(threading.Thread):
    """The elector on its own thread and event loop, with its own API session: a renewal never waits behind the
    operator's own work (kopf taking in 500 objects at start keeps its loop busy for seconds, longer than a
    renew deadline). `acquired` is set once this replica leads; `stop()` releases the Lease and ends the thread."""

    def __init__(
        self,
        make_api: Callable[[], client.Api],
        config: LeaseConfig,
        on_lost: Callable[[str], None] = lambda reason: exit_lost(reason),
    ) -> None:
        super().__init__(name="leader-election", daemon=True)
        self.make_api, self.config, self.on_lost = make_api, config, on_lost
        self.acquired = threading.Event()
        self.done = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stopping = False
        self._elector: LeaderElector | None = None

    def leader_url(self) -> str | None:
        """`LeaderElector.leader_url` of this thread's elector (safe from another thread)."""
        return self._elector.leader_url() if self._elector is not None else None

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        finally:
            self.done.set()

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        if self._stopping:
            return
        api = self.make_api()
        elector = self._elector = LeaderElector(api, self.config)
        try:
            if not await elector.acquire(self._stop):
                return
            self.acquired.set()
            keeping = asyncio.create_task(elector.keep(self.on_lost))
            stopped = asyncio.create_task(self._stop.wait())
            await asyncio.wait({keeping, stopped}, return_when=asyncio.FIRST_COMPLETED)
            keeping.cancel()
            stopped.cancel()
            await elector.release()
        finally:
            await api.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Release the Lease (if held) and wait for the thread to end."""
        self._stopping = True
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self.done.wait(timeout)


async def serve_standby(
    host: str,
    liveness_port: int | None,
    metrics_port: int | None,
    alertmanager_port: int | None = None,
    alertmanager_token: str | None = None,
    leader_url: Callable[[], str | None] = lambda: None,
    retry_after: float = 2.0,
) -> list[web.AppRunner]:
    """/healthz (200: a standby is healthy) and /metrics (`pdfleet_operator_leader 0`) while waiting for the Lease, and
    on `alertmanager_port` the relay of authenticated alerts to the URL the leader published (`leader_url()`); all
    cleaned up before kopf, the operator's exporter and its receiver take the same ports."""

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"standby": True})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=exporter.text(), headers={"Content-Type": exporter.CONTENT_TYPE})

    runners = []
    for port, path, handler in ((liveness_port, "/healthz", healthz), (metrics_port, "/metrics", metrics)):
        if not port:
            continue
        app = web.Application()
        app.router.add_get(path, handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port, reuse_address=True).start()
        runners.append(runner)
    if alertmanager_port:
        # (a relay in flight when this replica takes over is cut after 1 s: the receiver must bind the port)
        runner = web.AppRunner(
            alertmanager.make_relay_app(leader_url, alertmanager_token, retry_after),
            access_log=None,
            shutdown_timeout=1.0,
        )
        await runner.setup()
        await web.TCPSite(runner, host, alertmanager_port, reuse_address=True).start()
        runners.append(runner)
    return runners


def exit_lost(reason: str) -> None:
    """Leadership lost: stop acting at once (client-go exits too); the kubelet restarts the pod as a standby."""
    logger.critical("leader election: %s; exiting so that no two replicas act", reason)
    logging.shutdown()
    os._exit(1)
