"""Capacity that cannot be double-booked (issue 17): the operator against the emulator with its Deployment
controller and scheduler on (pods hold accelerators on nodes, or wait Pending)."""

from __future__ import annotations

import copy

import yaml

from tests.kube.cluster import EXAMPLES, node
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
        assert sorted(sum(p["desired"] for p in cr["status"]["pools"]) for cr in crs.values()) == [1, 2], \
            {n: (cr["status"]["pools"], limited(cr)) for n, cr in crs.items()}
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
        kube.wait_for(lambda: len([p for p in workers(kube, loser) if p["spec"].get("nodeName")]) == 2,
                      message=f"{loser}'s second worker bound")
        settle(kube)
        assert pending(kube, [loser]) == []
        assert unschedulable_workers(wl) == []


def test_a_scale_up_and_a_new_deployment_share_the_last_units_then_a_new_node(kube) -> None:
    prepare_cluster(kube, nodes=cluster(4))
    wl = kube.call(kube.emulator.enable_workloads)
    with running_operator(kube):
        kube.apply(fleet("alpha", 2))
        wait_reconciled(kube, "alpha")
        kube.wait_for(lambda: len([p for p in workers(kube, "alpha") if p["spec"].get("nodeName")]) == 2,
                      message="alpha's workers bound")
        kube.call(wl.hold)
        grown = fleet("alpha", 3)
        kube.apply(grown)
        kube.apply(fleet("gamma", 2))
        crs = {n: wait_reconciled(kube, n, check=lambda cr: cr["status"].get("pools")) for n in ("alpha", "gamma")}
        assert sum(p["desired"] for cr in crs.values() for p in cr["status"]["pools"]) == 4, \
            {n: (cr["status"]["pools"], limited(cr)) for n, cr in crs.items()}
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
        cr = wait_reconciled(kube, short[0], check=lambda cr: limited(cr)["status"] == "False")
        settle(kube)
        assert pending(kube, ["alpha", "gamma"]) == []
        assert sum(len(workers(kube, n)) for n in ("alpha", "gamma")) == 5
        assert unschedulable_workers(wl) == []
