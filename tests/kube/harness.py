"""The operator running for real (kopf in this process) against the API emulator, plus helpers to drive it.

`running_operator` applies the CRDs, the example AcceleratorClasses and a fleet of Nodes, starts
kopf with pdfleet's handlers (a fresh Reconciler per test), and stops it at the end.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import kopf.testing
import pytest

from pdfleet_operator.api.names import ANNOTATION_APPLIED_HASH
from pdfleet_operator.kube import handlers, render
from tests.kube.cluster import ROOT, class_objects, standard_nodes

CHILD_RESOURCES = (
    "deployments.apps",
    "services",
    "configmaps",
    "poddisruptionbudgets.policy",
    "networkpolicies.networking.k8s.io",
)
SERVER_FIELDS = ("uid", "resourceVersion", "generation", "creationTimestamp", "managedFields")


def prepare_cluster(kube: Any, nodes: list[dict] | None = None) -> None:
    kube.apply(ROOT / "crds")
    kube.apply(class_objects())
    kube.apply(nodes if nodes is not None else standard_nodes())


@contextlib.contextmanager
def running_operator(
    kube: Any,
    *,
    resync_interval: float = 0.0,
    autoscaler: bool = False,
    prometheus_url: str | None = None,
    alertmanager_port: int | None = None,
    analysis_interval: float = 0.0,
    class_status_interval: float = 0.0,
    namespaces: tuple[str, ...] = (),
    rbac: bool = True,
) -> Iterator[kopf.testing.KopfRunner]:
    """kopf with pdfleet's handlers; the autoscaler, rollback-analysis and class-status loops only when asked
    (`autoscaler`, `analysis_interval` / `class_status_interval` > 0), so tests of the reconcile alone see
    no metrics- or capacity-driven writes. `namespaces`: serve only these (as `pdfleet operator -n`), else all.
    `rbac` (the default): run as the chart's ServiceAccount, authorized by the emulator from the chart's own
    ClusterRole/Roles (Helm-rendered for the same namespaces): a request the chart does not allow is a 403 and
    fails the test, as it would fail on a cluster."""
    import os

    previous = os.environ.get("KUBECONFIG")
    if rbac:
        from tests.kube import ha

        ha.install_chart_rbac(kube, {"operator": {"watchNamespaces": list(namespaces)}} if namespaces else None)
        os.environ["KUBECONFIG"] = str(
            kube.service_account_kubeconfig(ha.NAMESPACE, ha.SERVICE_ACCOUNT, pod="in-process")
        )
    try:
        with _kopf_runner(
            resync_interval,
            autoscaler,
            prometheus_url,
            alertmanager_port,
            analysis_interval,
            class_status_interval,
            namespaces,
        ) as runner:
            yield runner
    finally:
        if previous is not None:
            os.environ["KUBECONFIG"] = previous
    forbidden = sorted({r.denied for r in kube.requests if r.denied})  # (not a 403 a test injected itself)
    assert not forbidden, f"the chart's RBAC refused the operator: {forbidden}"


@contextlib.contextmanager
def _kopf_runner(
    resync_interval: float,
    autoscaler: bool,
    prometheus_url: str | None,
    alertmanager_port: int | None,
    analysis_interval: float,
    class_status_interval: float,
    namespaces: tuple[str, ...],
) -> Iterator[kopf.testing.KopfRunner]:
    handlers.RECONCILER = handlers.Reconciler()
    handlers.OPTIONS.resync_interval = resync_interval
    handlers.OPTIONS.autoscaler = autoscaler
    handlers.OPTIONS.prometheus_url = prometheus_url
    handlers.OPTIONS.prometheus_allowed = ("http://127.0.0.1",)  # the tests' Prometheus servers, on loopback
    handlers.OPTIONS.alertmanager_port = alertmanager_port
    handlers.OPTIONS.analysis_interval = analysis_interval
    handlers.OPTIONS.metrics_port = None
    handlers.OPTIONS.class_status_interval = class_status_interval
    handlers.OPTIONS.namespaces = tuple(namespaces)
    scope = [a for ns in namespaces for a in ("--namespace", ns)] or ["--all-namespaces"]
    args = ["run", "--standalone", *scope, "-m", "pdfleet_operator.kube.handlers"]
    with kopf.testing.KopfRunner(args, timeout=60) as runner:
        yield runner
    assert runner.exception is None, runner.exception


def changing_writes(kube: Any) -> list:
    """Writes that change something: all but the check that the deployment token's Secret exists (a create the
    API server answers 409, made once per deployment by a newly started operator)."""
    return [w for w in kube.writes() if not (w.resource == "secrets" and w.verb == "create" and w.status == 409)]


def children(kube: Any, name: str, namespace: str = "default") -> dict[str, dict]:
    """Every object labelled as this deployment's child, by `Kind/name`."""
    out = {}
    for resource in CHILD_RESOURCES:
        for obj in kube.list(resource, namespace, label_selector=f"{render.LABEL_DEPLOYMENT}={name}"):
            out[f"{obj['kind']}/{obj['metadata']['name']}"] = obj
    return out


