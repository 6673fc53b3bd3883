"""The cluster as the operator holds it in memory: kopf's indexes (deployments, classes, nodes, pods, pools) and,
in namespaced mode, the pods of the namespaces kopf does not watch; the reconciler's gather reads it.

kopf fills the indexes from watch streams (`kube.handlers` declares them); `Cluster` answers what the
reconcile needs from them without I/O, except `sync` (once per process: wait until the class and node
indexes hold what the API lists) and `refresh_foreign` (namespaced mode: list the other namespaces' pods).
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from pdfleet_operator.api import AcceleratorClassSpec, Condition, names
from pdfleet_operator.decide import inventory
from pdfleet_operator.kube import client

logger = logging.getLogger("pdfleet.operator")
Key = tuple[str, str]  # (namespace, name)
# How long the first reconcile of a process waits for kopf's class and node indexes to be complete, and how long
# the children listed at start stand in for those kopf has not indexed yet (thousands of them take minutes).
INDEX_SYNC_TIMEOUT_S = 10.0
LISTED_CHILDREN_S = 600.0
# kind -> the index of that child kind (handlers.py declares them; each holds whole objects by (namespace, owner))
CHILD_INDEXES = {
    "Deployment": "deployment_children",
    "Service": "service_children",
    "ConfigMap": "configmap_children",
    "NetworkPolicy": "networkpolicy_children",
    "PodDisruptionBudget": "pdb_children",
}
INDEXES = (
    "class_index",
    "class_meta_index",
    "node_index",
    "pod_index",
    "infdep_index",
    "pool_index",
    *CHILD_INDEXES.values(),
)


class Cluster:
    """kopf's indexes (set by the handlers as kopf passes them in) and what is read from them."""

    def __init__(self) -> None:
        self.indexes: dict[str, Any] = {}
        self.indexed = False  # every index holds its initial listing (set by the first resource handler)
        self._synced: asyncio.Task | None = None
        # The children the API listed at start, per deployment: key -> {(kind, name): object}, until kopf's index holds
        # them (or LISTED_CHILDREN_S after start)
        self._listed: dict[Key, dict[tuple[str, str], dict[str, Any]]] = {}
        self._listed_until = 0.0
        # The deployments whose holdings (their pools, plans, CR) changed since the reconciler last read them; None:
        # every deployment's (a class changed, the start-up listing came or went).
        self._held_dirty: set[Key] | None = None
        # Namespaced mode: the pods of the namespaces kopf does not watch, as last listed cluster-wide
        # (monotonic time, pod views, why they could not be listed or None).
        self._foreign: tuple[float, list[dict[str, Any]], str | None] | None = None
        self._foreign_task: asyncio.Task | None = None

    def keep(self, kwargs: Mapping[str, Any]) -> None:
        """Remember the index objects kopf passes to a handler (they are live views)."""
        for name in INDEXES:
            if name in kwargs:
                self.indexes[name] = kwargs[name]

    def bodies(self) -> dict[Key, dict[str, Any]]:
        """Every InferenceDeployment as kopf's index holds it (O(deployments): not per event or reconcile)."""
        index = self.indexes.get("infdep_index")
        return {} if index is None else {key: next(iter(store)) for key, store in index.items()}

    def body(self, key: Key) -> dict[str, Any] | None:
        """One InferenceDeployment as kopf's index holds it, or None."""
        index = self.indexes.get("infdep_index")
        if index is None or key not in index:
            return None
        return next(iter(index[key]), None)

    def classes(self) -> dict[str, AcceleratorClassSpec]:
        """Every valid AcceleratorClass, those being deleted included."""
        return {name: next(iter(store)) for name, store in (self.indexes.get("class_index") or {}).items()}

    def class_meta(self) -> dict[str, dict[str, Any]]:
        """name -> {"finalizers": [...], "deleting": bool} of every AcceleratorClass."""
        return {name: next(iter(store)) for name, store in (self.indexes.get("class_meta_index") or {}).items()}

    def deleting(self) -> frozenset[str]:
        return frozenset(n for n, m in self.class_meta().items() if m.get("deleting"))

    def nodes(self) -> list[dict[str, Any]]:
        return [next(iter(s)) for s in (self.indexes.get("node_index") or {}).values()]

    def pods(self) -> list[dict[str, Any]]:
        """Pod views of the watched namespaces and, in namespaced mode, the others as last listed."""
        own = [p for s in (self.indexes.get("pod_index") or {}).values() for p in s]
        return own + (list(self._foreign[1]) if self._foreign is not None else [])

    def capacity_changed(self, key: Key | None = None) -> None:
        """What `key`'s pools hold may have changed (its plan, its Deployments, its CR); None: anyone's (a class)."""
        if key is None or self._held_dirty is None:
            self._held_dirty = None
        else:
            self._held_dirty.add(key)

    def pools(self) -> list[dict[str, Any]]:
        """Every worker pool Deployment pdfleet manages: {namespace, deployment, role, class, replicas, name} (with
        those listed at start that kopf has not indexed yet)."""
        return [p for key in self.pool_owners() for p in self.pools_of(key)]

    def pool_owners(self) -> set[Key]:
        """The deployments with worker pool Deployments (indexed, or listed at start)."""
        return set(self.indexes.get("pool_index") or {}) | set(self._listed_children())

    def pools_of(self, key: Key) -> list[dict[str, Any]]:
        """One deployment's worker pool Deployments (`pool_view`s): kopf's, and those listed at start it has not
        indexed yet."""
        index = self.indexes.get("pool_index") or {}
        out = list(index[key]) if key in index else []
        listed = self._listed_children().get(key)
        if listed:
            indexed = {p["name"] for p in out}
            for (kind, name), obj in listed.items():
                view = pool_view(obj) if kind == "Deployment" and name not in indexed else None
                if view is not None:
                    out.append(view)
        return out

    def children(
        self, key: Key, uid: str, written: Mapping[tuple[str, str, str], Mapping[str, Any]]
    ) -> list[dict[str, Any]]:
        """The children `key` controls (its uid), from kopf's indexes, with this process's own writes laid over them
        (`written`: `client.Api.last_of(key)`: (kind, namespace, name) -> the object an apply returned, or
        {"deletedUid"}).

        NOTE: the index shows our writes a moment after they land; an object we wrote is taken from `written`
        when the index still holds an older version (by resourceVersion), and one we deleted is left out while
        the index still holds it, so a reconcile right after a write sees what the API server holds and
        writes nothing twice."""
        out: dict[tuple[str, str], dict[str, Any]] = {}
        for kind, index_name in CHILD_INDEXES.items():
            index = self.indexes.get(index_name) or {}
            for obj in index[key] if key in index else ():
                obj = {**obj, "kind": kind}
                out[(kind, obj["metadata"]["name"])] = obj
        # NOTE: right after a start kopf's indexes fill for minutes at scale; what the API listed then stands in for
        # a child not indexed yet (a status without the router's Deployment said "not serving" and was written).
        listed = self._listed_children().get(key)
        if listed is not None:
            missing = {k: o for k, o in listed.items() if k not in out}
            if missing:
                out.update(missing)
            else:
                self._listed.pop(key, None)
                self.capacity_changed(key)
        for (kind, namespace, name), mine in written.items():
            if namespace != key[0] or kind not in CHILD_INDEXES:
                continue
            seen = out.get((kind, name))
            if "deletedUid" in mine:
                if seen is not None and seen["metadata"].get("uid") == mine["deletedUid"]:
                    out.pop((kind, name))
                continue
            if ((mine.get("metadata") or {}).get("labels") or {}).get(names.LABEL_DEPLOYMENT) != key[1]:
                continue
            if seen is None or _newer(mine, seen):
                out[(kind, name)] = {**mine, "kind": kind}
        return [o for o in out.values() if _controlled_by(o, uid)]

    def keys_using(self, class_names: set[str]) -> list[Key]:
        """The deployments whose spec lists one of these classes."""
        return sorted(key for key, body in self.bodies().items() if classes_listed(body) & class_names)

    # --- once per process ------------------------------------------------------------------------------------
    async def sync(self, api: client.Api, namespaces: tuple[str, ...] = ()) -> None:
        """Wait until kopf's class and node indexes hold what the API lists (up to INDEX_SYNC_TIMEOUT_S), and keep
        the children the API lists, to stand in for those kopf has not indexed yet (`children`, `pools`).

        NOTE: kopf fills its indexes from watch streams while handlers (class and node events at
        start-up among them) already run. A plan made before every AcceleratorClass and Node is
        indexed sees less capacity or a missing class and would move serving pools, so the first
        reconcile of a process waits for both to be complete.
        """
        if self._synced is None:
            self._synced = asyncio.get_running_loop().create_task(self._sync(api, namespaces))
        try:
            await asyncio.shield(self._synced)
        except client.ApiError:
            self._synced = None  # the API was unreachable: the next reconcile lists again
            raise

    async def _sync(self, api: client.Api, namespaces: tuple[str, ...]) -> None:
        listed: dict[str, set] = {
            "class_index": {c["metadata"]["name"] for c in await api.list("AcceleratorClass", None)},
            "node_index": {n["metadata"]["name"] for n in await api.list("Node", None)},
        }
        # NOTE: namespaced mode lists the namespaces named literally; a glob's children come from kopf alone.
        scopes: tuple[str | None, ...] = tuple(n for n in namespaces if not _is_glob(n)) if namespaces else (None,)
        selector = f"app.kubernetes.io/managed-by={names.MANAGER}"
        children: dict[Key, dict[tuple[str, str], dict[str, Any]]] = {}
        for kind in CHILD_INDEXES:
            for ns in scopes:
                for o in await api.list(kind, ns, selector):
                    meta = o["metadata"]
                    owner = (meta.get("labels") or {}).get(names.LABEL_DEPLOYMENT)
                    if owner:
                        children.setdefault((meta["namespace"], owner), {})[(kind, meta["name"])] = {**o, "kind": kind}
        self._listed = children
        self.capacity_changed()
        self._listed_until = asyncio.get_running_loop().time() + LISTED_CHILDREN_S
        deadline = asyncio.get_running_loop().time() + INDEX_SYNC_TIMEOUT_S
        while True:
            missing = {name: sorted(want - set(self.indexes.get(name) or {})) for name, want in listed.items()}
            if not any(missing.values()):
                return
            if asyncio.get_running_loop().time() > deadline:
                logger.warning("planning with incomplete indexes after %ss: %s", INDEX_SYNC_TIMEOUT_S, missing)
                return
            await asyncio.sleep(0.05)

    def _listed_children(self) -> dict[Key, dict[tuple[str, str], dict[str, Any]]]:
        if self._listed and asyncio.get_running_loop().time() > self._listed_until:
            self._listed.clear()  # kopf's indexes are the truth from here on
            self.capacity_changed()
        return self._listed

    def child_gone(self, key: Key, kind: str, name: str) -> None:
        """A child was deleted (kopf's event): the start-up listing no longer stands in for it."""
        listed = self._listed.get(key)
        if listed is not None:
            listed.pop((kind, name), None)
        self.capacity_changed(key)

    # --- namespaced mode: the other namespaces' pods ---------------------------------------------------------
    async def refresh_foreign(self, api: client.Api, namespaces: tuple[str, ...], interval: float) -> str | None:
        """Namespaced mode: refresh the other namespaces' pods (at most every `interval` s); returns why they cannot
        be seen (RBAC forbids listing pods cluster-wide) or None.

        NOTE: kopf watches pods only in the namespaces it serves, but GPUs are shared by every namespace:
        without this a namespaced operator plans onto accelerators other teams' pods hold.
        """
        if not namespaces:
            return None
        loop = asyncio.get_running_loop()
        if self._foreign is None or loop.time() - self._foreign[0] >= interval:
            if self._foreign_task is None or self._foreign_task.done():
                self._foreign_task = loop.create_task(self._list_foreign(api, namespaces))
            await asyncio.shield(self._foreign_task)
        assert self._foreign is not None
        return self._foreign[2]

    async def _list_foreign(self, api: client.Api, namespaces: tuple[str, ...]) -> None:
        now = asyncio.get_running_loop().time()
        try:
            listed = await api.request(
                "GET", "/api/v1/pods", params={"fieldSelector": "status.phase!=Succeeded,status.phase!=Failed"}
            )
        except client.ApiError as exc:
            if exc.code not in (401, 403):
                raise  # the reconcile retries; the last list (if any) stays in use meanwhile
            self._foreign = (
                now,
                [],
                f"cannot list pods outside the watched namespaces ({exc.code} {exc.reason}: "
                f"{exc.message}): accelerators that other namespaces' pods hold count as free; "
                f"grant list on pods cluster-wide (the chart's ClusterRole does)",
            )
            logger.warning("capacity: %s", self._foreign[2])
            return
        views = [
            v
            for p in (listed or {}).get("items") or []
            if not watched((p.get("metadata") or {}).get("namespace") or "", namespaces)
            and (v := inventory.pod_view(p)) is not None
        ]
        self._foreign = (now, views, None)


