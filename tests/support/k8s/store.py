"""The object store: resourceVersions, watch events, graceful and finalizer-held deletion, garbage collection by
``ownerReferences`` and namespace termination. Mixed into the emulator; every state change goes through
``_put``/``_remove`` here, which feed the watches and wake the controllers."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from tests.support.k8s.clock import parse_time
from tests.support.k8s.errors import ApiError, bad_request
from tests.support.k8s.rbac import RBAC_GROUP
from tests.support.k8s.resources import ApiResource, version_priority

DEFAULT_GRACE_S = 30  # a pod's terminationGracePeriodSeconds as the API server defaults it
DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
Key = tuple[str, str, str, str]  # (group, plural, namespace or "", name)


class Objects(dict):
    """The stored objects by key, with the keys of each resource (group, plural) kept apart: a list or a selector
    reads one resource's objects, not the whole store (an operator at 500 deployments lists one kind among ~8,000
    objects on every reconcile; a scan of the store per list was most of the emulator's CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self._by_resource: dict[tuple[str, str], set[Key]] = {}

    def __setitem__(self, key: Key, obj: dict) -> None:
        super().__setitem__(key, obj)
        self._by_resource.setdefault(key[:2], set()).add(key)

    def __delitem__(self, key: Key) -> None:
        super().__delitem__(key)
        self._by_resource.get(key[:2], set()).discard(key)

    def pop(self, key: Key, *default: dict | None) -> dict | None:
        self._by_resource.get(key[:2], set()).discard(key)
        return super().pop(key, *default)

    def keys_of(self, group: str, plural: str) -> list[Key]:
        """The keys of one resource's objects, in key order."""
        return sorted(self._by_resource.get((group, plural), ()))

    # dict's other writers go through the three above (they would bypass the per-resource keys otherwise).
    def setdefault(self, key: Key, obj: dict) -> dict:  # type: ignore[override]
        if key not in self:
            self[key] = obj
        return self[key]

    def update(self, *args: object, **kwargs: object) -> None:  # type: ignore[override]
        for key, obj in dict(*args, **kwargs).items():
            self[key] = obj

    def popitem(self) -> tuple[Key, dict]:
        key, obj = super().popitem()
        self._by_resource.get(key[:2], set()).discard(key)
        return key, obj

    def clear(self) -> None:
        super().clear()
        self._by_resource.clear()


@dataclass
class Event:
    """One change of the store, as the watches translate it for each client."""

    rv: int
    group: str
    plural: str
    namespace: str
    type: str
    obj: dict
    old: dict | None


