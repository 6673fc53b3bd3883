"""What the emulator's controllers share: the kinds they watch, reading and writing the store from a controller,
and small readers of Pods, Nodes and conditions as the Kubernetes controllers read them."""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pdfleet_operator.api import parse_quantity

if TYPE_CHECKING:  # pragma: no cover
    from tests.support.k8s.emulator import KubernetesApiEmulator

Key = tuple[str, str, str, str]  # (group, plural, namespace or "", name): the emulator's store keys
POD_KEY = ("", "pods")
NODE_KEY = ("", "nodes")
DEPLOYMENT_KEY = ("apps", "deployments")
REPLICASET_KEY = ("apps", "replicasets")
PDB_KEY = ("policy", "poddisruptionbudgets")
WATCHED = frozenset({POD_KEY, NODE_KEY, DEPLOYMENT_KEY, REPLICASET_KEY, PDB_KEY})
FINISHED = frozenset({"Succeeded", "Failed"})
HASH_LABEL = "pod-template-hash"


def template_hash(template: dict) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def requests_of(pod: dict) -> dict[str, float]:
    """The scheduler's view of a pod: per resource, containers summed, the largest init container, overhead, 1 pod."""
    spec = pod.get("spec") or {}

    def of(container: dict) -> dict[str, float]:
        res = container.get("resources") or {}
        merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        return {k: parse_quantity(v) for k, v in merged.items()}

    total: dict[str, float] = {}
    for c in spec.get("containers") or []:
        for k, v in of(c).items():
            total[k] = total.get(k, 0.0) + v
    for c in spec.get("initContainers") or []:
        for k, v in of(c).items():
            total[k] = max(total.get(k, 0.0), v)
    for k, v in (spec.get("overhead") or {}).items():
        total[k] = total.get(k, 0.0) + parse_quantity(v)
    total["pods"] = total.get("pods", 0.0) + 1
    return total


def scaled_value(value: int | str | None, total: int, *, round_up: bool, default: int | str) -> int:
    """apimachinery's ``GetScaledValueFromIntOrPercent``: an int as is, ``"25%"`` of `total` rounded up or down."""
    value = default if value is None else value
    if isinstance(value, bool):
        raise ValueError(f"invalid int or percent: {value!r}")
    if isinstance(value, int):
        return value
    text = str(value)
    if not text.endswith("%") or not text[:-1].lstrip("-").isdigit():
        raise ValueError(f"invalid value for IntOrString: invalid type: string is not a percentage: {text!r}")
    fraction = int(text[:-1]) * total / 100
    return math.ceil(fraction) if round_up else math.floor(fraction)


def condition(obj: dict, type_: str) -> dict | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return None


def node_ready(node: dict) -> str:
    """The node's Ready condition status: "True", "False" or "Unknown" (a node that reports none counts as Ready,
    as the emulator's nodes always did)."""
    cond = condition(node, "Ready")
    return "True" if cond is None else str(cond.get("status"))


def pod_ready(pod: dict) -> bool:
    cond = condition(pod, "Ready")
    return cond is not None and cond.get("status") == "True"


def controller_of(obj: dict) -> dict | None:
    """The ownerReference with ``controller: true``, if any."""
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("controller"):
            return ref
    return None


def active(pod: dict) -> bool:
    """Counted by its ReplicaSet (``FilterActivePods``): neither finished nor being deleted."""
    return (pod.get("status") or {}).get("phase") not in FINISHED and not pod["metadata"].get("deletionTimestamp")


class Store:
    """A controller's access to the emulator's store (on its loop)."""

    def __init__(self, emulator: KubernetesApiEmulator) -> None:
        self.kube = emulator

    def objects(self, group_plural: tuple[str, str]) -> list[tuple[Key, dict]]:
        return sorted((k, o) for k, o in self.kube._store.items() if k[:2] == group_plural)

    def get(self, key: Key) -> dict | None:
        return self.kube._store.get(key)

    def owned(self, group_plural: tuple[str, str], owner: dict) -> Iterator[tuple[Key, dict]]:
        """The objects of a kind whose controller reference is `owner`."""
        uid, ns = owner["metadata"]["uid"], owner["metadata"].get("namespace") or ""
        for key, obj in self.objects(group_plural):
            ref = controller_of(obj)
            if key[2] == ns and ref is not None and ref.get("uid") == uid:
                yield key, obj

    def write_status(self, key: Key, new: dict) -> bool:
        """Store `new` (a changed status; what a controller writes through the status subresource) unless equal."""
        old = self.kube._store.get(key)
        if old is None or old == new:
            return False
        self.kube._put(key, new, "MODIFIED", old)
        return True

    def update(self, key: Key, new: dict) -> bool:
        """A main-resource update (spec or metadata; generation bumps as the API server does) unless a no-op."""
        old = self.kube._store.get(key)
        if old is None:
            return False
        res = self.kube._res_for_key(key)
        before = old["metadata"]["resourceVersion"]
        body = copy.deepcopy(new)
        body["metadata"].pop("resourceVersion", None)
        stored = self.kube._update(res, key[2] or None, key[3], body, old=old)
        return stored["metadata"]["resourceVersion"] != before

    def create(self, group_plural: tuple[str, str], namespace: str, body: dict) -> dict:
        res = next(r for r in self.kube._api.values() if (r.group, r.plural) == group_plural and r.crd is None)
        return self.kube._create(res, namespace, body)

    def delete(self, key: Key, *, grace: int | None = None) -> None:
        if key in self.kube._store:
            self.kube._delete_key(key, propagation="Background", grace=grace)

    def now(self) -> float:
        return self.kube.clock.time()

    def iso(self, at: float | None = None) -> str:
        return self.kube.clock.iso(at)


def with_condition(conditions: list[dict], new: dict, now: str, *, update_time: bool = False) -> list[dict]:
    """Set one condition as Kubernetes controllers do: unchanged status and reason keep it as is; a changed status
    sets lastTransitionTime; `update_time` conditions (Deployments') carry lastUpdateTime too."""
    out = [dict(c) for c in conditions]
    current = next((c for c in out if c.get("type") == new["type"]), None)
    if current is not None and current.get("status") == new["status"] and current.get("reason") == new.get("reason"):
        return out
    cond: dict[str, Any] = dict(new)
    if update_time:
        cond["lastUpdateTime"] = now
    changed_status = current is None or current.get("status") != new["status"]
    cond["lastTransitionTime"] = now if changed_status else current.get("lastTransitionTime", now)
    out = [c for c in out if c.get("type") != new["type"]] + [cond]
    return out
