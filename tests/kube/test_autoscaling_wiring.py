"""The autoscaler wired into the running operator: real Prometheus scraping scripted queue exporters, kopf against the
emulator.

The exporters play the queues of one deployment (labels namespace / pdfleet_deployment /
pdfleet_role, classic text format); Prometheus scrapes them every second; the operator's daemon
reads Prometheus at the spec's 1 s interval and the reconcile resizes the Deployments.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from pdfleet_operator.decide import autoscaler
from pdfleet_operator.decide import metric_names as names
from pdfleet_operator.decide.autoscaler import ScalingDecision
from pdfleet_operator.kube import render, scaling
from tests.kube.harness import events, mark_ready, prepare_cluster, running_operator, wait_reconciled
from tests.test_prometheus_fixtures import serve_text_metrics

NAME = "scaled"
INTERVAL_S = 1.0
SCRAPE_S = 1.0


def spec(name: str, prometheus_url: str | None) -> dict[str, Any]:
    autoscaling: dict[str, Any] = {
        "interval": f"{INTERVAL_S:g}s",
        "scaleDownStabilization": "2s",
        "scaleDownDelayAfterScaleUp": "2s",
        "maxScaleDownStep": 4,
        "metricsMaxAge": "5s",
    }
    if prometheus_url:
        autoscaling["prometheusUrl"] = prometheus_url
    return {
        "apiVersion": "pdfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "model": {
                "name": "tiny",
                "source": {"local": {"path": "/models/tiny"}},
                "maxModelLen": 1024,
                "dtype": "float32",
            },
            "prefill": {"acceleratorClasses": ["cpu"], "minReplicas": 1, "maxReplicas": 3, "targetQueuePerReplica": 2},
            "decode": {"acceleratorClasses": ["cpu"], "minReplicas": 1, "maxReplicas": 4, "targetQueuePerReplica": 8},
            "autoscaling": autoscaling,
        },
    }


class Queues:
    """A worker exporter whose per-role queues the test scripts."""

    def __init__(self, name: str) -> None:
        self.registry = CollectorRegistry()
        labels = [names.LABEL_NAMESPACE, names.LABEL_DEPLOYMENT, names.LABEL_ROLE]
        self.waiting = Gauge(names.NUM_REQUESTS_WAITING, "Requests waiting", labels, registry=self.registry)
        self.running = Gauge(names.NUM_REQUESTS_RUNNING, "Requests running", labels, registry=self.registry)
        self.name = name
        self.set("prefill", waiting=0, running=0)
        self.set("decode", waiting=0, running=8)
        self.server = serve_text_metrics(self.registry)

    def set(self, role: str, *, waiting: float, running: float) -> None:
        self.waiting.labels("default", self.name, role).set(waiting)
        self.running.labels("default", self.name, role).set(running)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"


class Ticks:
    """The decisions of every autoscaler tick of one deployment, in order (the operator runs in this process)."""

    def __init__(self, monkeypatch: Any, name: str) -> None:
        self.decisions: list[dict[str, ScalingDecision]] = []
        original = scaling.Scaler.tick
        ticks = self

        async def tick(scaler: scaling.Scaler, inputs: Any, key: Any, *args: Any, **kwargs: Any) -> dict:
            decisions = await original(scaler, inputs, key, *args, **kwargs)
            if key == ("default", name):
                ticks.decisions.append(decisions)
            return decisions

        monkeypatch.setattr(scaling.Scaler, "tick", tick)


def replicas(kube: Any, name: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in kube.list("deployments.apps", "default", label_selector=f"{render.LABEL_DEPLOYMENT}={name}"):
        role = d["metadata"]["labels"].get(render.LABEL_ROLE)
        if role != render.ROUTER_ROLE:
            out[role] = out.get(role, 0) + int(d["spec"].get("replicas", 0))
    return out


def condition(kube: Any, name: str, type_: str) -> dict | None:
    cr = kube.get("infdep", name, "default") or {}
    return next((c for c in (cr.get("status") or {}).get("conditions", []) if c["type"] == type_), None)


def wait_replicas(kube: Any, name: str, want: dict[str, int], timeout: float) -> float:
    """Seconds until the Deployments ask for `want`."""
    start = time.monotonic()
    kube.wait_for(
        lambda: replicas(kube, name) == want,
        timeout=timeout,
        message=f"{name} replicas {want} (have {replicas(kube, name)})",
    )
    return time.monotonic() - start


def test_replicas_follow_the_queues_hold_without_prometheus_and_recover(kube, prometheus_factory, monkeypatch) -> None:
    queues = Queues(NAME)
    ticks = Ticks(monkeypatch, NAME)
    try:
        prom = prometheus_factory(targets={"workers": [queues.target]}, interval=f"{SCRAPE_S:g}s")
        prom.wait_for(f'{names.NUM_REQUESTS_WAITING}{{pdfleet_deployment="{NAME}"}}')
        prepare_cluster(kube)
        with running_operator(kube, autoscaler=True):
            kube.apply(spec(NAME, prom.url))
            kube.apply(spec("unscraped", None))  # no URL in the spec, none given to the operator
            wait_reconciled(kube, NAME)
            wait_reconciled(kube, "unscraped")
            # Pools still starting: no worker reports yet, so the autoscaler says nothing (no warning per new CR).
            time.sleep(3 * INTERVAL_S)
            for name in (NAME, "unscraped"):
                assert condition(kube, name, "MetricsAvailable") is None, condition(kube, name, "MetricsAvailable")
                assert not [e for e in events(kube, name) if e["reason"] == "MetricsUnavailable"]
                mark_ready(kube, name)
            kube.wait_for(
                lambda: (condition(kube, NAME, "MetricsAvailable") or {}).get("status") == "True",
                timeout=10,
                message="MetricsAvailable=True",
            )
            assert replicas(kube, NAME) == {"prefill": 1, "decode": 1}

            # No Prometheus at all: held at the minimum sizes, and the condition says where to set one.
            kube.wait_for(
                lambda: (condition(kube, "unscraped", "MetricsAvailable") or {}).get("status") == "False",
                timeout=10,
                message="unscraped: MetricsAvailable=False",
            )
            assert "prometheusUrl" in condition(kube, "unscraped", "MetricsAvailable")["message"]

            # A prefill surge: 6 waiting at 2 per replica -> 3 prefill replicas, on the first tick that reads it.
            # What an empty queue at the minimum gives (never ScaleUpStabilizing, the hold of a queue read and waited
            # on).
            idle = (autoscaler.MIN_REPLICAS, autoscaler.SCALE_DOWN_STABILIZING, autoscaler.WITHIN_TOLERANCE)
            held = ticks.decisions[-1]["prefill"]
            assert (held.current, held.desired) == (1, 1) and held.reason in idle, held
            first = len(ticks.decisions)
            queues.set("prefill", waiting=6, running=2)
            took = _wait_role(kube, NAME, "prefill", 3, timeout=20)

            # NOTE: no bound on `took` (the machine's speed); what it checks is that no tick held a queue it read.
            # Before the move every tick held at 1 as before the surge (Prometheus had not scraped the queue yet),
            # and the move went 1 -> 3 in one decision (no stabilization, no step limit on the way up).
            def moves() -> (
                list[ScalingDecision] | None
            ):  # (the tick is recorded once it returns, maybe after the patch)
                after = [d["prefill"] for d in ticks.decisions[first:]]
                return after if any(d.direction != "hold" for d in after) else None

            after = kube.wait_for(moves, timeout=10, message="the autoscaler tick that moved prefill")
            moved = next(i for i, d in enumerate(after) if d.direction != "hold")
            assert all((d.current, d.desired) == (1, 1) and d.reason in idle for d in after[:moved]), after[:moved]
            assert (after[moved].current, after[moved].desired, after[moved].direction) == (1, 3, "up"), after[moved]
            report = (
                f"prefill surge -> 3 replicas after {took:.2f}s, on the {moved + 1}. tick after it "
                f"(interval {INTERVAL_S}s + scrape {SCRAPE_S}s; {after[moved].reason})"
            )
            decision = kube.get("infdep", NAME, "default")["status"]["lastScalingDecision"]
            assert decision["reason"] and decision["toReplicas"] >= decision["fromReplicas"]

            # Long outputs: decode's queue grows, prefill's empties -> decode up to its max, prefill back to 1.
            queues.set("prefill", waiting=0, running=0)
            queues.set("decode", waiting=6, running=26)
            wait_replicas(kube, NAME, {"prefill": 1, "decode": 4}, timeout=20)
            cr = wait_reconciled(kube, NAME, check=lambda cr: cr["status"].get("pdRatio") == "1:4")
            assert cr["status"]["prefillReplicas"] == 1 and cr["status"]["decodeReplicas"] == 4

            # Prometheus down: the queues empty, but nothing is read as zero; the size is held.
            prom.stop()
            queues.set("decode", waiting=0, running=0)
            kube.wait_for(
                lambda: (condition(kube, NAME, "MetricsAvailable") or {}).get("status") == "False",
                timeout=10,
                message="MetricsAvailable=False after Prometheus stopped",
            )
            assert condition(kube, NAME, "MetricsAvailable")["reason"] == "MetricsUnavailable"
            time.sleep(4 * INTERVAL_S)
            assert replicas(kube, NAME) == {"prefill": 1, "decode": 4}
            warnings = [e for e in events(kube, NAME) if e["reason"] == "MetricsUnavailable"]
            assert len(warnings) == 1 and warnings[0]["type"] == "Warning", [e["message"] for e in warnings]

            # Prometheus back: fresh queues are read again and decode shrinks to what they need.
            prom.restart()
            kube.wait_for(
                lambda: (condition(kube, NAME, "MetricsAvailable") or {}).get("status") == "True",
                timeout=15,
                message="MetricsAvailable=True after Prometheus restarted",
            )
            wait_replicas(kube, NAME, {"prefill": 1, "decode": 1}, timeout=15)
            assert [e["reason"] for e in events(kube, NAME)].count("MetricsAvailable") == 1
            # The other deployment stayed held the whole time.
            assert replicas(kube, "unscraped") == {"prefill": 1, "decode": 1}
        print(report)  # NOTE: after the runner: KopfRunner swaps sys.stdout while kopf runs
    finally:
        queues.server.shutdown()


def _wait_role(kube: Any, name: str, role: str, n: int, timeout: float) -> float:
    start = time.monotonic()
    kube.wait_for(
        lambda: replicas(kube, name).get(role) == n,
        timeout=timeout,
        message=f"{name} {role} at {n} replicas (have {replicas(kube, name)})",
    )
    return time.monotonic() - start
