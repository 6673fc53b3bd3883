"""Capacity that cannot be double-booked (issue 17): the operator against the emulator with its Deployment
controller and scheduler on (pods hold accelerators on nodes, or wait Pending)."""

from __future__ import annotations

import copy

import kmock
import yaml

from tests.kube.cluster import EXAMPLES, node, pod
from tests.kube.harness import prepare_cluster, running_operator, settle, wait_reconciled

QWEN = yaml.safe_load((EXAMPLES / "qwen2-7b.yaml").read_text())
GPU = "nvidia.com/gpu"


def fleet(name: str, replicas: int) -> dict:
    """qwen2-7b under another name, `replicas` colocated workers on l40s-48gb (one GPU each), no autoscaler."""
    doc = copy.deepcopy(QWEN)
    doc["metadata"]["name"] = name
    doc["spec"]["colocated"].update(minReplicas=replicas, maxReplicas=replicas)
    doc["spec"]["autoscaling"] = {"enabled": False}
    return doc


def workers(kube, name: str) -> list[dict]:
    return kube.list("pods", "default", label_selector=f"pdfleet.io/deployment={name},pdfleet.io/role=colocated")


def limited(cr: dict) -> dict:
    return next(c for c in cr["status"]["conditions"] if c["type"] == "ScalingLimited")


def pending(kube, names: list[str]) -> list[str]:
    return [p["metadata"]["name"] for n in names for p in workers(kube, n) if not p["spec"].get("nodeName")]


def unschedulable_workers(wl) -> list[str]:
    """Worker pods the emulator's scheduler ever had to leave Pending (a pile-up, however short)."""
    return sorted(p for p in wl.unschedulable_pods if "-router-" not in p)


def cluster(gpus: int) -> list[dict]:
    # The routers' pods need a node without the GPU taint.
    return [node("l40s-0", "l40s", gpus), node("cpu-0", "cpu", 16)]


def test_two_deployments_racing_for_the_last_gpus_never_pile_up_pending_pods(kube) -> None:
    prepare_cluster(kube, nodes=cluster(3))
    wl = kube.call(kube.emulator.enable_workloads)
    with running_operator(kube):
        # Both plan while the scheduler lags behind (their pods exist but are not bound yet): the second
        # must count the first one's planned, unbound replicas.
        kube.call(wl.hold)
        kube.apply([fleet("alpha", 2), fleet("beta", 2)])
        crs = {n: wait_reconciled(kube, n) for n in ("alpha", "beta")}
        # Decided before any pod binds: 3 GPUs, 2 + 1 replicas planned.
        assert sorted(sum(p["desired"] for p in cr["status"]["pools"]) for cr in crs.values()) == [1, 2], {
            n: (cr["status"]["pools"], limited(cr)) for n, cr in crs.items()
        }
        kube.call(wl.hold, False)
        settle(kube)
        crs = {n: wait_reconciled(kube, n) for n in ("alpha", "beta")}
        states = {n: limited(cr)["status"] for n, cr in crs.items()}
        assert sorted(states.values()) == ["False", "True"], {n: limited(cr) for n, cr in crs.items()}
        loser = next(n for n, s in states.items() if s == "True")
        winner = next(n for n in crs if n != loser)
        cond = limited(crs[loser])
        assert cond["reason"] == "InsufficientCapacity"
        assert f"missing 1 x {GPU} on l40s-48gb" in cond["message"], cond
        assert [p["desired"] for p in crs[loser]["status"]["pools"]] == [1]
        assert pending(kube, ["alpha", "beta"]) == []
        assert unschedulable_workers(wl) == []  # not even for a moment
        assert len(workers(kube, winner)) == 2 and len(workers(kube, loser)) == 1

        # The units free up: the loser gets them, and nothing waits Pending on the way.
        kube.delete("infdep", winner, "default")
        cr = wait_reconciled(kube, loser, check=lambda cr: limited(cr)["status"] == "False")
        assert [p["desired"] for p in cr["status"]["pools"]] == [2]
        kube.wait_for(
            lambda: len([p for p in workers(kube, loser) if p["spec"].get("nodeName")]) == 2,
            message=f"{loser}'s second worker bound",
        )
        settle(kube)
        assert pending(kube, [loser]) == []
        assert unschedulable_workers(wl) == []


