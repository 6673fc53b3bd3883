"""Day 2 on a cluster that behaves like one (issue 24): the operator through kopf, on the emulator with its scheduler,
Deployment/ReplicaSet, node-lifecycle and disruption controllers on. A cordon, a NotReady node, a deleted class, a
cheaper class on the same full hardware, a rollout with no room and a restart: none of them takes a pool that
serves down to zero ready replicas, and none deletes it."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pdfleet_operator.api import names
from tests.kube.cluster import example_deployments, node
from tests.kube.harness import children, events, prepare_cluster, running_operator, settle, wait_reconciled

NAME = "qwen2-7b"
POOL = f"{NAME}-colocated-l40s-48gb"


def qwen(classes: list[str] | None = None, **spec: Any) -> dict:
    doc = copy.deepcopy(example_deployments()[NAME])
    doc["spec"]["colocated"]["acceleratorClasses"] = classes or ["l40s-48gb"]
    doc["spec"]["autoscaling"] = {"enabled": False}
    doc["spec"].update(spec)
    return doc


def deployment_deletes(kube) -> list[str]:
    return [w.name for w in kube.writes("deployments") if w.verb == "delete"]


def ready(kube, name: str) -> int:
    obj = kube.get("deployments.apps", name)
    return int(((obj or {}).get("status") or {}).get("readyReplicas") or 0)


def condition(kube, type_: str) -> dict:
    cr = kube.get("infdep", NAME)
    return next(c for c in cr["status"]["conditions"] if c["type"] == type_)


def serving(kube) -> dict[str, int]:
    """Ready replicas per worker pool of the deployment, from the Deployments' status."""
    return {
        k.split("/", 1)[1]: int((v.get("status") or {}).get("readyReplicas") or 0)
        for k, v in children(kube, NAME).items()
        if k.startswith("Deployment/") and v["metadata"]["labels"].get(names.LABEL_ROLE) != names.ROUTER_ROLE
    }


def start(kube, doc: dict, nodes: list[dict]) -> Any:
    prepare_cluster(kube, nodes=nodes)
    wl = kube.call(kube.emulator.enable_workloads)
    return wl


def test_a_cordon_keeps_the_pool_and_a_drain_waits_for_its_replacement(kube) -> None:
    start(kube, qwen(), [node("l40s-0", "l40s", 4), node("cpu-0", "cpu", 32)])
    with running_operator(kube):
        kube.apply(qwen())
        kube.wait_for(lambda: ready(kube, POOL) == 1, message="the pool serving")
        settle(kube)
        kube.cordon("l40s-0")
        kube.wait_for(lambda: condition(kube, "PlacementDrift")["status"] == "True", message="PlacementDrift")
        settle(kube)
        assert condition(kube, "PlacementDrift")["reason"] == "NodeCordoned"
        assert "no free capacity for a replacement" in condition(kube, "PlacementDrift")["message"]
        assert ready(kube, POOL) == 1 and deployment_deletes(kube) == []
        # The PDB keeps the role's only replica until a replacement serves: a drain cannot take it now.
        with pytest.raises(Exception, match="429|disruption"):
            pod = next(
                p for p in kube.list("pods", "default") if p["metadata"]["labels"].get(names.LABEL_ROLE) == "colocated"
            )
            kube.evict(pod["metadata"]["name"])
        # New capacity: the replacement starts elsewhere while the cordoned replica serves; then the drain goes.
        kube.apply(node("l40s-1", "l40s", 4))
        kube.wait_for(lambda: ready(kube, POOL) == 2, message="the replacement serving beside the cordoned replica")
        kube.drain("l40s-0", timeout=60)
        kube.wait_for(
            lambda: kube.get("deployments.apps", POOL)["spec"]["replicas"] == 1 and ready(kube, POOL) == 1,
            timeout=30,
            message="back to one replica, on the healthy node",
        )
        settle(kube)
        assert deployment_deletes(kube) == []
        pods = [p for p in kube.list("pods", "default") if p["metadata"]["labels"].get(names.LABEL_ROLE) == "colocated"]
        assert [p["spec"]["nodeName"] for p in pods] == ["l40s-1"]
        kube.wait_for(lambda: condition(kube, "PlacementDrift")["status"] == "False", message="drift cleared")


