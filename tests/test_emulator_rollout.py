"""The emulator's Deployment controller rolls as Kubernetes' does (tests/support/k8s/workloads/deployments.py and
rollout.py): ReplicaSets per template, RollingUpdate paced by maxSurge/maxUnavailable as pods become ready,
Recreate, a rollout that cannot schedule its surge pod stays stuck until its progress deadline, held and failing
readiness, minReadySeconds, and the status counts and conditions Kubernetes writes."""

from __future__ import annotations

import copy

import pytest

from tests.kube.cluster import node
from tests.support.k8s import ApiError
from tests.support.k8s.workloads import rollout
from tests.support.k8s_fixtures import Kube


def deployment(
    name: str, replicas: int, *, cpu: str = "1", strategy: dict | None = None, image: str = "v1", **spec: object
) -> dict:
    body: dict = {
        "replicas": replicas,
        "selector": {"matchLabels": {"app": name}},
        "template": {
            "metadata": {"labels": {"app": name}},
            "spec": {"containers": [{"name": "c", "image": image, "resources": {"requests": {"cpu": cpu}}}]},
        },
        **spec,
    }
    if strategy is not None:
        body["strategy"] = strategy
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": "default"},
        "spec": body,
    }


def roll(kube: Kube, doc: dict, image: str) -> dict:
    new = copy.deepcopy(doc)
    new["spec"]["template"]["spec"]["containers"][0]["image"] = image
    kube.apply(new)
    return new


def pods(kube: Kube, app: str) -> list[dict]:
    return [
        p
        for p in kube.list("pods", "default", label_selector=f"app={app}")
        if not p["metadata"].get("deletionTimestamp")
    ]


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def images(kube: Kube, app: str) -> tuple[list[str], list[str]]:
    """(images of the Ready pods, images of the not-ready ones), sorted."""
    ps = pods(kube, app)
    return (
        sorted(p["spec"]["containers"][0]["image"] for p in ps if ready(p)),
        sorted(p["spec"]["containers"][0]["image"] for p in ps if not ready(p)),
    )


def status(kube: Kube, name: str) -> dict:
    return kube.get("deployments.apps", name, "default")["status"]


def condition(kube: Kube, name: str, type_: str) -> dict:
    return next(c for c in status(kube, name)["conditions"] if c["type"] == type_)


def complete(kube: Kube, name: str, replicas: int) -> bool:
    st = status(kube, name)
    return (st.get("updatedReplicas"), st.get("availableReplicas"), st.get("replicas")) == (
        replicas,
    ) * 3 and condition(kube, name, "Progressing")["reason"] == "NewReplicaSetAvailable"


