"""PodDisruptionBudgets in the emulator (tests/support/k8s/workloads/disruption.py, eviction.py, drain.py): the
disruption controller's status, the Eviction subresource refusing with 429 what would break a budget (over HTTP
too), the drain helper retrying those until replacements are ready, and kubectl drain itself."""

from __future__ import annotations

import subprocess
import threading

import httpx
import pytest

from tests.kube.cluster import node, pod
from tests.support import components
from tests.support.k8s import ApiError
from tests.support.k8s.drain import DrainError
from tests.support.k8s_fixtures import Kube
from tests.test_emulator_rollout import deployment, pods, ready


def budget(name: str, app: str, **spec: object) -> dict:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"selector": {"matchLabels": {"app": app}}, **spec},
    }


def pdb_status(kube: Kube, name: str) -> dict:
    return kube.get("poddisruptionbudgets.policy", name, "default").get("status") or {}


def counts(kube: Kube, name: str) -> tuple:
    st = pdb_status(kube, name)
    return tuple(st.get(k) for k in ("expectedPods", "desiredHealthy", "currentHealthy", "disruptionsAllowed"))


def test_budget_status_follows_min_available_and_max_unavailable(kube: Kube) -> None:
    wl = kube.call(kube.emulator.enable_workloads)
    kube.apply(node("a", "cpu", 32))
    kube.apply(deployment("web", 3))
    kube.apply(
        [
            budget("min2", "web", minAvailable=2),
            budget("min-pct", "web", minAvailable="50%"),
            budget("max-pct", "web", maxUnavailable="50%"),
            budget("max1", "web", maxUnavailable=1),
        ]
    )
    kube.wait_for(lambda: counts(kube, "min2") == (3, 2, 3, 1), message="minAvailable 2 of 3 Ready: 1 allowed")
    assert counts(kube, "min-pct") == (3, 2, 3, 1), "50% of 3 rounds up to 2"
    assert counts(kube, "max-pct") == (3, 1, 3, 2), "maxUnavailable 50% of 3 rounds up to 2"
    assert counts(kube, "max1") == (3, 2, 3, 1)
    st = pdb_status(kube, "min2")
    assert st["observedGeneration"] == 1
    cond = st["conditions"][0]
    assert (cond["type"], cond["status"], cond["reason"]) == ("DisruptionAllowed", "True", "SufficientPods")

    victim = pods(kube, "web")[0]["metadata"]["name"]
    rule = kube.call(wl.fail_ready, lambda p: p["metadata"]["name"] == victim)
    kube.wait_for(lambda: counts(kube, "min2") == (3, 2, 2, 0), message="one pod not ready: nothing to spare")
    cond = pdb_status(kube, "min2")["conditions"][0]
    assert (cond["status"], cond["reason"]) == ("False", "InsufficientPods")
    # maxUnavailable counts what the pods' controller wants (the Deployment's replicas), not the pods that exist.
    kube.patch("deployments.apps", "web", {"spec": {"replicas": 4}}, "default")
    kube.wait_for(lambda: counts(kube, "max1") == (4, 3, 3, 0), message="expected pods from the Deployment's replicas")
    kube.call(rule.release)
    kube.wait_for(lambda: counts(kube, "max1") == (4, 3, 4, 1), message="all 4 healthy again")


def test_eviction_uses_the_budget_and_answers_429_when_it_is_spent(kube: Kube) -> None:
    wl = kube.call(kube.emulator.enable_workloads)
    kube.apply(node("a", "cpu", 32))
    kube.apply(deployment("web", 3))
    kube.apply(budget("web", "web", minAvailable=2))
    kube.wait_for(lambda: counts(kube, "web") == (3, 2, 3, 1), message="1 disruption allowed")
    kube.call(wl.hold_ready, lambda p: p["metadata"]["name"] not in original)
    original = [p["metadata"]["name"] for p in pods(kube, "web")]

    kube.evict(original[0])
    assert kube.get("pods", original[0], "default") is None
    kube.wait_for(lambda: len(pods(kube, "web")) == 3, message="the Deployment replaced the evicted pod")
    assert counts(kube, "web") == (3, 2, 2, 0), "the replacement is not ready yet: nothing to spare"
    with pytest.raises(ApiError) as err:
        kube.evict(original[1])
    assert (err.value.code, err.value.reason) == (429, "TooManyRequests")
    assert err.value.message == "Cannot evict pod as it would violate the pod's disruption budget."
    assert err.value.details["causes"] == [
        {"type": "DisruptionBudget", "message": "The disruption budget web needs 2 healthy pods and has 2 currently"}
    ]
    assert kube.get("pods", original[1], "default") is not None

    # Over HTTP, as kubectl and client libraries send it.
    url = f"{kube.url}/api/v1/namespaces/default/pods/{original[1]}/eviction"
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": original[1], "namespace": "default"}}
    refused = httpx.post(url, json=body)
    assert refused.status_code == 429 and refused.json()["reason"] == "TooManyRequests"
    assert httpx.post(url, json={**body, "metadata": {"name": "other"}}).status_code == 400
    missing = {**body, "metadata": {"name": "missing"}}
    assert httpx.post(f"{kube.url}/api/v1/namespaces/default/pods/missing/eviction", json=missing).status_code == 404

    kube.call(wl.release)
    kube.wait_for(lambda: counts(kube, "web") == (3, 2, 3, 1), message="the replacement is ready")
    evicted = httpx.post(url, json=body)
    assert evicted.status_code == 201 and evicted.json()["status"] == "Success"
    assert kube.get("pods", original[1], "default") is None
    assert [r.status for r in kube.requests_for(verb="create", resource="pods", subresource="eviction")] == [
        429,
        400,
        404,
        201,
    ]


