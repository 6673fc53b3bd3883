"""Make-before-break (pure): a pool the plan drops keeps serving until its role's new pools are ready."""

from __future__ import annotations

from typing import Any

from pdfleet_operator.decide import handover
from pdfleet_operator.kube import render


def deployment(name: str, role: str, replicas: int, ready: int | None = None, **status: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {"kind": "Deployment", "metadata": {"name": name, "labels": {render.LABEL_ROLE: role}},
                           "spec": {"replicas": replicas}}
    if ready is not None:
        obj["status"] = {"readyReplicas": ready, **status}
    return obj


OLD = deployment("m-decode-hygon", "decode", 2, ready=2)
ROUTER = deployment("m-router", render.ROUTER_ROLE, 1, ready=1)
SERVICE = {"kind": "Service", "metadata": {"name": "m-decode"}}


def test_the_old_pool_stays_while_the_new_one_starts_and_goes_once_it_is_ready() -> None:
    new = deployment("m-decode-ascend", "decode", 2)
    assert handover.retained([new, SERVICE], [OLD, SERVICE]) == {
        "Deployment/m-decode-hygon": "until the decode pools m-decode-ascend are ready (0/2 replicas)"}
    starting = deployment("m-decode-ascend", "decode", 2, ready=1)
    assert list(handover.retained([new], [OLD, starting])) == ["Deployment/m-decode-hygon"]
    assert "(1/2 replicas)" in handover.retained([new], [OLD, starting])["Deployment/m-decode-hygon"]
    ready = deployment("m-decode-ascend", "decode", 2, ready=2)
    assert handover.retained([new], [OLD, ready]) == {}


def test_ready_counts_only_replicas_of_the_current_template_and_generation() -> None:
    new = deployment("m-decode-ascend", "decode", 2)
    old_template = deployment("m-decode-ascend", "decode", 2, ready=2, updatedReplicas=0)
    assert handover.retained([new], [OLD, old_template])
    stale = deployment("m-decode-ascend", "decode", 2, ready=2, observedGeneration=1)
    stale["metadata"]["generation"] = 2
    assert handover.retained([new], [OLD, stale])
    assert handover.ready_replicas(deployment("x", "decode", 3, ready=3, updatedReplicas=3)) == 3


def test_nothing_is_kept_for_a_role_with_no_replicas_or_no_pools_and_other_kinds_are_not_pools() -> None:
    assert handover.retained([deployment("m-decode-ascend", "decode", 0)], [OLD]) == {}
    assert handover.retained([deployment("m-prefill-h100", "prefill", 1)], [OLD]) == {}
    assert handover.retained([deployment("m-decode-ascend", "decode", 1)], [ROUTER, SERVICE]) == {}
    # a pool still planned is never "kept": it is applied
    assert handover.retained([OLD], [OLD]) == {}


def test_a_role_spread_over_classes_waits_for_all_its_new_pools() -> None:
    a = deployment("m-decode-ascend", "decode", 2, ready=2)
    b = deployment("m-decode-h200", "decode", 1, ready=0)
    assert list(handover.retained([a, b], [OLD, a, b])) == ["Deployment/m-decode-hygon"]