def test_a_kubelet_blip_deletes_nothing(kube) -> None:
    start(kube, qwen(), [node("l40s-0", "l40s", 4), node("cpu-0", "cpu", 32)])
    with running_operator(kube):
        kube.apply(qwen())
        kube.wait_for(lambda: ready(kube, POOL) == 1, message="the pool serving")
        settle(kube)
        kube.clear_requests()
        kube.set_node_ready("l40s-0", "False")
        kube.wait_for(lambda: condition(kube, "PlacementDrift")["reason"] == "NodeNotReady", message="NodeNotReady")
        kube.set_node_ready("l40s-0", "True")
        kube.wait_for(lambda: condition(kube, "PlacementDrift")["status"] == "False", message="drift cleared")
        kube.wait_for(lambda: ready(kube, POOL) == 1, message="serving again")
        settle(kube)
        assert deployment_deletes(kube) == []
        assert kube.get("deployments.apps", POOL)["spec"]["replicas"] == 1


def test_a_deleted_class_is_held_until_its_pools_have_moved(kube) -> None:
    doc = qwen(["l40s-48gb", "a100-80gb"])
    start(kube, doc, [node("l40s-0", "l40s", 4), node("a100-0", "a100", 1), node("cpu-0", "cpu", 32)])
    with running_operator(kube, class_status_interval=0.2):
        kube.apply(doc)
        kube.wait_for(
            lambda: serving(kube) == {POOL: 1} or serving(kube).get(f"{NAME}-colocated-a100-80gb") == 1,
            message="the pool serving",
        )
        settle(kube)
        first = next(iter(serving(kube)))
        used = first.rsplit("-colocated-", 1)[1]
        other = "a100-80gb" if used == "l40s-48gb" else "l40s-48gb"
        cls = kube.get("acc", used)
        assert names.FINALIZER_CLASS_IN_USE in cls["metadata"]["finalizers"]
        kube.wait_for(
            lambda: kube.get("acc", used).get("status", {}).get("usedBy") == [f"default/{NAME} colocated"],
            message="the class status naming its user",
        )
        kube.delete("acc", used)
        # Held: it still exists (being deleted) while its pool hands over to the other class.
        kube.wait_for(lambda: serving(kube).get(f"{NAME}-colocated-{other}") == 1, message="the replacement serving")
        kube.wait_for(lambda: kube.get("acc", used) is None, timeout=30, message="the class gone once unused")
        settle(kube)
        assert serving(kube) == {f"{NAME}-colocated-{other}": 1}
        assert deployment_deletes(kube) == [first]
        drift = [e for e in events(kube, NAME) if e["reason"] == "PlacementDrift"]
        assert drift and "being deleted" in drift[0]["message"]


def test_a_single_full_pool_never_rolls_to_zero_ready(kube) -> None:
    start(kube, qwen(), [node("l40s-0", "l40s", 1), node("cpu-0", "cpu", 32)])
    with running_operator(kube):
        kube.apply(qwen())
        kube.wait_for(lambda: ready(kube, POOL) == 1, message="the pool serving")
        settle(kube)
        before = kube.get("deployments.apps", POOL)["spec"]["template"]
        kube.patch("infdep", NAME, {"spec": {"engine": {"image": "registry.example/pdfleet-worker:v2"}}})
        kube.wait_for(lambda: condition(kube, "RolloutBlocked")["status"] == "True", message="RolloutBlocked")
        settle(kube)
        assert condition(kube, "RolloutBlocked")["reason"] == "NoCapacityForSurge"
        assert kube.get("deployments.apps", POOL)["spec"]["template"] == before, "the old template keeps serving"
        assert ready(kube, POOL) == 1
        # Room for a surge replica: the rollout goes, the pool never below one ready.
        kube.apply(node("l40s-1", "l40s", 1))
        kube.wait_for(lambda: condition(kube, "RolloutBlocked")["status"] == "False", message="rollout released")
        kube.wait_for(
            lambda: kube.get("deployments.apps", POOL)["status"].get("updatedReplicas") == 1 and ready(kube, POOL) == 1,
            timeout=30,
            message="rolled",
        )
        image = kube.get("deployments.apps", POOL)["spec"]["template"]["spec"]["containers"][0]["image"]
        assert image == "registry.example/pdfleet-worker:v2"


