"""The autoscaler tick after an operator restart: it re-reports only what changed since the last process."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import yaml

from pdfleet_operator.api import InferenceDeployment
from pdfleet_operator.decide.placement import FleetPlan, PlannedPool
from pdfleet_operator.kube import scaling

KEY = ("default", "qwen2-7b")


class FakeApi:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    async def event(self, involved: dict[str, Any], type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason))


class FakeInputs:
    """The reconciler's side of a tick: records what the autoscaler asks for."""

    def __init__(self) -> None:
        self.api = FakeApi()
        self.status_writes: list[dict[str, Any]] = []
        self.desired: list[dict[str, int]] = []

    def set_desired(self, key: Any, replicas: Mapping[str, int], why: str = "") -> None:
        self.desired.append(dict(replicas))

    def set_status(self, key: Any, *, conditions: list = (), why: str = "", **fields: Any) -> None:
        self.status_writes.append({"conditions": {c.type: c for c in conditions}, **fields})

    def clear_condition(self, key: Any, type_: str) -> None:
        pass

    def engines(self, key: Any) -> dict[str, list[str]]:
        return {"prefill": ["pdfleet"], "decode": ["pdfleet"]}

    def last_plan(self, key: Any) -> FleetPlan:
        """One replica per role on `cpu`, room for 8 (what the reconciler planned last)."""
        return FleetPlan(
            pools=(PlannedPool("prefill", "cpu", 1), PlannedPool("decode", "cpu", 1)),
            targets={"prefill": 1, "decode": 1},
            capacities={"prefill": 8, "decode": 8},
            class_capacities={"prefill": (("cpu", 8),), "decode": (("cpu", 8),)},
        )


def body() -> dict[str, Any]:
    doc = yaml.safe_load(open("examples/qwen2-7b.yaml"))
    doc["metadata"].update(namespace=KEY[0], name=KEY[1], generation=1)
    doc["spec"]["prefill"] = {"acceleratorClasses": ["cpu"], "minReplicas": 1}
    doc["spec"]["decode"] = {"acceleratorClasses": ["cpu"], "minReplicas": 1}
    doc["spec"].pop("colocated", None)
    doc["spec"]["disaggregation"] = True
    return doc


def tick(scaler: scaling.Scaler, inputs: FakeInputs, doc: dict[str, Any], now: float) -> None:
    dep = InferenceDeployment.model_validate(doc)
    # No Prometheus anywhere: the snapshot is unavailable and every role holds.
    asyncio.run(scaler.tick(inputs, KEY, dep, doc, default_url=None, profile="pdfleet", now=now))


def test_a_restart_does_not_rewrite_what_the_last_process_reported() -> None:
    doc = body()
    first, inputs = scaling.Scaler(), FakeInputs()
    tick(first, inputs, doc, 1000.0)
    assert inputs.status_writes and "MetricsAvailable" in inputs.status_writes[0]["conditions"]
    assert inputs.api.events == [("Warning", "MetricsUnavailable")]
    tick(first, inputs, doc, 1015.0)  # the same process: nothing new to say
    assert len(inputs.status_writes) == 1 and len(inputs.api.events) == 1

    # What the reconcile wrote from that report, as a restarted operator reads it back.
    written = inputs.status_writes[0]
    status = {
        "conditions": [
            c.model_dump(mode="json", by_alias=True, exclude_none=True) for c in written["conditions"].values()
        ],
        "lastScalingDecision": written["last_scaling_decision"].model_dump(mode="json", by_alias=True),
    }
    restarted, after = scaling.Scaler(), FakeInputs()
    tick(restarted, after, {**doc, "status": status}, 2000.0)
    assert after.status_writes == [] and after.api.events == []
    assert after.desired == []


def test_a_restart_still_reports_a_change() -> None:
    doc = body()
    status = {
        "conditions": [
            {
                "type": "MetricsAvailable",
                "status": "True",
                "reason": "MetricsFresh",
                "message": "queue metrics of every role are fresh",
                "lastTransitionTime": "2026-11-30T07:00:00Z",
            }
        ]
    }
    restarted, inputs = scaling.Scaler(), FakeInputs()
    tick(restarted, inputs, {**doc, "status": status}, 2000.0)
    assert inputs.api.events == [("Warning", "MetricsUnavailable")]
    assert inputs.status_writes and "MetricsAvailable" in inputs.status_writes[0]["conditions"]
