"""The operator's own /metrics (pool replicas and $/h per deployment, role and accelerator); handlers update it.

Served in the classic Prometheus text format whatever the scraper's Accept header says, because
prometheus_client's OpenMetrics output escapes `:` in names (see tests/test_prometheus_fixtures.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import prometheus_client
from aiohttp import web

from pdfleet_operator.decide import metric_names as names
from pdfleet_operator.decide.cost import PlanCost
from pdfleet_operator.decide.placement import FleetPlan

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REGISTRY = prometheus_client.CollectorRegistry()
_POOL = ["namespace", names.LABEL_DEPLOYMENT_OWN, names.LABEL_ROLE_OWN, "accelerator"]
_DEP = [names.LABEL_NAMESPACE, names.LABEL_DEPLOYMENT]

POOL_REPLICAS = prometheus_client.Gauge(
    names.POOL_REPLICAS, "Replicas the operator asks for, per pool.", _POOL, registry=REGISTRY
)
POOL_COST = prometheus_client.Gauge(
    names.POOL_COST_PER_HOUR, "USD per hour of each pool at its desired size.", _POOL, registry=REGISTRY
)
SLO_TTFT = prometheus_client.Gauge(
    "pdfleet_slo_ttft_seconds", "Each deployment's p99 TTFT target.", _DEP, registry=REGISTRY
)
SLO_ITL = prometheus_client.Gauge(
    "pdfleet_slo_itl_seconds", "Each deployment's p99 inter-token latency target.", _DEP, registry=REGISTRY
)
RECONCILES = prometheus_client.Counter(
    "pdfleet_operator_reconciles_total", "Reconciles of InferenceDeployments by result.", ["result"], registry=REGISTRY
)
LEADER = prometheus_client.Gauge(
    "pdfleet_operator_leader",
    "1 while this replica acts (it holds the leader Lease, or runs without leader election), 0 while it is a standby.",
    registry=REGISTRY,
)
API_WRITES = prometheus_client.Counter(
    "pdfleet_operator_api_writes_total", "Writes the operator sent to the API server.", ["kind"], registry=REGISTRY
)
ALERT_TRIGGERS = prometheus_client.Counter(
    "pdfleet_operator_alert_triggers_total",
    "Rollback triggers the leader's Alertmanager receiver took in.",
    registry=REGISTRY,
)
ALERTS_RELAYED = prometheus_client.Counter(
    "pdfleet_operator_alerts_relayed_total",
    "Alertmanager posts a standby took in, by outcome (relayed to the leader; "
    "unauthorized; no_leader, unreachable, no_token, loop: answered 503).",
    ["outcome"],
    registry=REGISTRY,
)

# (namespace, deployment) -> pool label tuples currently exported, so vanished pools are removed.
_exported: dict[tuple[str, str], set[tuple[str, str]]] = {}


def set_pools(
    namespace: str, deployment: str, pools: Iterable[tuple[str, str, int, float]], slo_ttft: float, slo_itl: float
) -> None:
    """Export (role, accelerator, replicas, $/h) for one deployment, dropping pools it no longer has."""
    now: set[tuple[str, str]] = set()
    for role, acc, replicas, dollars in pools:
        POOL_REPLICAS.labels(namespace, deployment, role, acc).set(replicas)
        POOL_COST.labels(namespace, deployment, role, acc).set(dollars)
        now.add((role, acc))
    for role, acc in _exported.get((namespace, deployment), set()) - now:
        POOL_REPLICAS.remove(namespace, deployment, role, acc)
        POOL_COST.remove(namespace, deployment, role, acc)
    _exported[(namespace, deployment)] = now
    SLO_TTFT.labels(namespace, deployment).set(slo_ttft)
    SLO_ITL.labels(namespace, deployment).set(slo_itl)


def bill(namespace: str, deployment: str, plan: FleetPlan, running: PlanCost, slo_ttft: float, slo_itl: float) -> None:
    """The pool gauges of one deployment: planned replicas, and what runs billed (bound pods: a pool kept during a
    hand-over, a surge pod), not the plan (whose Pending replicas hold nothing)."""
    planned = {(p.role, p.accelerator_class): p.replicas for p in plan.pools}
    pools = sorted(set(planned) | {(p.role, p.accelerator_class) for p in running.pools})
    set_pools(
        namespace,
        deployment,
        (
            (
                role,
                acc,
                planned.get(
                    (role, acc),
                    next((p.replicas for p in running.pools if (p.role, p.accelerator_class) == (role, acc)), 0),
                ),
                running.of(role, acc),
            )
            for role, acc in pools
        ),
        slo_ttft,
        slo_itl,
    )


def forget(namespace: str, deployment: str) -> None:
    set_pools(namespace, deployment, (), 0, 0)
    _exported.pop((namespace, deployment), None)
    for gauge in (SLO_TTFT, SLO_ITL):
        try:
            gauge.remove(namespace, deployment)
        except KeyError:
            pass


def text() -> bytes:
    return prometheus_client.generate_latest(REGISTRY)


async def serve(host: str, port: int) -> web.AppRunner:
    """Start /metrics on host:port in the running event loop; returns the runner to clean up."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=text(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
