"""The autoscaler in the operator: one tick per InferenceDeployment (snapshot -> decide -> reconciler inputs); run by
each deployment's loop in `kube.reconciler`.

A tick reads the deployment's queues from Prometheus (`prometheus`, in a thread: the client blocks),
runs the pure `autoscaler.decide` against the capacity of the last plan, and hands the outcome to
the reconciler: desired replicas through `set_desired` (the reconcile path stays the only writer),
MetricsAvailable / ScalingLimited and lastScalingDecision through `set_status`. Only what changed
is handed over, so a steady deployment costs no reconcile per interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdfleet_operator import prometheus
from pdfleet_operator.api import Condition, InferenceDeployment
from pdfleet_operator.decide import autoscaler, guardrails, tick
from pdfleet_operator.decide.autoscaler import ScalerState, ScalingDecision
from pdfleet_operator.decide.metrics_snapshot import MetricsSnapshot
from pdfleet_operator.decide.placement import FleetPlan
from pdfleet_operator.kube import exporter, operator_metrics
from pdfleet_operator.kube.indexes import Key
from pdfleet_operator.kube.options import OPTIONS

logger = logging.getLogger("pdfleet.scaling")

NO_URL = (
    "no Prometheus to read queue metrics from: set spec.autoscaling.prometheusUrl or start the "
    "operator with --prometheus-url"
)
# The decision series live next to the pool series, on the operator's one /metrics.
METRICS = operator_metrics.OperatorMetrics(exporter.REGISTRY)


class Inputs(Protocol):
    """What a tick needs from the reconciler (`kube.reconciler.Reconciler`)."""

    api: Any

    def set_desired(self, key: Key, replicas: Mapping[str, int], why: str = ...) -> None: ...
    def set_status(self, key: Key, *, conditions: list[Condition] = ..., why: str = ..., **fields: Any) -> None: ...
    def clear_condition(self, key: Key, type_: str) -> None: ...
    def last_plan(self, key: Key) -> FleetPlan | None: ...
    def engines(self, key: Key) -> dict[str, list[str]]: ...


@dataclass
class Memory:
    """What the autoscaler keeps per deployment in this process."""

    state: ScalerState
    available: bool | None = None  # MetricsAvailable as last reported
    conditions: dict[str, tuple[str, str, str]] = field(default_factory=dict)  # type -> (status, reason, message)
    headline: tuple[str, int, int, str] | None = None  # (role, from, to, reason) of the last reported decision

    def seed_from(self, dep: InferenceDeployment) -> None:
        """What an earlier process already reported (status), so a restart re-reports only what changed.

        NOTE: without this, the first tick after every operator restart rewrote each deployment's
        status (a fresh lastScalingDecision time) and repeated its MetricsUnavailable Event.
        """
        status = dep.status
        if status is None:
            return
        for cond in status.conditions:
            if cond.type in ("MetricsAvailable", "ScalingLimited"):
                self.conditions[cond.type] = (cond.status, cond.reason or "", cond.message or "")
                if cond.type == "MetricsAvailable" and cond.status in ("True", "False"):
                    self.available = cond.status == "True"
        last = status.last_scaling_decision
        if last is not None:
            self.headline = (last.role, last.from_replicas, last.to_replicas, last.reason)


class Scaler:
    """One deployment's autoscaler in this process: its memory and the tick that uses it.

    Held by the deployment's `kube.memory.DeploymentMemory`, so it goes when the deployment does.
    """

    def __init__(self) -> None:
        self.memory: Memory | None = None  # None until the first tick

    @property
    def started(self) -> bool:
        return self.memory is not None

    def forget(self, key: Key) -> None:
        self.memory = None
        METRICS.forget(*key)

    async def tick(
        self,
        inputs: Inputs,
        key: Key,
        dep: InferenceDeployment,
        body: Mapping[str, Any],
        *,
        default_url: str | None,
        profile: str,
        now: float | None = None,
    ) -> dict[str, ScalingDecision]:
        """One interval of one deployment; returns the decisions (tests and logs)."""
        spec = dep.spec
        last = inputs.last_plan(key)
        mem = self.memory
        if mem is None:
            # NOTE: seeded from what the pools run now, so an operator restart does not reset the sizes.
            current = {} if last is None else {role: last.replicas(role) for role in last.roles()}
            mem = self.memory = Memory(ScalerState.initial(spec, current))
            mem.seed_from(dep)
        snap = await snapshot(dep, default_url, profile, inputs.engines(key))
        at = time.time() if now is None else now
        step = tick.scale(spec, mem.state, snap, at, last)
        mem.state, decisions = step.state, dict(step.decisions)
        METRICS.record(key[0], key[1], decisions)

        if step.moved:
            inputs.set_desired(key, step.desired, "autoscaler: " + step.why())

        await self._report(inputs, key, dep, body, decisions, at, mem)
        return decisions

    async def _report(
        self,
        inputs: Inputs,
        key: Key,
        dep: InferenceDeployment,
        body: Mapping[str, Any],
        decisions: Mapping[str, ScalingDecision],
        now: float,
        mem: Memory,
    ) -> None:
        metrics_cond, limited_cond = autoscaler.conditions(decisions, now, dep.metadata.generation)
        conditions: list[Condition] = []
        seen = (metrics_cond.status, metrics_cond.reason or "", metrics_cond.message or "")
        if mem.conditions.get("MetricsAvailable") != seen:
            conditions.append(metrics_cond)
            mem.conditions["MetricsAvailable"] = seen
        limited = limited_cond.status == "True"
        seen_limited = (limited_cond.status, limited_cond.reason or "", limited_cond.message or "")
        if mem.conditions.get("ScalingLimited") != seen_limited:
            mem.conditions["ScalingLimited"] = seen_limited
            if limited:
                conditions.append(limited_cond)
            else:
                # NOTE: the plan's own ScalingLimited (status.compute) speaks when the autoscaler is not limited.
                inputs.clear_condition(key, "ScalingLimited")

        fields: dict[str, Any] = {}
        head = autoscaler.headline(decisions)
        headline = (head.role, head.current, head.desired, head.reason)
        if headline != mem.headline:
            fields["last_scaling_decision"] = autoscaler.status_decision(decisions, now)
            mem.headline = headline
        if conditions or fields:
            inputs.set_status(key, conditions=conditions, why=f"autoscaler: {head.reason}", **fields)

        available = metrics_cond.status == "True"
        if available != mem.available and inputs.api is not None:
            if not available:
                await inputs.api.event(
                    body["metadata"],
                    "Warning",
                    autoscaler.METRICS_UNAVAILABLE,
                    f"{metrics_cond.message} (P:D {autoscaler.ratio_text(decisions)} held)",
                )
            elif mem.available is False:
                await inputs.api.event(
                    body["metadata"],
                    "Normal",
                    "MetricsAvailable",
                    f"queue metrics are back; P:D {autoscaler.ratio_text(decisions)}",
                )
        mem.available = available


async def snapshot(
    dep: InferenceDeployment, default_url: str | None, profile: str, engines: Mapping[str, list[str]] | None = None
) -> MetricsSnapshot:
    """The deployment's queue metrics now; an unavailable snapshot (never an exception) when they cannot be read.

    Each role is read with the metric names of the engines its pools run (`engines`, from the last plan),
    `profile` (the operator's --metrics-profile) where the plan says nothing."""
    url = dep.spec.autoscaling.prometheus_url or default_url
    if not url:
        return MetricsSnapshot.unavailable(time.time(), NO_URL)
    refused = guardrails.prometheus_url_problem(url, default_url, OPTIONS.prometheus_allowed)
    if refused:
        return MetricsSnapshot.unavailable(time.time(), refused)
    source = prometheus.prometheus_for(url, profile, OPTIONS.prometheus_verify)
    assert dep.metadata.name and dep.metadata.namespace, "a stored InferenceDeployment has a name and namespace"
    return await asyncio.to_thread(
        source.snapshot, dep.metadata.name, dep.metadata.namespace, list(dep.spec.roles()), engines or None
    )
