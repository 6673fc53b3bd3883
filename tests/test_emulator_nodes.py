"""Node lifecycle in the emulator (tests/support/k8s/workloads/nodes.py, podgc.py, admission.py): a cordon taints
the node and keeps its pods; NotReady/Unknown taint it NoExecute and mark its pods not ready; pods go after their
tolerationSeconds (300 s from the DefaultTolerationSeconds admission plugin) on the emulator's clock, at once
without a toleration; the Deployment controller replaces them; pods of a deleted node are collected."""

from __future__ import annotations

from tests.kube.cluster import node
from tests.support.k8s_fixtures import Kube
from tests.test_emulator_rollout import deployment, pods, ready

NOT_READY = "node.kubernetes.io/not-ready"
UNREACHABLE = "node.kubernetes.io/unreachable"


def taints(kube: Kube, name: str) -> set[tuple[str, str]]:
    return {(t["key"], t["effect"]) for t in (kube.get("nodes", name)["spec"].get("taints") or [])}


def placed(kube: Kube, app: str) -> list[str]:
    return sorted(p["spec"].get("nodeName") or "-" for p in pods(kube, app))


def all_ready(kube: Kube, app: str, n: int) -> bool:
    ps = pods(kube, app)
    return len(ps) == n and all(ready(p) for p in ps)


