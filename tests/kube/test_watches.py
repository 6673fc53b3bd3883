"""The operator's watches of its child kinds are label-selected by the API server: unmanaged ConfigMaps, Services,
Deployments, PDBs and NetworkPolicies of the cluster never reach it (the emulator's request log names every object
each list answered and each watch streamed)."""

from __future__ import annotations

from pdfleet_operator.kube import handlers, render
from tests.kube.cluster import EXAMPLES
from tests.kube.harness import prepare_cluster, running_operator, settle, wait_reconciled

CHILD_PLURALS = {plural for _, _, plural in handlers.CHILD_WATCHES}


def _unmanaged(i: int) -> list[dict]:
    meta = {"name": f"other-{i}", "namespace": "default", "labels": {"app": "someone-else"}}
    select = {"matchLabels": {"app": "someone-else"}}
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"k": "v"}},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": {"ports": [{"port": 80}]}},
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "selector": select,
                "template": {
                    "metadata": {"labels": {"app": "someone-else"}},
                    "spec": {"containers": [{"name": "c", "image": "x"}]},
                },
            },
        },
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": meta,
            "spec": {"maxUnavailable": 1, "selector": select},
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": meta,
            "spec": {"podSelector": select},
        },
    ]


def test_unmanaged_objects_never_reach_the_operator(kube) -> None:
    prepare_cluster(kube)
    kube.apply(_unmanaged(0))  # there before the operator starts: not in its initial lists
    with running_operator(kube):
        kube.apply(EXAMPLES / "llama31-8b-pd-mig.yaml")
        wait_reconciled(kube, "llama31-8b")
        for i in range(1, 4):  # created and changed while it watches: not streamed
            kube.apply(_unmanaged(i))
            kube.patch("configmaps", f"other-{i}", {"data": {"k": "changed"}})
        # A child whose managed-by label is removed by hand leaves the selection (the watch says DELETED) and the
        # operator puts the label back.
        kube.patch("configmaps", "llama31-8b-engine", {"metadata": {"labels": {"app.kubernetes.io/managed-by": None}}})
        kube.wait_for(
            lambda: (
                kube.get("configmaps", "llama31-8b-engine")["metadata"]["labels"].get("app.kubernetes.io/managed-by")
                == render.MANAGER
            ),
            timeout=20,
            message="the label restored",
        )
        settle(kube)
    reads = [r for r in kube.requests if r.verb in ("list", "watch") and r.resource in CHILD_PLURALS]
    assert {r.resource for r in reads if r.verb == "watch"} == CHILD_PLURALS
    managed = f"app.kubernetes.io/managed-by={render.MANAGER}"
    assert {r.query.get("labelSelector") for r in reads if r.verb == "watch"} == {managed}
    assert all(managed in (r.query.get("labelSelector") or "").split(",") for r in reads)  # the lists too
    sent = [ref for r in reads for ref in r.objects]
    assert sent and all(ref.startswith("default/llama31-8b") for ref in sent), sorted(set(sent))
    assert not any("other-" in ref for r in kube.requests for ref in r.objects)
    assert {r.pod for r in kube.requests} == {"in-process"}  # as the chart's ServiceAccount, its RBAC enforced