def _newer(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether `a` is a later version of the object than `b` (resourceVersions as etcd writes them: integers)."""
    ra, rb = a["metadata"].get("resourceVersion"), b["metadata"].get("resourceVersion")
    try:
        return int(ra) > int(rb)
    except (TypeError, ValueError):
        return False  # not comparable: the index (the watch) wins


def _controlled_by(obj: Mapping[str, Any], uid: str) -> bool:
    return any(
        ref.get("controller") and ref.get("uid") == uid for ref in (obj["metadata"].get("ownerReferences") or [])
    )


def classes_listed(body: Mapping[str, Any]) -> set[str]:
    """The AcceleratorClasses an InferenceDeployment's roles list."""
    spec = body.get("spec") or {}
    return {
        c for role in ("prefill", "decode", "colocated") for c in (spec.get(role) or {}).get("acceleratorClasses", [])
    }


def watched(namespace: str, patterns: tuple[str, ...]) -> bool:
    """Whether kopf serves `namespace` given its --namespace globs (`!glob` excludes, as in kopf)."""
    positive = [p for p in patterns if not p.startswith("!")]
    if any(fnmatch.fnmatchcase(namespace, p[1:]) for p in patterns if p.startswith("!")):
        return False
    return any(fnmatch.fnmatchcase(namespace, p) for p in positive)


def capacity_condition(
    blind: str | None, namespaces: Iterable[str], interval: float, generation: int | None, now: Any
) -> Condition:
    """CapacityVisible: whether the other namespaces' pods are counted (namespaced mode)."""
    if blind is not None:
        return Condition(
            type="CapacityVisible",
            status="False",
            reason="PodsForbidden",
            message=blind,
            last_transition_time=now,
            observed_generation=generation,
        )
    return Condition(
        type="CapacityVisible",
        status="True",
        reason="AllNamespaces",
        message=f"pods outside {', '.join(namespaces)} are counted too (listed at most every {interval:g} s)",
        last_transition_time=now,
        observed_generation=generation,
    )


def pool_view(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """What the capacity inventory keeps of a worker pool Deployment (None for the router and others): what it
    holds or will hold, pods or not, so that capacity is counted right after a restart (issue 24, rule 7)."""
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    role, acc = labels.get(names.LABEL_ROLE), labels.get(names.LABEL_ACCELERATOR)
    if not role or role == names.ROUTER_ROLE or not acc or not labels.get(names.LABEL_DEPLOYMENT):
        return None
    return {
        "namespace": meta.get("namespace"),
        "deployment": labels[names.LABEL_DEPLOYMENT],
        "name": meta.get("name"),
        "role": role,
        "class": acc,
        "replicas": int((body.get("spec") or {}).get("replicas") or 0),
    }


def _is_glob(pattern: str) -> bool:
    return any(ch in pattern for ch in "*?[")