def test_rolling_update_surges_one_at_a_time_as_new_pods_become_ready(kube: Kube) -> None:
    wl = kube.call(kube.emulator.enable_workloads)
    kube.apply(node("a", "cpu", 16))
    doc = deployment(
        "web", 4, strategy={"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    )
    kube.apply(doc)
    kube.wait_for(lambda: complete(kube, "web", 4), message="the first rollout complete")
    first = kube.list("replicasets.apps", "default")
    assert [rs["metadata"]["name"] for rs in first] == [f"web-{first[0]['metadata']['labels']['pod-template-hash']}"]
    assert (
        kube.get("deployments.apps", "web", "default")["metadata"]["annotations"]["deployment.kubernetes.io/revision"]
        == "1"
    )

    released: set[str] = set()
    kube.call(
        wl.hold_ready,
        lambda pod: pod["metadata"]["name"] not in released and pod["spec"]["containers"][0]["image"] == "v2",
    )
    roll(kube, doc, "v2")
    for step in range(1, 5):
        # One surge pod at a time, Ready old pods never below 4, never more than 5 pods.
        kube.wait_for(
            lambda: images(kube, "web") == (["v1"] * (5 - step) + ["v2"] * (step - 1), ["v2"]),
            message=f"step {step}: {5 - step} old + {step - 1} new Ready, 1 new held",
        )
        st = status(kube, "web")
        assert (
            st["replicas"],
            st["updatedReplicas"],
            st["readyReplicas"],
            st["availableReplicas"],
            st["unavailableReplicas"],
            st["observedGeneration"],
        ) == (5, step, 4, 4, 1, 2), st
        assert condition(kube, "web", "Progressing")["reason"] == "ReplicaSetUpdated"
        held = next(p for p in pods(kube, "web") if not ready(p))
        kube.advance(60)  # held until released, whatever the clock says
        assert images(kube, "web")[1] == ["v2"] and len(pods(kube, "web")) == 5
        released.add(held["metadata"]["name"])
        kube.call(kube.emulator.run_workloads)
    kube.wait_for(lambda: complete(kube, "web", 4), message="the rollout complete")
    assert images(kube, "web") == (["v2"] * 4, [])
    sets = {
        rs["spec"]["template"]["spec"]["containers"][0]["image"]: rs for rs in kube.list("replicasets.apps", "default")
    }
    assert (sets["v1"]["spec"]["replicas"], sets["v2"]["spec"]["replicas"]) == (0, 4)
    assert sets["v2"]["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "2"
    assert "unavailableReplicas" not in status(kube, "web")  # 0: omitted, as the API does


def test_max_unavailable_replaces_old_pods_first_and_percentages_round_as_kubernetes(kube: Kube) -> None:
    wl = kube.call(kube.emulator.enable_workloads)
    kube.apply(node("a", "cpu", 16))
    down = deployment("down", 3, strategy={"rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}})
    pct = deployment("pct", 3, strategy={"rollingUpdate": {"maxSurge": "50%", "maxUnavailable": "50%"}})
    kube.apply([down, pct])
    kube.wait_for(lambda: complete(kube, "down", 3) and complete(kube, "pct", 3), message="both rolled out")
    kube.call(wl.hold_ready, lambda pod: pod["spec"]["containers"][0]["image"] == "v2")
    roll(kube, down, "v2")
    roll(kube, pct, "v2")
    # maxSurge 0, maxUnavailable 1: one old pod goes before its replacement exists, never more than 3 pods.
    kube.wait_for(lambda: images(kube, "down") == (["v1", "v1"], ["v2"]), message="down: 2 old Ready, 1 new held")
    # 3 replicas: maxSurge 50% -> 2 (1.5 rounded up): 5 pods at most; maxUnavailable 50% -> 1 (rounded down): 2 old
    # stay Ready while the new ones are held (had either rounded the other way: 4 pods, or 1 old pod left).
    kube.wait_for(
        lambda: images(kube, "pct") == (["v1", "v1"], ["v2", "v2", "v2"]), message="pct: 2 old Ready, 3 new held"
    )
    kube.advance(30)
    assert images(kube, "down") == (["v1", "v1"], ["v2"]) and images(kube, "pct") == (["v1", "v1"], ["v2", "v2", "v2"])
    kube.call(wl.release)
    kube.wait_for(lambda: complete(kube, "down", 3) and complete(kube, "pct", 3), message="both rolled out again")


@pytest.mark.parametrize(
    "rolling, message",
    [
        ({"maxSurge": 0, "maxUnavailable": 0}, "may not be 0 when `maxSurge` is 0"),
        ({"maxSurge": "0%", "maxUnavailable": "0%"}, "may not be 0 when `maxSurge` is 0"),
        ({"maxUnavailable": "120%"}, "must not be greater than 100%"),
        ({"maxSurge": -1}, "must be greater than or equal to 0"),
        ({"maxSurge": "half"}, "a valid percent string"),
    ],
)
def test_invalid_rolling_parameters_are_refused_at_admission(kube: Kube, rolling: dict, message: str) -> None:
    with pytest.raises(ApiError) as err:
        kube.apply(deployment("bad", 1, strategy={"type": "RollingUpdate", "rollingUpdate": rolling}))
    assert err.value.code == 422 and message in err.value.message, err.value.message
    with pytest.raises(ApiError) as err:
        kube.apply(deployment("bad", 1, strategy={"type": "Recreate", "rollingUpdate": {"maxSurge": 1}}))
    assert "may not be specified when strategy `type` is 'Recreate'" in err.value.message


def test_a_rollout_whose_surge_pod_cannot_schedule_stays_stuck_until_its_deadline(kube: Kube) -> None:
    kube.call(kube.emulator.enable_workloads)
    kube.apply(node("a", "cpu", 2))
    doc = deployment("full", 2)  # 25% of 2: maxSurge 1 (rounded up), maxUnavailable 0 (rounded down)
    kube.apply(doc)
    kube.wait_for(lambda: complete(kube, "full", 2), message="rolled out on a full node")
    roll(kube, doc, "v2")
    kube.wait_for(lambda: images(kube, "full") == (["v1", "v1"], ["v2"]), message="the surge pod created")
    surge = next(p for p in pods(kube, "full") if not ready(p))
    assert not surge["spec"].get("nodeName") and "Insufficient cpu" in surge["status"]["conditions"][0]["message"]
    kube.advance(599)
    assert images(kube, "full") == (["v1", "v1"], ["v2"])
    assert condition(kube, "full", "Progressing")["status"] == "True"
    kube.advance(2)
    cond = condition(kube, "full", "Progressing")
    assert (cond["status"], cond["reason"]) == ("False", "ProgressDeadlineExceeded"), cond
    assert images(kube, "full") == (["v1", "v1"], ["v2"]), "a timed-out rollout still serves with its old pods"
    assert condition(kube, "full", "Available")["status"] == "True"
    kube.apply(node("b", "cpu", 2))  # capacity: the rollout moves on and completes
    kube.wait_for(lambda: complete(kube, "full", 2), message="the rollout completes once the surge pod binds")


def test_recreate_removes_every_old_pod_before_the_new_ones(kube: Kube) -> None:
    kube.call(kube.emulator.enable_workloads, graceful_termination=True)
    kube.apply(node("a", "cpu", 8))
    doc = deployment("rec", 2, strategy={"type": "Recreate"})
    kube.apply(doc)
    kube.wait_for(lambda: complete(kube, "rec", 2), message="rolled out")
    roll(kube, doc, "v2")
    kube.wait_for(
        lambda: all(
            p["metadata"].get("deletionTimestamp") for p in kube.list("pods", "default", label_selector="app=rec")
        ),
        message="old pods terminating",
    )
    kube.advance(20)
    listed = kube.list("pods", "default", label_selector="app=rec")
    assert [p["spec"]["containers"][0]["image"] for p in listed] == ["v1", "v1"], "no new pod while old ones terminate"
    kube.advance(11)  # the default grace period of 30 s has passed
    kube.wait_for(lambda: complete(kube, "rec", 2) and images(kube, "rec") == (["v2", "v2"], []), message="recreated")


def test_held_readiness_with_seconds_min_ready_seconds_and_failing_readiness(kube: Kube) -> None:
    wl = kube.call(kube.emulator.enable_workloads)
    kube.apply(node("a", "cpu", 8))
    kube.call(wl.hold_ready, wl.selecting("app=slow"), seconds=30)
    kube.apply(deployment("slow", 1, minReadySeconds=10))
    kube.wait_for(
        lambda: len(pods(kube, "slow")) == 1 and pods(kube, "slow")[0]["status"].get("phase") == "Running",
        message="the pod runs",
    )
    assert images(kube, "slow") == ([], ["v1"])
    kube.advance(29)
    assert images(kube, "slow") == ([], ["v1"])
    kube.advance(2)
    assert images(kube, "slow") == (["v1"], [])
    assert (status(kube, "slow").get("readyReplicas"), status(kube, "slow").get("availableReplicas")) == (1, None), (
        "Ready, not yet available for minReadySeconds"
    )
    kube.advance(11)
    assert status(kube, "slow")["availableReplicas"] == 1

    failing = kube.call(wl.fail_ready, wl.selecting("app=slow"))
    assert images(kube, "slow") == ([], ["v1"])
    assert "readyReplicas" not in status(kube, "slow") and status(kube, "slow")["unavailableReplicas"] == 1
    kube.call(failing.release)
    assert images(kube, "slow") == (["v1"], [])


def test_scaling_mid_rollout_is_proportional_and_updated_pods_predicate_follows_the_template(kube: Kube) -> None:
    wl = kube.call(kube.emulator.enable_workloads)
    kube.apply(node("a", "cpu", 64))
    doc = deployment("grow", 10, strategy={"rollingUpdate": {"maxSurge": 3, "maxUnavailable": 0}})
    kube.apply(doc)
    kube.wait_for(lambda: complete(kube, "grow", 10), message="rolled out")
    kube.call(wl.hold_ready, wl.updated_pods_of("grow"))
    roll(kube, doc, "v2")
    kube.wait_for(lambda: images(kube, "grow") == (["v1"] * 10, ["v2"] * 3), message="3 surge pods held")
    grown = roll(kube, doc, "v2")
    grown["spec"]["replicas"] = 20
    kube.apply(grown)
    # 20 + 3 allowed, 13 running: 10 more, spread as 10:3 (old 10 -> 18, new 3 -> 5), the leftover to the largest.
    kube.wait_for(
        lambda: sorted(rs["spec"]["replicas"] for rs in kube.list("replicasets.apps", "default")) == [5, 18],
        message="proportional scaling",
    )


def test_rollout_arithmetic() -> None:
    d = deployment("x", 10, strategy={"rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}})
    assert rollout.fenceposts(d) == (3, 2)  # 2.5 up, 2.5 down
    d1 = deployment("x", 1)
    assert rollout.fenceposts(d1) == (1, 0) and rollout.max_unavailable(d1) == 0
    tiny = deployment("x", 1, strategy={"rollingUpdate": {"maxSurge": "10%", "maxUnavailable": "10%"}})
    assert rollout.fenceposts(tiny) == (1, 0)
    zero = deployment("x", 3, strategy={"rollingUpdate": {"maxSurge": "0%", "maxUnavailable": "10%"}})
    assert rollout.fenceposts(zero) == (0, 1), "percentages both rounding to 0 leave one unavailable"
    assert rollout.new_set_replicas(d, [rollout.Set("old", 10, 10)], 0) == 3
    assert rollout.new_set_replicas(d, [rollout.Set("old", 10, 10), rollout.Set("new", 3, 0)], 3) == 3
    # 13 pods, 10 - 2 must stay available, 3 new unavailable: 13 - 8 - 3 = 2 old may go.
    assert rollout.old_scale_down(d, rollout.Set("new", 3, 0), [rollout.Set("old", 10, 10)]) == {"old": 8}
    # unhealthy old replicas go first, without touching availability
    assert rollout.old_scale_down(d, rollout.Set("new", 3, 3), [rollout.Set("old", 10, 6)]) == {"old": 5}
