"""Drift detection (what kube.apply writes, or not) and the status the reconcile computes."""

from __future__ import annotations

import datetime as dt

from pdfleet_operator.api import Condition
from pdfleet_operator.decide import cost, drift, inventory, placement, status
from tests.kube.cluster import classes, example_deployments, node, spec_of

CLASSES = classes()
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
T1 = T0 + dt.timedelta(minutes=5)


def test_contains_tolerates_server_defaults_and_canonical_quantities() -> None:
    desired = {
        "spec": {
            "replicas": 2,
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "w",
                            "resources": {"requests": {"memory": "1024Mi", "cpu": 2}},
                            "ports": [{"containerPort": 8000}],
                        }
                    ],
                    "nodeSelector": {},
                    "volumes": [{"name": "t", "emptyDir": {"sizeLimit": "1024Mi"}}],
                }
            },
        }
    }
    actual = {
        "metadata": {"uid": "x"},
        "status": {"readyReplicas": 1},
        "spec": {
            "replicas": 2,
            "progressDeadlineSeconds": 600,
            "template": {
                "spec": {
                    "dnsPolicy": "ClusterFirst",
                    "containers": [
                        {
                            "name": "w",
                            "imagePullPolicy": "IfNotPresent",
                            "resources": {"requests": {"memory": "1Gi", "cpu": "2"}},
                            "ports": [{"containerPort": 8000, "protocol": "TCP"}],
                        }
                    ],
                    "volumes": [{"name": "t", "emptyDir": {"sizeLimit": "1Gi"}}],
                }
            },
        },
    }
    assert drift.contains(actual, desired)
    assert drift.differences(actual, desired) == []


def test_contains_sees_hand_edits() -> None:
    desired = {
        "spec": {
            "replicas": 2,
            "template": {"spec": {"containers": [{"name": "w", "image": "a", "env": [{"name": "X", "value": "1"}]}]}},
        }
    }
    edited_image = {
        "spec": {
            "replicas": 2,
            "template": {"spec": {"containers": [{"name": "w", "image": "b", "env": [{"name": "X", "value": "1"}]}]}},
        }
    }
    extra_env = {
        "spec": {
            "replicas": 2,
            "template": {
                "spec": {
                    "containers": [
                        {"name": "w", "image": "a", "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}]}
                    ]
                }
            },
        }
    }
    scaled = {"spec": {"replicas": 5, "template": desired["spec"]["template"]}}
    assert not drift.contains(edited_image, desired)
    assert not drift.contains(extra_env, desired)  # we own the whole list
    assert drift.differences(scaled, desired) == [".spec.replicas"]
    assert not drift.contains({"data": {"k": "v2"}}, {"data": {"k": "v"}})
    assert not drift.contains({}, {"metadata": {"labels": {"a": "b"}}})


def _plan(name: str, nodes: list[dict], desired: dict[str, int] | None = None) -> tuple:
    spec = spec_of(example_deployments()[name])
    plan = placement.plan(spec, CLASSES, inventory.build(nodes, []), desired)
    return spec, plan, cost.plan_cost(plan, CLASSES, router_replicas=1)


def conditions(st) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in st.conditions}


def test_status_while_rolling_out_then_ready() -> None:
    spec, plan, c = _plan("llama31-8b", [node("h", "h100", 8), node("m", "h100-mig", 4)])
    st = status.compute(
        name="llama31-8b",
        namespace="ns",
        plan=plan,
        cost=c,
        observed=status.Observed(),
        previous=None,
        generation=1,
        revision=1,
        router_replicas=1,
        now=T0,
    )
    assert conditions(st) == {
        "ScalingLimited": ("False", "CapacityAvailable"),
        "Degraded": ("False", "AsExpected"),
        "Progressing": ("True", "RollingOut"),
        "Ready": ("False", "NotServing"),
        "PlacementDrift": ("False", "AsPlanned"),
        "RolloutBlocked": ("False", "AsExpected"),
    }
    assert st.pd_ratio == "1:2" and st.prefill_replicas == 1 and st.decode_replicas == 2
    assert st.cost_per_hour == round(2.99 + 2 * 1.28 + 0.10, 4)
    assert st.endpoint == "http://llama31-8b.ns.svc:80/v1"
    assert [(p.name, p.desired, p.ready) for p in st.pools] == [
        ("llama31-8b-prefill-h100-80gb", 1, 0),
        ("llama31-8b-decode-h100-mig-3g-40gb", 2, 0),
    ]
    ready = status.Observed(
        ready={"llama31-8b-prefill-h100-80gb": 1, "llama31-8b-decode-h100-mig-3g-40gb": 2}, router_ready=1
    )
    st2 = status.compute(
        name="llama31-8b",
        namespace="ns",
        plan=plan,
        cost=c,
        observed=ready,
        previous=st,
        generation=2,
        revision=1,
        router_replicas=1,
        now=T1,
    )
    by_type = {x.type: x for x in st2.conditions}
    assert by_type["Ready"].status == "True" and by_type["Ready"].last_transition_time == T1
    assert by_type["Degraded"].last_transition_time == T0  # unchanged status keeps its transition time
    assert st2.observed_generation == 2
    # Same inputs again: the same status (so no write).
    st3 = status.compute(
        name="llama31-8b",
        namespace="ns",
        plan=plan,
        cost=c,
        observed=ready,
        previous=st2,
        generation=2,
        revision=1,
        router_replicas=1,
        now=T1 + dt.timedelta(hours=1),
    )
    assert st3.wire() == st2.wire()


