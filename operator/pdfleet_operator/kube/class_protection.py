"""An AcceleratorClass in use cannot vanish under its pools: the `pdfleet.io/in-use` finalizer, as Kubernetes holds a
PersistentVolumeClaim in use; the reconciler, the class handlers and the class-status loop call it.

A class gets the finalizer when a pool runs on it. `kubectl delete acceleratorclass X` then only marks it
(deletionTimestamp): placement stops planning new replicas on it, the pools on it hand over to the role's other
classes (`decide.transition`, make-before-break), and once no pool of any deployment runs on it the finalizer
is removed and the API server deletes the class. Users are the worker Deployments pdfleet manages (kopf's pool
index: every namespace the operator watches) and the last plans of this process.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from pdfleet_operator.api import names
from pdfleet_operator.kube import client

if TYPE_CHECKING:  # pragma: no cover
    from pdfleet_operator.decide.placement import FleetPlan
    from pdfleet_operator.decide.reconcile import Observed
    from pdfleet_operator.kube.reconciler import Reconciler

logger = logging.getLogger("pdfleet.operator")
FINALIZER = names.FINALIZER_CLASS_IN_USE


def users(rec: Reconciler) -> dict[str, list[str]]:
    """class -> the pools on it ("namespace/deployment role"), from the pool index and this process's plans."""
    out: dict[str, set[str]] = {}
    for p in rec.pools():
        out.setdefault(p["class"], set()).add(f"{p['namespace']}/{p['deployment']} {p['role']}")
    for (ns, name), m in rec.deployments.items():
        if m.plan is None or rec.body((ns, name)) is None:
            continue
        for pool in m.plan.pools:
            if pool.replicas > 0:
                out.setdefault(pool.accelerator_class, set()).add(f"{ns}/{name} {pool.role}")
    return {c: sorted(u) for c, u in out.items()}


async def sync(api: client.Api, rec: Reconciler, plan: FleetPlan, obs: Observed) -> None:
    """After a reconcile: protect the classes this deployment's pools run on, release deleted ones nobody uses."""
    running = {p.accelerator_class for p in plan.pools} | {
        (c["metadata"].get("labels") or {}).get(names.LABEL_ACCELERATOR)
        for c in obs.children
        if c["kind"] == "Deployment"
    }
    await protect(api, rec, (c for c in running if c))
    await release(api, rec)


async def protect(api: client.Api, rec: Reconciler, classes: Iterable[str]) -> None:
    """Put the finalizer on each of `classes` that lacks it (and is not being deleted: a finalizer cannot be added
    then, and the class is held already if it had one).

    NOTE: kopf's index shows our patch a moment later; `rec.protected` remembers the versions patched here, so
    the reconciles in between do not patch the same class again."""
    meta = rec.class_meta()
    for name in sorted(set(classes)):
        m = meta.get(name)
        if m is None or m.get("deleting") or FINALIZER in m.get("finalizers", ()):
            continue
        if rec.protected.get(name) == m.get("resourceVersion"):
            continue  # patched from this version already; the index has not caught up
        rec.protected[name] = m.get("resourceVersion")
        await _set_finalizers(api, name, [*m.get("finalizers", ()), FINALIZER], m.get("resourceVersion"))


async def release(api: client.Api, rec: Reconciler) -> list[str]:
    """Remove the finalizer from deleted classes no pool uses any more; returns their names."""
    if not rec.indexed:
        return []  # an incomplete pool index would release a class still in use
    meta = rec.class_meta()
    deleting = [n for n, m in meta.items() if m.get("deleting") and FINALIZER in m.get("finalizers", ())]
    if not deleting:
        return []
    used = users(rec)
    out = []
    for name in sorted(deleting):
        if used.get(name):
            continue
        m = meta[name]
        await _set_finalizers(
            api, name, [f for f in m.get("finalizers", ()) if f != FINALIZER], m.get("resourceVersion")
        )
        logger.info("AcceleratorClass %s: no pool uses it any more; released for deletion", name)
        out.append(name)
    return out


async def _set_finalizers(api: client.Api, name: str, finalizers: list[str], resource_version: str | None) -> None:
    """A merge patch of the whole list, conditional on the version it was computed from (a conflict: the next
    event or resync tries again)."""
    body: dict[str, Any] = {"metadata": {"finalizers": finalizers}}
    if resource_version:
        body["metadata"]["resourceVersion"] = resource_version
    try:
        await api.request(
            "PATCH", client.path("AcceleratorClass", None, name), body=body, content_type="application/merge-patch+json"
        )
    except client.ApiError as exc:
        if exc.code in (404, 409):
            return  # deleted, or changed since the index saw it: the resulting event brings another try
        raise


def meta_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the class_meta index keeps of an AcceleratorClass."""
    meta = body.get("metadata") or {}
    return {
        "finalizers": list(meta.get("finalizers") or []),
        "deleting": bool(meta.get("deletionTimestamp")),
        "resourceVersion": meta.get("resourceVersion"),
    }