class StoreMixin:
    """The stored objects of the emulator and their lifecycle."""

    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    @staticmethod
    def _key(res: ApiResource, namespace: str | None, name: str) -> Key:
        return (res.group, res.plural, (namespace or "") if res.namespaced else "", name)

    def _res_for_key(self, key: Key) -> ApiResource:
        matches = [r for r in self._api.values() if r.group == key[0] and r.plural == key[1]]
        matches.sort(key=lambda r: version_priority(r.version))
        return matches[0]

    def _emit(self, type_: str, key: Key, obj: dict, old: dict | None) -> None:
        event = Event(int(obj["metadata"]["resourceVersion"]), key[0], key[1], key[2], type_, obj, old)
        self._events.append(event)
        for queue in list(self._watchers):
            queue.put_nowait(event)
        if key[0] == RBAC_GROUP:
            self._rbac_rules.clear()
        if self.workloads is not None and self.workloads.watches(key):
            self._workloads_due()

    def _put(self, key: Key, obj: dict, type_: str, old: dict | None) -> dict:
        obj["metadata"]["resourceVersion"] = str(self._next_rv())
        self._store[key] = obj
        self._uids[obj["metadata"]["uid"]] = key
        self._emit(type_, key, copy.deepcopy(obj), copy.deepcopy(old) if old is not None else None)
        return obj

    def _remove(self, key: Key, obj: dict) -> dict:
        """Remove for good: DELETED event, then namespace/CRD/GC follow-ups."""
        if key not in self._store:
            return obj
        old = self._store.pop(key)
        self._applied.pop(key, None)
        final = copy.deepcopy(old)
        final["metadata"]["resourceVersion"] = str(self._next_rv())
        self._uids.pop(final["metadata"].get("uid", ""), None)
        self._emit("DELETED", key, final, old)
        if key[0] == "apiextensions.k8s.io" and key[1] == "customresourcedefinitions":
            self._unregister_crd(final, keep_objects=False)
        self._collect_garbage(final["metadata"].get("uid"))
        if key[2]:
            self._maybe_finish_namespace(key[2])
        return final

    def _collect_garbage(self, owner_uid: str | None) -> None:
        if not owner_uid:
            return
        for key, obj in list(self._store.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if not any(ref.get("uid") == owner_uid for ref in refs):
                continue
            if any(ref.get("uid") in self._uids for ref in refs if ref.get("uid") != owner_uid):
                continue  # another owner is still alive
            if key in self._store:
                self._delete_key(key, propagation="Background")

    def _orphan_dependents(self, owner_uid: str) -> None:
        for key, obj in list(self._store.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if any(ref.get("uid") == owner_uid for ref in refs):
                new = copy.deepcopy(obj)
                kept = [ref for ref in refs if ref.get("uid") != owner_uid]
                if kept:
                    new["metadata"]["ownerReferences"] = kept
                else:
                    new["metadata"].pop("ownerReferences", None)
                self._put(key, new, "MODIFIED", obj)

    def _dependents(self, owner_uid: str) -> list[Key]:
        return [
            key
            for key, obj in self._store.items()
            if any(ref.get("uid") == owner_uid for ref in obj["metadata"].get("ownerReferences") or [])
        ]

    def _maybe_finish_namespace(self, namespace: str) -> None:
        ns_key = ("", "namespaces", "", namespace)
        ns = self._store.get(ns_key)
        if ns is None or not ns["metadata"].get("deletionTimestamp"):
            return
        if any(k[2] == namespace for k in self._store):
            return
        self._remove(ns_key, ns)

    def _delete_key(self, key: Key, *, propagation: str | None, grace: int | str | None = None) -> dict:
        obj = self._store[key]
        uid = obj["metadata"]["uid"]
        if propagation == "Orphan":
            self._orphan_dependents(uid)
        elif propagation == "Foreground":
            for dep in self._dependents(uid):
                if dep in self._store:
                    self._delete_key(dep, propagation="Foreground")
        obj = self._store.get(key)
        if obj is None:
            return {}
        if key[:2] == ("", "namespaces"):
            return self._terminate_namespace(key, obj)
        graceful = self._graceful_deletion(key, obj, grace)
        if graceful is not None:
            return graceful
        if obj["metadata"].get("finalizers"):
            if obj["metadata"].get("deletionTimestamp"):
                return obj
            new = copy.deepcopy(obj)
            new["metadata"]["deletionTimestamp"] = self.clock.iso()
            new["metadata"]["deletionGracePeriodSeconds"] = 0
            return self._put(key, new, "MODIFIED", obj)
        return self._remove(key, obj)

    def _graceful_deletion(self, key: Key, obj: dict, requested: int | str | None) -> dict | None:
        """A pod's graceful deletion (with the workloads' ``graceful_termination`` on): ``deletionTimestamp`` = now +
        its grace period, and it stays until the kubelet finishes (``_finish_termination``); a shorter grace
        period of a later delete brings that forward. None: delete as any other object."""
        if key[:2] != ("", "pods") or self.workloads is None or not self.workloads.graceful_termination:
            return None
        grace = pod_grace_period(obj, requested)
        meta = obj["metadata"]
        current = meta.get("deletionGracePeriodSeconds")
        if meta.get("deletionTimestamp") and not current:
            return None  # held by finalizers only: as any other object
        if grace == 0:
            return None
        if current is not None and grace >= current:
            return obj
        requested_at = (
            self.clock.time()
            if current is None
            else (parse_time(meta["deletionTimestamp"]) or self.clock.time()) - current
        )
        new = copy.deepcopy(obj)
        new["metadata"]["deletionTimestamp"] = self.clock.iso(requested_at + grace)
        new["metadata"]["deletionGracePeriodSeconds"] = grace
        return self._put(key, new, "MODIFIED", obj)

    def _finish_termination(self, key: Key) -> None:
        """The kubelet's last word on a gracefully deleted pod: gone, or held by its finalizers from now on."""
        obj = self._store.get(key)
        if obj is None:
            return
        if not obj["metadata"].get("finalizers"):
            self._remove(key, obj)
            return
        new = copy.deepcopy(obj)
        new["metadata"]["deletionGracePeriodSeconds"] = 0
        self._put(key, new, "MODIFIED", obj)

    def _terminate_namespace(self, key: Key, obj: dict) -> dict:
        if not obj["metadata"].get("deletionTimestamp"):
            new = copy.deepcopy(obj)
            new["metadata"]["deletionTimestamp"] = self.clock.iso()
            new["status"] = {"phase": "Terminating"}
            obj = self._put(key, new, "MODIFIED", obj)
        name = key[3]
        for sub in [k for k in self._store if k[2] == name]:
            if sub in self._store:
                self._delete_key(sub, propagation="Background")
        self._maybe_finish_namespace(name)
        return self._store.get(key, obj)

    def _check_namespace(self, res: ApiResource, namespace: str | None) -> None:
        if not res.namespaced:
            return
        if not namespace:
            raise bad_request("the namespace of the object is required for a namespaced resource")
        ns = self._store.get(("", "namespaces", "", namespace))
        if ns is None:
            if self.auto_create_namespaces:
                self._create(
                    self.resource_for("", "v1", "namespaces"),
                    None,
                    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
                )
                return
            raise ApiError(
                404, "NotFound", f'namespaces "{namespace}" not found', {"name": namespace, "kind": "namespaces"}
            )
        if ns["metadata"].get("deletionTimestamp"):
            raise ApiError(
                403,
                "Forbidden",
                f"{res.group_resource} is forbidden: unable to create new content in namespace "
                f"{namespace} because it is being terminated",
                {"group": res.group, "kind": res.plural},
            )

    def compact(self) -> int:
        """Forget the event history: watches from an older resourceVersion get 410 Gone (like etcd compaction)."""
        self._compacted_rv = self._rv
        self._events.clear()
        return self._rv

    @property
    def resource_version(self) -> int:
        return self._rv


def pod_grace_period(pod: dict, requested: int | str | None) -> int:
    """The grace period of a pod's deletion: the request's ``gracePeriodSeconds``, else the pod's
    ``terminationGracePeriodSeconds`` (30); 0 for a pod no node runs or one that has finished, as the API server
    deletes those at once."""
    spec = pod.get("spec") or {}
    if not spec.get("nodeName") or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return 0
    try:
        grace = (
            int(requested) if requested is not None else int(spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S))
        )
    except (TypeError, ValueError):
        raise bad_request(f"gracePeriodSeconds must be an integer, not {requested!r}") from None
    return max(0, grace)
