"""The chart's own RBAC, Helm-rendered and enforced by the emulator for the operator's ServiceAccount: what it grants
works, a verb it does not grant is 403 Forbidden, and the blockOwnerDeletion of every child needs its
`inferencedeployments/finalizers` grant (OwnerReferencesPermissionEnforcement)."""

from __future__ import annotations

import json

import httpx

from pdfleet_operator.kube import render
from tests.kube import ha
from tests.kube.cluster import EXAMPLES
from tests.kube.harness import prepare_cluster

APPLY = {"Content-Type": "application/apply-patch+yaml"}


def _child(name: str, owner: dict) -> dict:
    ref = render.Owner(owner["metadata"]["name"], "default", owner["metadata"]["uid"]).reference()
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "data": {"k": "v"},
        "metadata": {"name": name, "namespace": "default", "ownerReferences": [ref]},
    }


def test_the_operator_service_account_gets_what_the_chart_grants_and_nothing_else(kube) -> None:
    prepare_cluster(kube)
    (cluster_role,) = [o for o in ha.install_chart_rbac(kube) if o["kind"] == "ClusterRole"]
    kube.apply(EXAMPLES / "local-tiny.yaml")
    owner = kube.get("infdep", "local-tiny")
    token = kube.call(kube.emulator.service_account, ha.NAMESPACE, ha.SERVICE_ACCOUNT, "pod-0")
    with httpx.Client(base_url=kube.url, headers={"Authorization": f"Bearer {token}"}, timeout=10) as http:
        assert http.get("/api/v1/pods").status_code == 200
        assert http.get("/apis/pdfleet.io/v1alpha1/inferencedeployments").status_code == 200
        secret = http.get("/api/v1/namespaces/default/secrets/local-tiny-auth")
        assert secret.status_code == 403 and secret.json()["message"].startswith(
            'secrets "local-tiny-auth" is forbidden: User "system:serviceaccount:pdfleet-system:pdfleet-operator" '
            'cannot get resource "secrets"'
        )  # the chart grants create only
        assert http.delete("/apis/networking.k8s.io/v1/namespaces/default/networkpolicies/x").status_code == 403
        lease = "/apis/coordination.k8s.io/v1/namespaces/pdfleet-system/leases"
        assert http.get(f"{lease}/pdfleet-operator").status_code == 404  # allowed, not there yet
        assert http.get(f"{lease}/someone-elses").status_code == 403  # get/update of its own Lease only
        assert http.get("/apis/coordination.k8s.io/v1/namespaces/default/leases/pdfleet-operator").status_code == 403
        path = "/api/v1/namespaces/default/configmaps"
        created = http.patch(
            f"{path}/a", params={"fieldManager": "t"}, headers=APPLY, content=json.dumps(_child("a", owner))
        )
        assert created.status_code == 201, created.json()
        # Without the finalizers grant (as the chart had it before), creating a child is refused.
        kube.apply(
            {
                **cluster_role,
                "rules": [r for r in cluster_role["rules"] if r["resources"] != ["inferencedeployments/finalizers"]],
            }
        )
        refused = http.patch(
            f"{path}/b", params={"fieldManager": "t"}, headers=APPLY, content=json.dumps(_child("b", owner))
        )
        assert refused.status_code == 403
        assert (
            'cannot update resource "inferencedeployments/finalizers" in API group "pdfleet.io"'
            in refused.json()["message"]
        )
