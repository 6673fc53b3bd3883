"""The reconcile chain (pure): issue 24's day-2 rules on a fresh deployment, a cordon, a NotReady node, a deleted
class, a move on full hardware and a rollout with no room, each decided in milliseconds without a cluster."""

from __future__ import annotations

import copy
import datetime as dt
from typing import Any

from pdfleet_operator.api import InferenceDeployment
from pdfleet_operator.decide import reconcile, transition
from pdfleet_operator.kube import render
from tests.kube.cluster import classes, example_deployments, node

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
CLASSES = classes()


def qwen(**spec: Any) -> InferenceDeployment:
    doc = copy.deepcopy(example_deployments()["qwen2-7b"])
    doc["metadata"].update(namespace="default", generation=spec.pop("generation", 1), uid="u1")
    doc["spec"].update(spec)
    return InferenceDeployment.model_validate(doc)


def observe(
    dep: InferenceDeployment,
    nodes: list[dict],
    children: list[dict] = (),
    pods: list[dict] = (),
    *,
    deleting: frozenset[str] = frozenset(),
    classes: dict | None = None,
    **inputs: Any,
) -> reconcile.Observed:
    return reconcile.Observed(
        dep=dep,
        uid="u1",
        resource_version="7",
        annotations={},
        classes=CLASSES if classes is None else classes,
        deleting=deleting,
        nodes=nodes,
        pods=list(pods),
        children=list(children),
        stored=[],
        served_record=None,
        reserved=[],
        inputs=reconcile.Inputs(**inputs),
        now=T0,
        token_secret="qwen2-7b-auth",
    )


def decide(obs: reconcile.Observed) -> reconcile.Desired:
    owner = render.Owner(obs.key[1], obs.key[0], obs.uid)

    def run(spec, plan, revision, surge):
        return render.render(owner, spec, plan, obs.classes, revision=revision, surge=surge)

    return reconcile.decide(obs, run)


def live(desired: reconcile.Desired, ready: dict[str, int] | None = None) -> list[dict]:
    """The children as the API server would hold them once applied, with each Deployment's ready count."""
    out = []
    for obj in desired.objects:
        obj = copy.deepcopy(obj)
        obj["metadata"]["generation"] = 1
        if obj["kind"] == "Deployment":
            n = obj["spec"]["replicas"]
            r = n if ready is None else ready.get(obj["metadata"]["name"], n)
            obj["status"] = {"observedGeneration": 1, "replicas": n, "updatedReplicas": n, "readyReplicas": r}
        out.append(obj)
    return out