def test_a_move_to_a_cheaper_class_on_the_same_full_hardware_never_deadlocks(kube) -> None:
    spot = copy.deepcopy(next(d for d in _classes() if d["metadata"]["name"] == "l40s-48gb"))
    spot["metadata"] = {"name": "l40s-spot"}
    spot["spec"]["costPerHour"] = 5.0
    doc = qwen(["l40s-48gb", "l40s-spot"], autoscaling={"enabled": True})  # (no autoscaler loop: sizes stay put)
    doc["spec"]["colocated"].update(minReplicas=2, maxReplicas=2)
    wl = start(kube, doc, [node("l40s-0", "l40s", 2), node("cpu-0", "cpu", 32)])
    kube.apply(spot)
    with running_operator(kube):
        kube.apply(doc)
        kube.wait_for(lambda: serving(kube) == {POOL: 2}, message="two replicas serving on l40s-48gb")
        settle(kube)
        mark = kube.resource_version
        # Stays at its minimum: moving one would take the role below it, so the pool stays and says why.
        kube.patch("acc", "l40s-spot", {"spec": {"costPerHour": 0.5}})
        kube.wait_for(lambda: condition(kube, "PlacementDrift")["status"] == "True", message="drift")
        settle(kube)
        assert serving(kube) == {POOL: 2} and "minimum" in condition(kube, "PlacementDrift")["message"]
        # With a minimum of 1 (the role still sized 2: the last plan's target) the move goes one replica at a time.
        kube.patch("infdep", NAME, {"spec": {"colocated": {"minReplicas": 1}}})
        kube.wait_for(
            lambda: serving(kube) == {f"{NAME}-colocated-l40s-spot": 2},
            timeout=60,
            message="the role moved to l40s-spot",
        )
        settle(kube)
        history = _ready_history(kube, mark)
        assert history and min(history) >= 1, f"the role never dropped to 0 ready: {history}"
        # Each move asks for its replacement with the release, so it may wait Pending for those units (or bind at
        # once when the old pod is already gone): at most one per move, never two at once.
        assert _max_pending(kube, mark) <= 1
        assert len([p for p in wl.unschedulable_pods if "colocated" in p]) <= 2


def _classes() -> list[dict]:
    from tests.kube.cluster import class_objects

    return class_objects()


def _max_pending(kube, since: int) -> int:
    """The most worker pods of the deployment unbound at once after resourceVersion `since` (event history)."""
    unbound: set[str] = set()
    most = 0
    for e in kube.call(lambda: list(kube.emulator._events)):
        labels = e.obj["metadata"].get("labels") or {}
        if (
            e.plural != "pods"
            or labels.get(names.LABEL_DEPLOYMENT) != NAME
            or labels.get(names.LABEL_ROLE) != "colocated"
        ):
            continue
        name = e.obj["metadata"]["name"]
        if e.type != "DELETED" and not (e.obj.get("spec") or {}).get("nodeName"):
            unbound.add(name)
        else:
            unbound.discard(name)
        if e.rv > since:
            most = max(most, len(unbound))
    return most


def _ready_history(kube, since: int = 0) -> list[int]:
    """The role's ready replicas after every change of one of its Deployments (the emulator's event history, which
    holds the controllers' status writes too), from resourceVersion `since`."""
    totals: dict[str, int] = {}
    history = []
    for e in kube.call(lambda: list(kube.emulator._events)):
        labels = e.obj["metadata"].get("labels") or {}
        if (
            e.plural != "deployments"
            or labels.get(names.LABEL_DEPLOYMENT) != NAME
            or labels.get(names.LABEL_ROLE) != "colocated"
        ):
            continue
        totals[e.obj["metadata"]["name"]] = (
            0 if e.type == "DELETED" else int((e.obj.get("status") or {}).get("readyReplicas") or 0)
        )
        if e.rv > since:
            history.append(sum(totals.values()))
    return history


def test_after_a_restart_capacity_held_by_deployments_without_pods_is_counted(kube) -> None:
    """Rule 7: a Deployment whose pods do not exist yet (its controller lags) still holds what it asks for; a
    restarted operator, which remembers no plan, must not give those accelerators to another deployment."""
    prepare_cluster(kube, nodes=[node("l40s-0", "l40s", 2), node("cpu-0", "cpu", 32)])  # (no controllers: no pods)
    first = qwen()
    first["spec"]["colocated"].update(minReplicas=2, maxReplicas=2)
    with running_operator(kube):
        kube.apply(first)
        wait_reconciled(kube, NAME)
        settle(kube)
    assert kube.get("deployments.apps", POOL)["spec"]["replicas"] == 2
    # The first deployment's spec is edited into one this operator refuses (a hostPath model outside the allowed
    # prefixes): it is never planned again, but its Deployment stays and will hold its 2 GPUs.
    kube.patch("infdep", NAME, {"spec": {"model": {"source": {"pvc": None, "hostPath": {"path": "/srv/models/x"}}}}})
    second = qwen()
    second["metadata"]["name"] = "late"
    with running_operator(kube):
        kube.apply(second)
        cr = wait_reconciled(kube, "late")
        settle(kube)
        limited = next(c for c in cr["status"]["conditions"] if c["type"] == "ScalingLimited")
        assert limited["status"] == "True" and limited["reason"] == "InsufficientCapacity", limited
        assert "free before planning: l40s-48gb=0" in limited["message"], limited  # the 2 units the first one holds
        assert kube.get("deployments.apps", "late-colocated-l40s-48gb") is None