def test_an_unhealthy_pod_may_be_evicted_while_the_budget_holds_and_unguarded_pods_always(kube: Kube) -> None:
    wl = kube.call(kube.emulator.enable_workloads)
    kube.apply(node("a", "cpu", 32))
    kube.apply(deployment("web", 3))
    kube.apply(budget("web", "web", minAvailable=1))
    kube.wait_for(lambda: counts(kube, "web") == (3, 1, 3, 2), message="2 allowed")
    names = [p["metadata"]["name"] for p in pods(kube, "web")]
    kube.call(wl.fail_ready, lambda p: p["metadata"]["name"] == names[0])
    kube.wait_for(lambda: counts(kube, "web") == (3, 1, 2, 1), message="one unhealthy")
    kube.evict(names[0])  # IfHealthyBudget: 2 healthy >= 1 desired, the unhealthy pod goes without using the budget
    assert kube.get("pods", names[0], "default") is None
    kube.apply(pod("bare", "a", {"cpu": "1"}))
    kube.evict("bare")  # no budget selects it
    assert kube.get("pods", "bare", "default") is None


def test_drain_cordons_retries_refused_evictions_and_waits_for_the_replacements(kube: Kube) -> None:
    wl = kube.call(kube.emulator.enable_workloads)
    kube.apply([node("a", "cpu", 2), node("b", "cpu", 8)])
    kube.apply(deployment("web", 2))
    kube.apply(budget("web", "web", minAvailable=1))
    kube.wait_for(
        lambda: (
            sorted(p["spec"].get("nodeName") for p in pods(kube, "web")) == ["a", "a"]
            and counts(kube, "web") == (2, 1, 2, 1)
        ),
        message="both on a, 1 disruption allowed",
    )
    daemon = pod("agent", "a", {"cpu": "0"})
    daemon["metadata"]["ownerReferences"] = [
        {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "agent", "uid": "u-1", "controller": True}
    ]
    kube.apply(daemon)
    original = {p["metadata"]["name"] for p in pods(kube, "web")}
    kube.call(wl.hold_ready, lambda p: p["metadata"]["name"] not in original)  # replacements start, not ready

    result: dict = {}
    drainer = threading.Thread(target=lambda: result.update(evicted=kube.drain("a", timeout=30, retry_interval=0.05)))
    drainer.start()
    kube.wait_for(
        lambda: len(original & {p["metadata"]["name"] for p in pods(kube, "web")}) == 1 and counts(kube, "web")[3] == 0,
        message="one pod evicted, the second refused while its replacement is not ready",
    )
    assert kube.get("nodes", "a")["spec"]["unschedulable"] is True
    kube.advance(5)
    assert drainer.is_alive(), "the drain waits while the budget has nothing to spare"
    assert len(original & {p["metadata"]["name"] for p in pods(kube, "web")}) == 1
    kube.call(wl.release)
    drainer.join(30)
    assert not drainer.is_alive()
    assert sorted(result["evicted"]) == sorted(f"default/{n}" for n in original)
    assert sorted(p["spec"]["nodeName"] for p in pods(kube, "web")) == ["b", "b"]
    assert all(ready(p) for p in pods(kube, "web"))
    assert kube.get("pods", "agent", "default") is not None, "DaemonSet pods stay"

    kube.apply([node("c", "cpu", 2), pod("bare", "c", {"cpu": "1"})])
    with pytest.raises(DrainError, match="declare no controller"):
        kube.drain("c")
    assert kube.drain("c", force=True, timeout=10) == ["default/bare"]
    assert kube.get("pods", "bare", "default") is None


def test_kubectl_drain_evicts_through_the_budget(kube: Kube) -> None:
    binary = components.binary("kubectl")
    kube.call(kube.emulator.enable_workloads)
    kube.apply([node("a", "cpu", 2), node("b", "cpu", 8)])
    kube.apply(deployment("web", 2))
    kube.apply(budget("web", "web", minAvailable=2))
    kube.wait_for(lambda: counts(kube, "web") == (2, 2, 2, 0), message="a budget with nothing to spare")
    proc = subprocess.Popen(
        [binary, "drain", "a", "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=60s"],
        env=kube.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        kube.wait_for(
            lambda: any(r.status == 429 for r in kube.requests_for(verb="create", subresource="eviction")),
            timeout=30,
            message="kubectl's eviction refused with 429",
        )
        assert proc.poll() is None, "kubectl retries"
        kube.patch("deployments.apps", "web", {"spec": {"replicas": 4}}, "default")  # room in the budget
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "node/a cordoned" in out and "node/a drained" in out, out
    assert "violate the pod's disruption budget" in out, out
    assert kube.get("nodes", "a")["spec"]["unschedulable"] is True
    kube.wait_for(
        lambda: sorted(p["spec"].get("nodeName") for p in pods(kube, "web")) == ["b", "b", "b", "b"],
        message="every pod on b",
    )
    assert {r.status for r in kube.requests_for(verb="create", subresource="eviction")} == {201, 429}