def wait_reconciled(
    kube: Any,
    name: str,
    *,
    namespace: str = "default",
    timeout: float = 20.0,
    check: Callable[[dict], bool] | None = None,
) -> dict:
    """Wait until the CR's status reflects its current generation (and `check` holds); return the CR."""

    def done() -> dict | None:
        obj = kube.get("infdep", name, namespace)
        st = (obj or {}).get("status") or {}
        if obj and st.get("observedGeneration") == obj["metadata"].get("generation") and (check is None or check(obj)):
            return obj
        return None

    try:
        return kube.wait_for(done, timeout=timeout, message=f"{namespace}/{name} reconciled")
    except pytest.fail.Exception:
        obj = kube.get("infdep", name, namespace) or {}
        pytest.fail(
            f"timed out after {timeout} s waiting for {namespace}/{name} reconciled; generation "
            f"{obj.get('metadata', {}).get('generation')}, status {obj.get('status')}"
        )


def settle(kube: Any, quiet: float = 0.6, timeout: float = 20.0) -> None:
    """Wait until no request has been written for `quiet` seconds (the operator is idle)."""
    deadline = time.monotonic() + timeout
    last = -1
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        n = len(kube.writes())
        if n != last:
            last, quiet_since = n, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet:
            return
        time.sleep(0.05)
    raise AssertionError(f"the operator kept writing for {timeout} s")


def mark_ready(kube: Any, name: str, namespace: str = "default") -> None:
    """Play the Deployment controller: every Deployment of `name` reports all replicas ready."""
    for obj in kube.list("deployments.apps", namespace, label_selector=f"{render.LABEL_DEPLOYMENT}={name}"):
        n = obj["spec"].get("replicas", 1)
        kube.patch_status(
            "deployments.apps",
            obj["metadata"]["name"],
            {
                "replicas": n,
                "readyReplicas": n,
                "availableReplicas": n,
                "updatedReplicas": n,
                "observedGeneration": obj["metadata"]["generation"],
            },
            namespace,
        )


def events(kube: Any, name: str, namespace: str = "default") -> list[dict]:
    return [e for e in kube.list("events", namespace) if e["involvedObject"]["name"] == name]


def strip_server_fields(obj: dict) -> dict:
    import copy

    out = copy.deepcopy(obj)
    for key in SERVER_FIELDS:
        out["metadata"].pop(key, None)
    annotations = out["metadata"].get("annotations") or {}
    annotations.pop(ANNOTATION_APPLIED_HASH, None)  # the operator's bookkeeping (decide/drift.py), not rendered
    if "annotations" in out["metadata"] and not annotations:
        del out["metadata"]["annotations"]
    out.pop("status", None)
    for ref in out["metadata"].get("ownerReferences", []):
        ref["uid"] = "<uid>"
    return out
