"""The emulator's opt-in controllers (tests/support/k8s/workloads/): Deployments make Pods, the scheduler binds
them by extended resources or leaves them Pending (Unschedulable) until capacity frees."""

from __future__ import annotations

from tests.kube.cluster import node, pod
from tests.support.k8s_fixtures import Kube


def _deployment(
    name: str,
    replicas: int,
    requests: dict[str, str],
    *,
    selector: dict[str, str] | None = None,
    tolerations: list[dict] | None = None,
) -> dict:
    spec: dict = {"containers": [{"name": "c", "image": "x", "resources": {"requests": requests, "limits": requests}}]}
    if selector:
        spec["nodeSelector"] = selector
    if tolerations:
        spec["tolerations"] = tolerations
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": spec},
        },
    }


def _pods(kube: Kube, app: str) -> list[dict]:
    return kube.list("pods", "default", label_selector=f"app={app}")


def _phases(kube: Kube, app: str) -> tuple[int, int]:
    pods = _pods(kube, app)
    bound = [p for p in pods if p["spec"].get("nodeName") and p["status"].get("phase") == "Running"]
    pending = [p for p in pods if not p["spec"].get("nodeName") and p["status"].get("phase") == "Pending"]
    return len(bound), len(pending)


def test_pods_bind_by_extended_resource_or_stay_pending_until_capacity_frees(kube: Kube) -> None:
    kube.call(kube.emulator.enable_workloads)
    tol = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    kube.apply(node("gpu-0", "h100", 2))
    kube.apply(_deployment("a", 3, {"nvidia.com/gpu": "1"}, tolerations=tol))
    kube.wait_for(lambda: _phases(kube, "a") == (2, 1), message="2 pods bound, 1 Pending")
    waiting = next(p for p in _pods(kube, "a") if not p["spec"].get("nodeName"))
    cond = waiting["status"]["conditions"][0]
    assert (cond["type"], cond["status"], cond["reason"]) == ("PodScheduled", "False", "Unschedulable")
    assert cond["message"] == "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
    dep = kube.get("deployments.apps", "a", "default")
    assert (dep["status"]["replicas"], dep["status"]["readyReplicas"]) == (3, 2)

    # A node whose taint the pods do not tolerate, or without GPUs, does not help; one that fits does.
    kube.apply(node("gpu-1", "h100", 4, taints=[{"key": "dedicated", "value": "training", "effect": "NoSchedule"}]))
    kube.apply(node("ascend-0", "ascend", 8))
    assert _phases(kube, "a") == (2, 1)
    msg = next(p for p in _pods(kube, "a") if not p["spec"].get("nodeName"))["status"]["conditions"][0]["message"]
    assert "1 node(s) had untolerated taint {dedicated: training}" in msg and "2 Insufficient nvidia.com/gpu" in msg
    kube.apply(node("gpu-2", "h100", 1))
    kube.wait_for(lambda: _phases(kube, "a") == (3, 0), message="the Pending pod bound on the new node")
    assert {p["spec"]["nodeName"] for p in _pods(kube, "a")} == {"gpu-0", "gpu-2"}

    # Scale down frees units, which another workload's Pending pod then takes.
    kube.apply(pod("other", None, {"nvidia.com/gpu": "2"}))
    kube.patch("pods", "other", {"spec": {"tolerations": tol}}, "default")
    kube.wait_for(
        lambda: kube.get("pods", "other", "default")["status"].get("phase") == "Pending", message="other Pending"
    )
    kube.patch("deployments.apps", "a", {"spec": {"replicas": 0}}, "default")
    kube.wait_for(
        lambda: kube.get("pods", "other", "default")["spec"].get("nodeName") == "gpu-0",
        message="the freed GPUs go to the Pending pod",
    )
    assert _phases(kube, "a") == (0, 0)
    # The Deployment's pods go with it (garbage collection by ownerReferences).
    kube.patch("deployments.apps", "a", {"spec": {"replicas": 2}}, "default")
    kube.wait_for(lambda: _phases(kube, "a") == (1, 1), message="gpu-2's unit taken, 1 Pending")
    kube.delete("deployments.apps", "a", "default")
    assert _pods(kube, "a") == []


def test_mig_and_domestic_resources_cpu_and_selectors(kube: Kube) -> None:
    kube.call(kube.emulator.enable_workloads)
    kube.apply([node("mig-0", "h100-mig", 7), node("ascend-0", "ascend", 8, extra={"cpu": "4"})])
    kube.apply(
        _deployment(
            "mig", 3, {"nvidia.com/mig-3g.40gb": "2"}, tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}]
        )
    )
    kube.apply(
        _deployment("npu", 3, {"huawei.com/Ascend910": "1", "cpu": "2"}, selector={"accelerator": "huawei-Ascend910"})
    )
    kube.wait_for(lambda: _phases(kube, "mig") == (3, 0) and _phases(kube, "npu") == (2, 1), message="bound by units")
    msg = next(p for p in _pods(kube, "npu") if not p["spec"].get("nodeName"))["status"]["conditions"][0]["message"]
    assert msg == "0/2 nodes are available: 1 Insufficient cpu, 1 node(s) didn't match Pod's node affinity/selector."
    kube.patch("deployments.apps", "mig", {"spec": {"replicas": 4}}, "default")
    kube.wait_for(lambda: _phases(kube, "mig") == (3, 1), message="7 slices hold 3 pods of 2")