def pod_on(name: str, node_name: str, dep: str = "qwen2-7b", role: str = "colocated", acc: str = "l40s-48gb") -> dict:
    return {
        "metadata": {
            "namespace": "default",
            "name": name,
            "labels": {"pdfleet.io/deployment": dep, "pdfleet.io/role": role, "pdfleet.io/accelerator": acc},
        },
        "spec": {"nodeName": node_name, "containers": [{"resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
        "status": {"phase": "Running"},
    }


def pools(desired: reconcile.Desired) -> dict[str, int]:
    return {p.accelerator_class: p.replicas for p in desired.plan.pools}


def condition(desired: reconcile.Desired, type_: str) -> tuple[str, str, str]:
    c = next(c for c in desired.status.conditions if c.type == type_)
    return c.status, c.reason, c.message


def test_a_fresh_deployment_plans_renders_and_says_nothing_drifts() -> None:
    d = decide(observe(qwen(), [node("l40s-0", "l40s", 4)]))
    assert pools(d) == {"l40s-48gb": 1}
    assert {o["kind"] for o in d.objects} >= {"Deployment", "Service", "ConfigMap"}
    assert condition(d, "PlacementDrift")[:2] == ("False", "AsPlanned")
    assert d.status.token_secret == "qwen2-7b-auth"
    assert d.delete == ()


def test_a_cordoned_node_never_deletes_the_pool_that_serves_on_it() -> None:
    first = decide(observe(qwen(), [node("l40s-0", "l40s", 4)]))
    children = live(first)
    cordoned = [node("l40s-0", "l40s", 4, unschedulable=True)]
    d = decide(observe(qwen(), cordoned, children, [pod_on("p1", "l40s-0")]))
    assert pools(d) == {"l40s-48gb": 1}
    assert not d.delete
    assert condition(d, "PlacementDrift")[:2] == ("True", transition.NODE_CORDONED)
    assert "no free capacity for a replacement" in condition(d, "PlacementDrift")[2]
    # With room on another node the replacement starts while the cordoned replica serves.
    d = decide(observe(qwen(), cordoned + [node("l40s-1", "l40s", 4)], children, [pod_on("p1", "l40s-0")]))
    assert pools(d) == {"l40s-48gb": 2} and not d.delete


def test_a_kubelet_blip_keeps_the_pool() -> None:
    first = decide(observe(qwen(), [node("l40s-0", "l40s", 4)]))
    d = decide(
        observe(
            qwen(),
            [node("l40s-0", "l40s", 4, ready=False)],
            live(first, {"qwen2-7b-colocated-l40s-48gb": 0}),
            [pod_on("p1", "l40s-0")],
        )
    )
    assert pools(d) == {"l40s-48gb": 1} and not d.delete
    assert condition(d, "PlacementDrift")[1] == transition.NODE_NOT_READY


def test_a_deleted_class_keeps_its_pool_until_the_replacement_serves() -> None:
    dep = qwen(colocated={"acceleratorClasses": ["l40s-48gb", "a100-80gb"], "minReplicas": 1, "maxReplicas": 4})
    nodes = [node("l40s-0", "l40s", 4), node("a100-0", "a100", 8)]
    first = decide(observe(dep, nodes))
    assert pools(first) == {"a100-80gb": 1}
    pods = [pod_on("p1", "a100-0", acc="a100-80gb")]
    d = decide(observe(dep, nodes, live(first), pods, deleting=frozenset({"a100-80gb"})))
    assert pools(d) == {"a100-80gb": 1, "l40s-48gb": 1} and not d.delete
    assert condition(d, "PlacementDrift")[1] == transition.CLASS_DELETED
    d2 = decide(observe(dep, nodes, live(d), pods, deleting=frozenset({"a100-80gb"}), targets=dict(d.plan.targets)))
    assert pools(d2) == {"l40s-48gb": 1}
    assert d2.delete == ("Deployment/qwen2-7b-colocated-a100-80gb",)


def test_a_class_gone_entirely_leaves_its_pool_untouched() -> None:
    first = decide(observe(qwen(), [node("l40s-0", "l40s", 4)]))
    without = {k: v for k, v in CLASSES.items() if k != "l40s-48gb"}
    d = decide(observe(qwen(), [node("l40s-0", "l40s", 4)], live(first), [pod_on("p1", "l40s-0")], classes=without))
    assert d.untouched == ("Deployment/qwen2-7b-colocated-l40s-48gb",) and not d.delete
    assert condition(d, "PlacementDrift")[1] == transition.CLASS_MISSING


def test_a_move_on_the_same_full_hardware_goes_one_replica_at_a_time() -> None:
    # Two classes name the same L40S nodes; the cheaper one is added to the spec, the nodes are full.
    cheap = CLASSES["l40s-48gb"].model_copy(update={"cost_per_hour": 0.5})
    cls = {**CLASSES, "l40s-spot": cheap}
    dep = qwen(colocated={"acceleratorClasses": ["l40s-48gb", "l40s-spot"], "minReplicas": 1, "maxReplicas": 2})
    nodes = [node("l40s-0", "l40s", 2)]
    first = decide(observe(dep, nodes, classes=CLASSES, desired={"colocated": 2}))
    assert pools(first) == {"l40s-48gb": 2}
    children = live(first)
    held = [pod_on("p1", "l40s-0"), pod_on("p2", "l40s-0")]
    d = decide(observe(dep, nodes, children, held, classes=cls, desired={"colocated": 2}))
    assert pools(d) == {"l40s-48gb": 1, "l40s-spot": 1}, "one replica released for its replacement, asked for at once"
    assert d.step.released == (("colocated", "l40s-48gb"),)
    assert not d.delete
    # At the role's minimum nothing is broken to move: the pool stays where it is and the status says why.
    dep2 = qwen(colocated={"acceleratorClasses": ["l40s-48gb", "l40s-spot"], "minReplicas": 2, "maxReplicas": 2})
    d = decide(observe(dep2, nodes, children, held, classes=cls))
    assert pools(d) == {"l40s-48gb": 2}
    assert condition(d, "PlacementDrift")[:2] == ("True", transition.BETTER_PLACEMENT)
    assert "minimum" in condition(d, "PlacementDrift")[2]


def test_a_single_full_pool_never_rolls_to_zero_ready() -> None:
    nodes = [node("l40s-0", "l40s", 1)]
    first = decide(observe(qwen(), nodes))
    children = live(first)
    pods = [pod_on("p1", "l40s-0")]
    d = decide(observe(qwen(engine={"image": "worker:v2"}, generation=2), nodes, children, pods))
    assert condition(d, "RolloutBlocked")[:2] == ("True", "NoCapacityForSurge")
    pool = next(o for o in d.objects if o["metadata"]["name"] == "qwen2-7b-colocated-l40s-48gb")
    old = next(o for o in children if o["metadata"]["name"] == "qwen2-7b-colocated-l40s-48gb")
    assert pool["spec"]["template"] == old["spec"]["template"], "the template is held"
    # The spec allows a brief outage: it rolls.
    d = decide(
        observe(
            qwen(engine={"image": "worker:v2"}, rollout={"allowUnavailable": True}, generation=2), nodes, children, pods
        )
    )
    assert condition(d, "RolloutBlocked")[0] == "False"
    pool = next(o for o in d.objects if o["metadata"]["name"] == "qwen2-7b-colocated-l40s-48gb")
    assert pool["spec"]["template"]["spec"]["containers"][0]["image"] == "worker:v2"


def test_a_single_full_pool_rolls_behind_a_bridge_replica_on_another_class() -> None:
    dep = qwen(colocated={"acceleratorClasses": ["l40s-48gb", "a100-80gb"], "minReplicas": 1, "maxReplicas": 4})
    nodes = [node("l40s-0", "l40s", 4), node("a100-0", "a100", 1)]
    first = decide(observe(dep, nodes))
    assert pools(first) == {"a100-80gb": 1}
    children = live(first)
    pods = [pod_on("p1", "a100-0", acc="a100-80gb")]
    v2 = qwen(
        colocated={"acceleratorClasses": ["l40s-48gb", "a100-80gb"], "minReplicas": 1, "maxReplicas": 4},
        engine={"image": "worker:v2"},
        generation=2,
    )
    d = decide(observe(v2, nodes, children, pods))
    assert pools(d) == {"l40s-48gb": 1, "a100-80gb": 1}, "a bridge replica on l40s"
    assert (
        condition(d, "RolloutBlocked")[0] == "True"
        and "bridge replica on l40s-48gb" in condition(d, "RolloutBlocked")[2]
    )
    # The bridge serves: the pool rolls (one down, the bridge carries the role), the bridge stays meanwhile.
    children2 = live(d)
    d2 = decide(observe(v2, nodes, children2, pods, targets=dict(d.plan.targets)))
    assert condition(d2, "RolloutBlocked")[0] == "False"
    assert pools(d2) == {"l40s-48gb": 1, "a100-80gb": 1}
    pool = next(o for o in d2.objects if o["metadata"]["name"] == "qwen2-7b-colocated-a100-80gb")
    assert pool["spec"]["template"]["spec"]["containers"][0]["image"] == "worker:v2"
    # The rollout is done: the bridge goes.
    done = live(d2)
    d3 = decide(observe(v2, nodes, done, pods, targets=dict(d2.plan.targets)))
    assert pools(d3) == {"a100-80gb": 1}


def test_the_autoscaler_shrinking_a_role_removes_replicas() -> None:
    nodes = [node("l40s-0", "l40s", 4)]
    first = decide(observe(qwen(), nodes, desired={"colocated": 3}))
    assert pools(first) == {"l40s-48gb": 3}
    d = decide(observe(qwen(), nodes, live(first), desired={"colocated": 1}))
    assert pools(d) == {"l40s-48gb": 1}


def test_after_a_restart_the_role_sizes_come_from_the_status_not_the_pools_sum() -> None:
    dep = qwen(colocated={"acceleratorClasses": ["l40s-48gb", "a100-80gb"], "minReplicas": 1, "maxReplicas": 4})
    nodes = [node("l40s-0", "l40s", 4), node("a100-0", "a100", 8)]
    first = decide(observe(dep, nodes))
    pods = [pod_on("p1", "a100-0", acc="a100-80gb")]
    handing_over = decide(observe(dep, nodes, live(first), pods, deleting=frozenset({"a100-80gb"})))
    assert handing_over.status.decode_replicas == 1, "the kept replica is not part of the role's size"
    restarted = dep.model_copy(update={"status": handing_over.status})
    d = decide(observe(restarted, nodes, live(handing_over), pods, deleting=frozenset({"a100-80gb"})))
    assert pools(d) == {"l40s-48gb": 1}