def test_cordon_taints_the_node_keeps_its_pods_and_places_nothing_new_there(kube: Kube) -> None:
    kube.call(kube.emulator.enable_workloads)
    kube.apply([node("a", "cpu", 4), node("b", "cpu", 8)])
    kube.apply(deployment("web", 2))
    kube.wait_for(
        lambda: placed(kube, "web") == ["a", "a"] and all_ready(kube, "web", 2), message="both on a (fullest)"
    )
    before = {p["metadata"]["name"] for p in pods(kube, "web")}
    kube.cordon("a")
    assert kube.get("nodes", "a")["spec"]["unschedulable"] is True
    assert taints(kube, "a") == {("node.kubernetes.io/unschedulable", "NoSchedule")}
    assert {p["metadata"]["name"] for p in pods(kube, "web")} == before and all_ready(kube, "web", 2)
    kube.patch("deployments.apps", "web", {"spec": {"replicas": 3}}, "default")
    kube.wait_for(lambda: placed(kube, "web") == ["a", "a", "b"], message="the new pod on b, though a has room")
    kube.uncordon("a")
    assert taints(kube, "a") == set() and not kube.get("nodes", "a")["spec"].get("unschedulable")
    kube.patch("deployments.apps", "web", {"spec": {"replicas": 4}}, "default")
    kube.wait_for(lambda: placed(kube, "web") == ["a", "a", "a", "b"], message="a takes pods again")
    # A pod that tolerates the cordon's taint (as DaemonSet pods do) is still placed on a cordoned node.
    kube.cordon("b")
    tolerant = deployment("ds", 1)
    tolerant["spec"]["template"]["spec"]["tolerations"] = [
        {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"}
    ]
    tolerant["spec"]["template"]["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "b"}
    kube.apply(tolerant)
    kube.wait_for(lambda: placed(kube, "ds") == ["b"], message="the tolerating pod on cordoned b")


def test_not_ready_taints_the_node_and_evicts_its_pods_after_their_toleration_seconds(kube: Kube) -> None:
    wl = kube.call(kube.emulator.enable_workloads)
    kube.apply([node("a", "cpu", 2), node("b", "cpu", 8)])
    kube.apply(deployment("web", 2))
    kube.wait_for(lambda: placed(kube, "web") == ["a", "a"] and all_ready(kube, "web", 2), message="both on a")
    tolerations = pods(kube, "web")[0]["spec"]["tolerations"]
    assert {(t["key"], t["effect"], t["tolerationSeconds"]) for t in tolerations} == {
        (NOT_READY, "NoExecute", 300),
        (UNREACHABLE, "NoExecute", 300),
    }, "DefaultTolerationSeconds"
    before = {p["metadata"]["name"] for p in pods(kube, "web")}

    kube.set_node_ready("a", "False")
    assert taints(kube, "a") == {(NOT_READY, "NoSchedule"), (NOT_READY, "NoExecute")}
    assert all(t.get("timeAdded") for t in kube.get("nodes", "a")["spec"]["taints"] if t["effect"] == "NoExecute")
    assert {p["metadata"]["name"] for p in pods(kube, "web")} == before, "tolerated for 300 s"
    assert not any(ready(p) for p in pods(kube, "web")), "pods of a NotReady node are not ready"
    assert "readyReplicas" not in kube.get("deployments.apps", "web", "default")["status"]
    kube.advance(299)
    assert {p["metadata"]["name"] for p in pods(kube, "web")} == before
    kube.advance(2)
    assert not before & {p["metadata"]["name"] for p in pods(kube, "web")}, "evicted after 300 s"
    assert sorted(wl.taint_evictions) == sorted(f"default/{n}" for n in before)
    kube.wait_for(lambda: placed(kube, "web") == ["b", "b"] and all_ready(kube, "web", 2), message="replaced on b")

    kube.set_node_ready("a", "True")
    assert taints(kube, "a") == set()
    kube.set_node_ready("a", "Unknown")
    assert taints(kube, "a") == {(UNREACHABLE, "NoSchedule"), (UNREACHABLE, "NoExecute")}


def test_own_tolerations_decide_when_pods_go_and_recovery_cancels_the_eviction(kube: Kube) -> None:
    kube.call(kube.emulator.enable_workloads)
    kube.apply([node("a", "cpu", 8), node("b", "cpu", 8)])
    for name, seconds in (("now", 0), ("later", 600), ("never", None)):
        doc = deployment(name, 1)
        tol = {"key": NOT_READY, "operator": "Exists", "effect": "NoExecute"}
        if seconds is not None:
            tol["tolerationSeconds"] = seconds
        doc["spec"]["template"]["spec"]["tolerations"] = [tol]
        doc["spec"]["template"]["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "a"}
        kube.apply(doc)
    kube.wait_for(lambda: all(all_ready(kube, n, 1) for n in ("now", "later", "never")), message="all on a")
    first = {n: pods(kube, n)[0]["metadata"]["name"] for n in ("now", "later", "never")}
    kube.set_node_ready("a", "False")
    assert pods(kube, "now")[0]["metadata"]["name"] != first["now"], "tolerationSeconds 0: evicted at once"
    kube.advance(400)
    kube.set_node_ready("a", "True")
    kube.advance(400)
    assert pods(kube, "later")[0]["metadata"]["name"] == first["later"], "the node recovered: eviction cancelled"
    kube.set_node_ready("a", "False")
    kube.advance(599)
    assert pods(kube, "later")[0]["metadata"]["name"] == first["later"], "the 600 s count again from the new taint"
    kube.advance(2)
    assert pods(kube, "later")[0]["metadata"]["name"] != first["later"]
    kube.advance(10_000)
    assert pods(kube, "never")[0]["metadata"]["name"] == first["never"], "no tolerationSeconds: tolerated for ever"
    # An admin's NoExecute taint nobody tolerates evicts at once (the replacement is Pending: a is the only choice).
    kube.patch("nodes", "a", {"spec": {"taints": [{"key": "maintenance", "effect": "NoExecute"}]}})
    assert pods(kube, "never")[0]["metadata"]["name"] != first["never"]
    assert not pods(kube, "never")[0]["spec"].get("nodeName")


def test_evictions_come_due_on_the_clock_without_advancing_it(kube: Kube) -> None:
    kube.call(kube.emulator.enable_workloads)
    kube.apply([node("a", "cpu", 8), node("b", "cpu", 1)])
    doc = deployment("quick", 1)
    doc["spec"]["template"]["spec"]["tolerations"] = [
        {"key": UNREACHABLE, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 1}
    ]
    doc["spec"]["template"]["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "a"}
    kube.apply(doc)
    kube.wait_for(lambda: all_ready(kube, "quick", 1), message="running on a")
    first = pods(kube, "quick")[0]["metadata"]["name"]
    kube.set_node_ready("a", "Unknown")
    assert pods(kube, "quick")[0]["metadata"]["name"] == first
    kube.wait_for(
        lambda: pods(kube, "quick")[0]["metadata"]["name"] != first,
        timeout=15,
        message="the emulator's timer evicts after 1 s of real time",
    )


def test_pods_of_a_deleted_node_are_collected_after_the_quarantine(kube: Kube) -> None:
    kube.call(kube.emulator.enable_workloads)
    kube.apply([node("a", "cpu", 2), node("b", "cpu", 2)])
    kube.apply(deployment("web", 2))
    kube.wait_for(lambda: placed(kube, "web") == ["a", "a"] and all_ready(kube, "web", 2), message="both on a")
    kube.delete("nodes", "a")
    kube.advance(39)
    assert placed(kube, "web") == ["a", "a"], "kept for the 40 s quarantine"
    kube.advance(2)
    kube.wait_for(lambda: placed(kube, "web") == ["b", "b"], message="collected and replaced on b")
