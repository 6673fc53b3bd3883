"""Capacity that cannot be double-booked (issue 17): Pending pods and other plans' unbound replicas are not free."""

from __future__ import annotations

import copy

from pdfleet_operator.decide import inventory, placement
from tests.kube.cluster import classes, example_deployments, node, pod, spec_of

CLASSES = classes()
L40S = CLASSES["l40s-48gb"]
GPU_TOL = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def qwen(n: int):
    doc = copy.deepcopy(example_deployments()["qwen2-7b"])
    doc["spec"]["colocated"].update(minReplicas=n, maxReplicas=n)
    return spec_of(doc)


def gpu_pod(
    name: str,
    units: int,
    *,
    node_name: str | None = None,
    labels: dict | None = None,
    tolerations: list | None = None,
    selector: dict | None = None,
    created: str = "2026-01-01T00:00:00Z",
) -> dict:
    p = pod(name, node_name, {"nvidia.com/gpu": str(units)}, labels=labels)
    p["metadata"]["creationTimestamp"] = created
    if tolerations is not None:
        p["spec"]["tolerations"] = tolerations
    if selector is not None:
        p["spec"]["nodeSelector"] = selector
    return p


def test_a_pending_pod_holds_what_it_will_take() -> None:
    nodes = [node("l40s-0", "l40s", 3)]
    waiting = gpu_pod("train", 2, tolerations=GPU_TOL)
    inv = inventory.build(nodes, [waiting])
    assert inv.free_units(L40S) == 1
    assert any("held by pods not bound yet: 2 x nvidia.com/gpu (pod default/train (Pending))" in n for n in inv.notes)
    plan = placement.plan(qwen(2), CLASSES, inv)
    (short,) = plan.shortfalls
    assert (short.accelerator_class, short.missing_units) == ("l40s-48gb", 1)
    # A Pending pod that cannot land there (a taint it does not tolerate, another selector) holds nothing there.
    assert inventory.build(nodes, [gpu_pod("train", 2)]).free_units(L40S) == 3
    assert inventory.build(nodes, [gpu_pod("t", 2, tolerations=GPU_TOL, selector={"x": "y"})]).free_units(L40S) == 3
    # ... nor does one that fits nowhere now (it waits for capacity that frees later).
    inv = inventory.build(nodes, [gpu_pod("big", 4, tolerations=GPU_TOL)])
    assert inv.free_units(L40S) == 3
    assert any("waiting for capacity that is not free now: pod default/big (Pending)" in n for n in inv.notes)


def test_node_affinity_of_a_pending_pod() -> None:
    nodes = [node("l40s-0", "l40s", 2), node("l40s-1", "l40s", 2, extra={})]
    nodes[1]["metadata"]["labels"]["zone"] = "b"
    p = gpu_pod("z", 2, tolerations=GPU_TOL)
    p["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}]
            }
        }
    }
    inv = inventory.build(nodes, [p])
    assert {n.name: n.free["nvidia.com/gpu"] for n in inv.nodes} == {"l40s-0": 2, "l40s-1": 0}


def test_another_plan_reserves_its_replicas_until_their_pods_exist() -> None:
    nodes = [node("l40s-0", "l40s", 3)]
    mine = inventory.Reservation("default", "alpha", "colocated", "l40s-48gb", L40S, 2)
    inv = inventory.build(nodes, [], reserved=[mine], exclude_deployment=("default", "beta"))
    assert inv.free_units(L40S) == 1
    assert any(
        "2 planned replicas on l40s-48gb of 1 other deployment (default/alpha 2 colocated)" in n for n in inv.notes
    )
    # Its own reservation never counts against the deployment being re-planned.
    assert inventory.build(nodes, [], reserved=[mine], exclude_deployment=("default", "alpha")).free_units(L40S) == 3

    labels = {"pdfleet.io/deployment": "alpha", "pdfleet.io/role": "colocated", "pdfleet.io/accelerator": "l40s-48gb"}
    bound = gpu_pod("alpha-1", 1, node_name="l40s-0", labels=labels)
    waiting = gpu_pod("alpha-2", 1, labels=labels, tolerations=GPU_TOL)
    # One pod bound, one Pending: each counted once (the plan's 2 replicas minus its 2 pods leave none unborn).
    inv = inventory.build(nodes, [bound, waiting], reserved=[mine], exclude_deployment=("default", "beta"))
    assert inv.free_units(L40S) == 1
    # One bound and none created yet for the second: still 2 held.
    assert (
        inventory.build(nodes, [bound], reserved=[mine], exclude_deployment=("default", "beta")).free_units(L40S) == 1
    )
    # A plan that shrank holds only what it plans (its extra pods are counted where they are).
    fewer = inventory.Reservation("default", "alpha", "colocated", "l40s-48gb", L40S, 1)
    assert (
        inventory.build(nodes, [bound], reserved=[fewer], exclude_deployment=("default", "beta")).free_units(L40S) == 2
    )


def test_claims_fill_the_fullest_node_and_keep_big_blocks() -> None:
    nodes = [node("l40s-0", "l40s", 4), node("l40s-1", "l40s", 1)]
    inv = inventory.build(nodes, [gpu_pod("one", 1, tolerations=GPU_TOL)])
    assert {n.name: n.free["nvidia.com/gpu"] for n in inv.nodes} == {"l40s-0": 4, "l40s-1": 0}


def test_mig_and_domestic_classes() -> None:
    mig = CLASSES["h100-mig-3g-40gb"]
    ascend = CLASSES["ascend-910b"]
    nodes = [node("mig-0", "h100-mig", 4), node("ascend-0", "ascend", 8)]
    reserved = [
        inventory.Reservation("ns", "x", "decode", "h100-mig-3g-40gb", mig, 3),
        inventory.Reservation("ns", "x", "prefill", "ascend-910b", ascend, 5),
    ]
    inv = inventory.build(nodes, [], reserved=reserved)
    assert (inv.free_units(mig), inv.free_units(ascend)) == (1, 8 - 5 * ascend.count)