def test_a_scale_up_and_a_new_deployment_share_the_last_units_then_a_new_node(kube) -> None:
    prepare_cluster(kube, nodes=cluster(4))
    wl = kube.call(kube.emulator.enable_workloads)
    with running_operator(kube):
        kube.apply(fleet("alpha", 2))
        wait_reconciled(kube, "alpha")
        kube.wait_for(
            lambda: len([p for p in workers(kube, "alpha") if p["spec"].get("nodeName")]) == 2,
            message="alpha's workers bound",
        )
        kube.call(wl.hold)
        grown = fleet("alpha", 3)
        kube.apply(grown)
        kube.apply(fleet("gamma", 2))
        crs = {n: wait_reconciled(kube, n, check=lambda cr: cr["status"].get("pools")) for n in ("alpha", "gamma")}
        assert sum(p["desired"] for cr in crs.values() for p in cr["status"]["pools"]) == 4, {
            n: (cr["status"]["pools"], limited(cr)) for n, cr in crs.items()
        }
        kube.call(wl.hold, False)
        settle(kube)
        crs = {n: wait_reconciled(kube, n) for n in ("alpha", "gamma")}
        placed = {n: sum(p["desired"] for p in cr["status"]["pools"]) for n, cr in crs.items()}
        assert placed["alpha"] + placed["gamma"] == 4, placed
        short = [n for n, cr in crs.items() if limited(cr)["status"] == "True"]
        assert len(short) == 1, {n: limited(cr) for n, cr in crs.items()}
        assert f"missing 1 x {GPU} on l40s-48gb" in limited(crs[short[0]])["message"]
        assert pending(kube, ["alpha", "gamma"]) == []
        assert unschedulable_workers(wl) == []

        kube.apply(node("l40s-1", "l40s", 4))
        wait_reconciled(kube, short[0], check=lambda cr: limited(cr)["status"] == "False")
        settle(kube)
        assert pending(kube, ["alpha", "gamma"]) == []
        assert sum(len(workers(kube, n)) for n in ("alpha", "gamma")) == 5
        assert unschedulable_workers(wl) == []


def test_a_namespaced_operator_counts_other_namespaces_pods_or_says_it_cannot(kube) -> None:
    prepare_cluster(kube, nodes=cluster(3))
    kube.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}} for ns in ("team-a", "training")])
    kube.call(kube.emulator.enable_workloads)
    # Another team's job holds 2 of the 3 GPUs, in a namespace the operator does not serve.
    job = pod("trainer", None, {GPU: "2"}, namespace="training")
    job["spec"]["tolerations"] = [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
    kube.apply(job)
    kube.wait_for(lambda: kube.get("pods", "trainer", "training")["spec"].get("nodeName"), message="the job bound")
    with running_operator(kube, namespaces=("team-a",)):
        doc = fleet("alpha", 2)
        doc["metadata"]["namespace"] = "team-a"
        kube.apply(doc)
        cr = wait_reconciled(kube, "alpha", namespace="team-a")
        cond = {c["type"]: c for c in cr["status"]["conditions"]}
        assert cond["CapacityVisible"]["status"] == "True", cond["CapacityVisible"]
        assert (
            cond["ScalingLimited"]["status"] == "True"
            and f"missing 1 x {GPU} on l40s-48gb" in cond["ScalingLimited"]["message"]
        )
        settle(kube)
        assert kube.list("pods", "team-a", label_selector="pdfleet.io/role=colocated")[0]["spec"].get("nodeName")
        assert not [p for p in kube.list("pods", "team-a") if not p["spec"].get("nodeName")]


def test_a_namespaced_operator_that_may_not_list_pods_elsewhere_says_so(kube) -> None:
    prepare_cluster(kube, nodes=cluster(3))
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}})
    (
        kube.emulator["get", kmock.path("/api/v1/pods")]
        << 403
        << {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "reason": "Forbidden",
            "code": 403,
            "message": 'pods is forbidden: User "op" cannot list resource "pods"',
        }
    )
    with running_operator(kube, namespaces=("team-a",)):
        doc = fleet("alpha", 1)
        doc["metadata"]["namespace"] = "team-a"
        kube.apply(doc)
        cr = wait_reconciled(kube, "alpha", namespace="team-a")
        cond = {c["type"]: c for c in cr["status"]["conditions"]}["CapacityVisible"]
        assert (cond["status"], cond["reason"]) == ("False", "PodsForbidden")
        assert cond["message"].startswith("cannot list pods outside the watched namespaces (403 Forbidden")
        assert "count as free" in cond["message"]
