"""The chart installed into the API emulator by Helm's SDK, the operator it describes run against it, and its RBAC
compared with every request that operator makes.

The operator runs with a token of the chart's ServiceAccount, so the emulator authorizes each of its requests
by the installed ClusterRole/Roles (403 Forbidden otherwise, as a cluster would: a missing verb fails the
run), including the OwnerReferencesPermissionEnforcement plugin's check. The comparison here adds the other
direction: every verb those rules grant must have been used. NOTE: a server-side apply that creates an object
is authorized by the API server as `create` as well as `patch`
(https://kubernetes.io/docs/reference/using-api/api-concepts/#patch-and-apply); the emulator answers such
an apply 201, which is how the log shows it. A child created with an ownerReference that sets
`blockOwnerDeletion: true` needs `update` on its owner's `finalizers` subresource (the admission plugin's
check; no request goes there).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import httpx
import pytest

from pdfleet_operator.decide import worker_images
from tests.gen.chart import helm
from tests.gen.chart.operator_process import OperatorProcess, exercise
from tests.kube.cluster import example_deployments
from tests.support.k8s_emulator import LoggedRequest

Grant = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)
OPERATOR_USER = f"system:serviceaccount:{helm.NAMESPACE}:{helm.RELEASE}-operator"
# Every platform's worker image, as if built: the examples' pdfleet pools run on Ascend (npu) and Hygon (dtk) too,
# which the chart's default (cpu, cuda) refuses (tests/decide/test_runtimes.py covers the refusal).
EVERY_EXAMPLE = {"workerImage": {"platforms": list(worker_images.PLATFORMS)}}
# NOTE: the emulator's Lease timing, set through the chart's values. The emulator validates every write against the
# Kubernetes schemas on one thread of the test process; in the full suite on 2 cores it answered 10-25 requests/s
# while the operator took in every example, and once a renewal of the Lease waited behind that burst past the
# chart's 10 s renew deadline: the operator exited (as it must: it could not prove it still led) and nothing was
# reconciled (2026-12-04). A real API server answers a renewal in milliseconds.
EMULATOR_ELECTION = {"leaseDuration": 120, "renewDeadline": 90, "retryPeriod": 2}


def chart_values(operator: dict[str, Any] | None = None) -> dict[str, Any]:
    """EVERY_EXAMPLE with these operator values and the emulator's Lease timing."""
    return {**EVERY_EXAMPLE, "operator": {**(operator or {}), "leaderElection": EMULATOR_ELECTION}}


def service_account_kubeconfig(kube: Any) -> Any:
    """The operator pod's credentials: a token of the chart's ServiceAccount, authorized by the installed RBAC."""
    return kube.service_account_kubeconfig(helm.NAMESPACE, f"{helm.RELEASE}-operator", pod=f"{helm.RELEASE}-operator-0")


def required(requests: list[LoggedRequest], kube: Any = None) -> dict[tuple[str | None, Grant], int]:
    """(namespace or None, grant) -> how many of the operator's requests needed it (`kube` resolves the owner kinds
    of blocking ownerReferences)."""
    out: dict[tuple[str | None, Grant], int] = defaultdict(int)
    for r in requests:
        if r.verb is None:  # discovery (/api, /apis/<group>/<version>): allowed to every authenticated user
            continue
        resource = f"{r.resource}/{r.subresource}" if r.subresource else r.resource
        verbs = [r.verb] + (["create"] if r.patch_type == "apply" and r.status == 201 else [])
        for verb in verbs:
            out[(r.namespace, (r.group or "", resource, verb))] += 1
        if r.status == 201 and kube is not None and isinstance(r.body, dict):
            for ref in (r.body.get("metadata") or {}).get("ownerReferences") or []:
                if ref.get("blockOwnerDeletion"):
                    group = ref["apiVersion"].rpartition("/")[0]
                    owner = kube.resource(f"{ref['kind']}.{group}" if group else ref["kind"])
                    out[(r.namespace, (group, f"{owner.plural}/finalizers", "update"))] += 1
    return out


def grants(role: dict[str, Any]) -> set[Grant]:
    return {
        (g, res, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for res in rule["resources"]
        for v in rule["verbs"]
    }


def compare(kube: Any, requests: list[LoggedRequest]) -> tuple[dict, dict]:
    """(requests no rule allows, granted verbs never used), from the RBAC objects installed in the emulator."""
    name = f"{helm.RELEASE}-operator"
    cluster = grants(kube.get("clusterroles.rbac.authorization.k8s.io", name))
    binding = kube.get("clusterrolebindings.rbac.authorization.k8s.io", name)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": helm.NAMESPACE}]
    roles: dict[str, set[Grant]] = defaultdict(set)
    for r in kube.list("roles.rbac.authorization.k8s.io"):
        if r["metadata"]["name"] in (name, f"{name}-leader-election"):
            roles[r["metadata"]["namespace"]] |= grants(r)
    for b in kube.list("rolebindings.rbac.authorization.k8s.io"):
        if b["metadata"]["name"] in (name, f"{name}-leader-election"):
            assert b["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": helm.NAMESPACE}]
    need = required(requests, kube)
    missing = {k: n for k, n in need.items() if k[1] not in cluster | roles.get(k[0] or "", set())}
    used_cluster = {g for (_, g) in need}
    unused = {("ClusterRole", g) for g in cluster - used_cluster}
    unused |= {(f"Role {ns}", g) for ns, granted in roles.items() for g in granted - {g for (n, g) in need if n == ns}}
    return missing, dict.fromkeys(sorted(unused), 0)


