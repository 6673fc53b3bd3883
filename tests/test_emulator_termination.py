"""Graceful pod termination in the emulator (opt-in ``graceful_termination``; tests/support/k8s/store.py and
workloads/kubelet.py): a deleted pod of a node keeps ``deletionTimestamp`` for its grace period, not ready and
holding its node's resources, then goes; off (the default), deleted pods go at once as they always did."""

from __future__ import annotations

import httpx

from tests.kube.cluster import node
from tests.support.k8s_fixtures import Kube
from tests.test_emulator_rollout import deployment, pods, ready


def listed(kube: Kube, app: str) -> list[dict]:
    return kube.list("pods", "default", label_selector=f"app={app}")


def test_deleted_pods_go_at_once_by_default(kube: Kube) -> None:
    kube.call(kube.emulator.enable_workloads)
    kube.apply(node("a", "cpu", 1))
    kube.apply(deployment("web", 1))
    kube.wait_for(lambda: len(pods(kube, "web")) == 1 and ready(pods(kube, "web")[0]), message="running")
    name = pods(kube, "web")[0]["metadata"]["name"]
    kube.delete("pods", name, "default")
    assert kube.get("pods", name, "default") is None
    kube.wait_for(lambda: len(pods(kube, "web")) == 1 and ready(pods(kube, "web")[0]), message="replaced at once")


def test_a_terminating_pod_holds_its_node_for_its_grace_period(kube: Kube) -> None:
    kube.call(kube.emulator.enable_workloads, graceful_termination=True)
    kube.apply(node("a", "cpu", 1))
    doc = deployment("web", 1)
    doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 45
    kube.apply(doc)
    kube.wait_for(lambda: len(pods(kube, "web")) == 1 and ready(pods(kube, "web")[0]), message="running")
    name = pods(kube, "web")[0]["metadata"]["name"]
    gone = httpx.delete(f"{kube.url}/api/v1/namespaces/default/pods/{name}")
    assert gone.status_code == 200 and gone.json()["metadata"]["deletionGracePeriodSeconds"] == 45
    old = kube.get("pods", name, "default")
    assert old["metadata"]["deletionTimestamp"] and old["spec"]["nodeName"] == "a"
    assert not ready(old), "a terminating pod is not ready"
    # Its replacement exists at once, but the node's only cpu is still held by the terminating pod.
    kube.wait_for(lambda: len(pods(kube, "web")) == 1, message="the replacement")
    replacement = pods(kube, "web")[0]
    assert not replacement["spec"].get("nodeName")
    assert "Insufficient cpu" in replacement["status"]["conditions"][0]["message"]
    st = kube.get("deployments.apps", "web", "default")["status"]
    assert (st["replicas"], st.get("readyReplicas"), st.get("availableReplicas")) == (1, None, None), st
    kube.advance(44)
    assert kube.get("pods", name, "default") is not None
    kube.advance(2)
    assert kube.get("pods", name, "default") is None
    kube.wait_for(lambda: ready(pods(kube, "web")[0]), message="the replacement binds once the pod is gone")

    # A shorter grace period brings the end forward; 0 deletes at once.
    name = pods(kube, "web")[0]["metadata"]["name"]
    kube.delete("pods", name, "default")
    httpx.delete(f"{kube.url}/api/v1/namespaces/default/pods/{name}", params={"gracePeriodSeconds": "5"})
    assert kube.get("pods", name, "default")["metadata"]["deletionGracePeriodSeconds"] == 5
    kube.advance(6)
    assert kube.get("pods", name, "default") is None
    kube.wait_for(lambda: len(pods(kube, "web")) == 1 and pods(kube, "web")[0]["spec"].get("nodeName"), message="bound")
    name = pods(kube, "web")[0]["metadata"]["name"]
    httpx.delete(f"{kube.url}/api/v1/namespaces/default/pods/{name}", params={"gracePeriodSeconds": "0"})
    assert kube.get("pods", name, "default") is None


def test_finalizers_hold_after_the_grace_period_and_unreachable_nodes_never_finish(kube: Kube) -> None:
    kube.call(kube.emulator.enable_workloads, graceful_termination=True)
    kube.apply([node("a", "cpu", 4), node("b", "cpu", 4)])
    doc = deployment("web", 2)
    doc["spec"]["template"]["metadata"]["finalizers"] = ["example.com/hold"]
    doc["spec"]["template"]["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "a"}
    kube.apply(doc)
    kube.wait_for(lambda: len(pods(kube, "web")) == 2 and all(ready(p) for p in pods(kube, "web")), message="running")
    held, lost = (p["metadata"]["name"] for p in pods(kube, "web"))
    kube.delete("pods", held, "default")
    kube.advance(31)
    meta = kube.get("pods", held, "default")["metadata"]
    assert meta["deletionGracePeriodSeconds"] == 0, "the grace period is over; the finalizer holds it"
    kube.patch("pods", held, {"metadata": {"finalizers": None}}, "default")
    assert kube.get("pods", held, "default") is None

    kube.set_node_ready("a", "Unknown")
    kube.delete("pods", lost, "default")
    kube.advance(3600)
    assert kube.get("pods", lost, "default")["metadata"]["deletionTimestamp"], "the kubelet cannot be reached"
    kube.set_node_ready("a", "True")
    kube.patch("pods", lost, {"metadata": {"finalizers": None}}, "default")
    assert kube.get("pods", lost, "default") is None
    assert all(p["metadata"]["name"] not in (held, lost) for p in listed(kube, "web"))