def test_status_scaling_limited_and_degraded() -> None:
    _, plan, c = _plan("llama31-8b", [node("m", "h100-mig", 1)], {"decode": 2})
    st = status.compute(
        name="llama31-8b",
        namespace="ns",
        plan=plan,
        cost=c,
        observed=status.Observed(),
        previous=None,
        generation=1,
        revision=1,
        router_replicas=1,
        now=T0,
    )
    cs = {x.type: x for x in st.conditions}
    assert (cs["ScalingLimited"].status, cs["ScalingLimited"].reason) == ("True", "InsufficientCapacity")
    assert "missing 1 x nvidia.com/gpu on h100-80gb" in cs["ScalingLimited"].message
    assert "missing 1 x nvidia.com/mig-3g.40gb" in cs["ScalingLimited"].message
    assert (cs["Degraded"].status, cs["Degraded"].reason) == ("True", "RoleUnplaced")
    assert st.pd_ratio == "0:1"


def test_status_keeps_conditions_owned_by_others() -> None:
    _, plan, c = _plan("qwen2-7b", [node("l", "l40s", 4)])
    metrics = Condition(
        type="MetricsAvailable", status="False", reason="PrometheusDown", message="x", last_transition_time=T0
    )
    rolled = Condition(type="RolledBack", status="True", reason="ErrorRatio", message="y", last_transition_time=T0)
    degraded = Condition(type="Degraded", status="True", reason="RolledBack", message="y", last_transition_time=T0)
    prev = status.compute(
        name="q",
        namespace="ns",
        plan=plan,
        cost=c,
        observed=status.Observed(),
        previous=None,
        generation=1,
        revision=2,
        router_replicas=1,
        now=T0,
        extra_conditions=[metrics, rolled, degraded],
    )
    st = status.compute(
        name="q",
        namespace="ns",
        plan=plan,
        cost=c,
        observed=status.Observed(),
        previous=prev,
        generation=1,
        revision=2,
        router_replicas=1,
        now=T1,
    )
    cs = {x.type: (x.status, x.reason) for x in st.conditions}
    assert cs["MetricsAvailable"] == ("False", "PrometheusDown")
    assert cs["Degraded"] == ("True", "RolledBack")
    assert st.pd_ratio == "-" and st.prefill_replicas is None and st.decode_replicas == 1


def test_the_applied_hash_makes_a_dropped_map_key_a_difference() -> None:
    from pdfleet_operator.api.names import ANNOTATION_APPLIED_HASH

    before = {"metadata": {"name": "d"}, "spec": {"nodeSelector": {"a": "1", "b": "2"}}}
    after = {"metadata": {"name": "d"}, "spec": {"nodeSelector": {"a": "1"}}}
    live = drift.with_applied_hash(before)
    assert drift.contains(live, drift.with_applied_hash(before)), "unchanged render: nothing to write"
    assert drift.contains(live, after), "containment alone sees no difference"
    stamped = drift.with_applied_hash(after)
    assert not drift.contains(live, stamped) and drift.pruned_only(live, stamped)
    assert stamped["metadata"]["annotations"][ANNOTATION_APPLIED_HASH] == drift.applied_hash(stamped), "stable"
    assert "annotations" not in after["metadata"], "the render is not modified"
    edited = {**live, "spec": {"nodeSelector": {"a": "9", "b": "2"}}}
    assert not drift.pruned_only(edited, stamped), "a hand edit is drift, not a prune"


def test_placement_drift_and_rollout_blocked_say_why() -> None:
    from pdfleet_operator.decide.transition import Drift

    _, plan, c = _plan("qwen2-7b", [node("l", "l40s", 4)])
    seen = status.Observed(
        drift=(Drift("q-colocated-l40s-48gb", "NodeCordoned", "1 replica on a cordoned node"),),
        stuck=("colocated: no free capacity",),
        blocked=("q-colocated-l40s-48gb: held",),
        moving=("colocated: keeping q-colocated-l40s-48gb",),
    )
    st = status.compute(
        name="q",
        namespace="ns",
        plan=plan,
        cost=c,
        observed=seen,
        previous=None,
        generation=1,
        revision=1,
        router_replicas=1,
        now=T0,
    )
    cs = {x.type: x for x in st.conditions}
    assert (cs["PlacementDrift"].status, cs["PlacementDrift"].reason) == ("True", "NodeCordoned")
    assert "cordoned" in cs["PlacementDrift"].message and "no free capacity" in cs["PlacementDrift"].message
    assert (cs["RolloutBlocked"].status, cs["RolloutBlocked"].reason) == ("True", "NoCapacityForSurge")
    assert "keeping q-colocated-l40s-48gb" in cs["Progressing"].message


def test_a_refused_spec_is_in_the_conditions_and_a_serving_fleet_stays_ready() -> None:
    now = dt.datetime(2026, 12, 2, tzinfo=dt.timezone.utc)
    new = status.refused(None, "spec.decode.acceleratorClasses[0]: no bridge", 1, now)
    assert new is not None
    cond = {c["type"]: c for c in new}
    assert (cond["Ready"]["status"], cond["Ready"]["reason"], cond["Degraded"]["reason"]) == (
        "False",
        "InvalidSpec",
        "InvalidSpec",
    )
    assert (
        status.refused({"conditions": new}, "spec.decode.acceleratorClasses[0]: no bridge", 1, now) is None
    )  # said once

    ready = Condition(
        type="Ready", status="True", reason="Serving", message="decode 1/1", last_transition_time=now
    ).wire()
    serving = {"observedGeneration": 3, "pools": [{"name": "p"}], "conditions": [ready]}
    cond = {c["type"]: c for c in status.refused(serving, "spec.engine.runtime: no vLLM", 4, now)}
    assert cond["Ready"] == ready, "pools serving generation 3 keep Ready"
    assert cond["Degraded"]["message"].startswith("generation 4 refused, the pools keep serving generation 3: ")