@pytest.mark.slow
def test_install_then_the_operator_reconciles_with_exactly_the_rbac_it_is_granted(kube, tmp_path) -> None:
    config = helm.install(kube, chart_values(), ["team-a"])
    installed = {(o["kind"], o["metadata"]["name"]) for o in helm.render(chart_values())}
    for kind, name in installed:
        resource = {
            "ClusterRole": "clusterroles.rbac.authorization.k8s.io",
            "ClusterRoleBinding": "clusterrolebindings.rbac.authorization.k8s.io",
        }.get(kind, kind)
        namespace = None if kind in ("ClusterRole", "ClusterRoleBinding", "AcceleratorClass") else helm.NAMESPACE
        assert kube.get(resource, name, namespace) is not None, f"{kind}/{name} not installed"
    assert kube.get("crd", "inferencedeployments.pdfleet.io") is not None

    kube.clear_requests()  # from here on, every logged request is the operator's
    operator = OperatorProcess(
        kube.get("deployments.apps", f"{helm.RELEASE}-operator", helm.NAMESPACE),
        service_account_kubeconfig(kube),
        tmp_path / "operator.log",
    )
    assert "--all-namespaces" in operator.args and "--leader-elect" in operator.args
    assert "--leader-election-renew-deadline=90" in operator.args
    operator.start()
    try:
        for ns in ("default", "team-a"):
            exercise(kube, ns, monitoring=True)
        metrics = httpx.get(operator.metrics_url, timeout=5).text
        assert (
            'pdfleet_pool_cost_per_hour{accelerator="cpu",deployment="local-tiny",namespace="team-a",role="decode"}'
            in metrics
        )
        assert not kube.list("podmonitors.monitoring.coreos.com", "team-a"), (
            "the chart's PodMonitor scrapes every deployment: no per-deployment one (--no-pod-monitors)"
        )
        assert kube.list("prometheusrules.monitoring.coreos.com", "team-a"), (
            "monitoring CRDs exist: per-deployment rules"
        )
    finally:
        operator.stop()
    assert operator.proc.returncode == 0, operator.log()
    requests = kube.requests
    assert {r.user_agent.split("/")[0] for r in requests} <= {"kopf", "Python"}, "only the operator talked"
    assert {r.user for r in requests if r.verb} == {OPERATOR_USER}, "every request was authorized by the chart's RBAC"
    assert [r for r in requests if r.status == 403] == []
    assert kube.get("leases.coordination.k8s.io", f"{helm.RELEASE}-operator", helm.NAMESPACE) is not None

    missing, unused = compare(kube, requests)
    assert missing == {}, f"the operator did what the chart's RBAC does not allow: {missing}"
    assert unused == {}, f"the chart grants verbs the operator never used: {sorted(unused)}"
    used = sorted({f"{g or 'core'}/{res}:{v}" for (_, (g, res, v)) in required(requests)})
    print("verbs the operator used:", ", ".join(used))

    # Uninstalling keeps the CRDs (and so every InferenceDeployment); the operator's own objects go.
    config.uninstall(helm.RELEASE, timeout=60)
    assert kube.get("crd", "inferencedeployments.pdfleet.io") is not None
    assert kube.get("infdep", "local-tiny", "team-a") is not None
    assert kube.get("deployments.apps", f"{helm.RELEASE}-operator", helm.NAMESPACE) is None
    assert kube.get("clusterroles.rbac.authorization.k8s.io", f"{helm.RELEASE}-operator") is None


@pytest.mark.slow
def test_namespaced_install_stays_in_its_namespaces_with_exactly_its_roles(kube, tmp_path) -> None:
    helm.install(kube, chart_values(helm.VALUE_SETS["namespaced"]["operator"]), ["team-a", "team-b", "elsewhere"])
    kube.clear_requests()
    operator = OperatorProcess(
        kube.get("deployments.apps", f"{helm.RELEASE}-operator", helm.NAMESPACE),
        service_account_kubeconfig(kube),
        tmp_path / "operator.log",
    )
    assert [a for a in operator.args if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-b"]
    operator.start()
    try:
        for ns in ("team-a", "team-b"):
            exercise(kube, ns, monitoring=True)
        # Outside its namespaces nothing is managed: a CR there gets no status (checked after a resync-free pause
        # in which the watched namespaces' CRs above were all reconciled within a second).
        doc = example_deployments()["local-tiny"]
        kube.apply({**doc, "metadata": {**doc["metadata"], "namespace": "elsewhere"}})
        time.sleep(2)
    finally:
        operator.stop()
    assert operator.proc.returncode == 0, operator.log()
    assert (kube.get("infdep", "local-tiny", "elsewhere").get("status") or {}) == {}
    requests = kube.requests
    assert {r.namespace for r in requests if r.namespace} == {"team-a", "team-b", helm.NAMESPACE}
    assert {r.resource for r in requests if r.namespace == helm.NAMESPACE} == {"leases"}  # the leader Lease only
    assert [r for r in requests if r.status == 403] == [] and {r.user for r in requests if r.verb} == {OPERATOR_USER}
    missing, unused = compare(kube, requests)
    assert missing == {}, f"the operator did what the chart's RBAC does not allow: {missing}"
    assert unused == {}, f"the chart grants verbs the operator never used: {sorted(unused)}"
