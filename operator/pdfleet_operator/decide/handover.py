"""Make-before-break when a plan moves a role to other accelerator classes (pure).

A new plan can drop a pool: a price change or a new node makes another class the better choice, a
spec edit lists other classes, a rollback returns to the stable revision's classes. Deleting the old
pool's Deployment at once would leave the role with no ready replica until the new pool's pods
start (minutes for a large model), so the old pool is kept, untouched and still behind the role's
headless Service, until the role's new pools have all their replicas ready; the reconcile that sees
them ready deletes it.

NOTE: a new pool that never becomes ready (an image that cannot be pulled, a node that will not
come) keeps the old pool serving, and paying, until it does; the status's Progressing condition
names the pool being kept and what it waits for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pdfleet_operator.api import names


def _key(obj: Mapping[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def _worker_role(obj: Mapping[str, Any]) -> str | None:
    if obj.get("kind") != "Deployment":
        return None
    role = ((obj.get("metadata") or {}).get("labels") or {}).get(names.LABEL_ROLE)
    return None if role in (None, names.ROUTER_ROLE) else role


def ready_replicas(obj: Mapping[str, Any]) -> int:
    """Replicas of a Deployment that run its current template and pass readiness (as far as its status says)."""
    st = obj.get("status") or {}
    ready = int(st.get("readyReplicas") or 0)
    if "updatedReplicas" in st:
        ready = min(ready, int(st.get("updatedReplicas") or 0))
    generation = (obj.get("metadata") or {}).get("generation")
    observed = st.get("observedGeneration")
    if generation is not None and observed is not None and int(observed) < int(generation):
        return 0  # the controller has not looked at the latest spec yet: its counts are of an older one
    return ready


def retained(desired: Iterable[Mapping[str, Any]], existing: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Worker pool Deployments in `existing` that `desired` no longer has but that must keep serving.

    Returns {"Deployment/NAME": why} for each one kept: its role still has pools in `desired` whose
    replicas are not all ready yet. A role that the plan runs with 0 replicas, or no longer runs at
    all, has nothing to wait for.
    """
    existing = list(existing)
    current = {_key(o): o for o in existing}
    wanted: dict[str, list[Mapping[str, Any]]] = {}
    wanted_keys = set()
    for obj in desired:
        wanted_keys.add(_key(obj))
        role = _worker_role(obj)
        if role is not None:
            wanted.setdefault(role, []).append(obj)
    out: dict[str, str] = {}
    for key, obj in sorted(current.items()):
        role = _worker_role(obj)
        if key in wanted_keys or role is None or role not in wanted:
            continue
        pools = wanted[role]
        want = sum(int((p.get("spec") or {}).get("replicas") or 0) for p in pools)
        ready = sum(ready_replicas(current[_key(p)]) for p in pools if _key(p) in current)
        if want > 0 and ready < want:
            names = ", ".join(p["metadata"]["name"] for p in pools)
            out[key] = f"until the {role} pools {names} are ready ({ready}/{want} replicas)"
    return out
