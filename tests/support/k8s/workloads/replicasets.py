"""The ReplicaSet controller: keeps ``spec.replicas`` active pods per ReplicaSet (owned by it, so they go with it
by garbage collection), removes surplus pods in Kubernetes' order (unbound, Pending, not ready, ready most
recently, newest first) and writes its status (replicas, readyReplicas, availableReplicas after
``minReadySeconds``)."""

from __future__ import annotations

import copy
import secrets
import string

from tests.support.k8s.clock import parse_time
from tests.support.k8s.workloads.objects import POD_KEY, REPLICASET_KEY, Key, Store, active, condition, pod_ready

PHASE_RANK = {"Pending": 0, "Unknown": 1, "Running": 2}


def _replicas(rs: dict) -> int:
    value = (rs.get("spec") or {}).get("replicas")
    return 1 if value is None else int(value)


def ready_since(pod: dict) -> float | None:
    """When the pod last became Ready (its Ready condition's lastTransitionTime); None: not ready."""
    if not pod_ready(pod):
        return None
    cond = condition(pod, "Ready") or {}
    return parse_time(cond.get("lastTransitionTime")) or 0.0


def available(pod: dict, min_ready_s: int, now: float) -> bool:
    since = ready_since(pod)
    return since is not None and (min_ready_s <= 0 or since + min_ready_s <= now)


def deletion_rank(pod: dict) -> tuple:
    """``ActivePodsWithRanks``: the pods a scale-down removes first sort first."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    since = ready_since(pod)
    return (
        bool(spec.get("nodeName")),
        PHASE_RANK.get(status.get("phase") or "Pending", 0),
        since is not None,
        -(since or 0.0),
        _negated(pod["metadata"].get("creationTimestamp") or ""),
        pod["metadata"]["name"],
    )


def _negated(timestamp: str) -> tuple[int, ...]:
    return tuple(-ord(c) for c in timestamp)  # newer (greater) timestamps first


class ReplicaSetController:
    """Pods for ReplicaSets, and their status."""

    def __init__(self, store: Store) -> None:
        self.s = store

    def run(self) -> bool:
        changed = False
        for key, rs in self.s.objects(REPLICASET_KEY):
            if not rs["metadata"].get("deletionTimestamp"):
                changed = self._manage(key, rs) or changed
        return changed

    def statuses(self) -> bool:
        changed = False
        now = self.s.now()
        for key, rs in self.s.objects(REPLICASET_KEY):
            pods = [p for _, p in self.s.owned(POD_KEY, rs) if active(p)]
            min_ready = int((rs.get("spec") or {}).get("minReadySeconds") or 0)
            labels = ((rs.get("spec") or {}).get("template") or {}).get("metadata", {}).get("labels") or {}
            status = {
                "replicas": len(pods),
                "fullyLabeledReplicas": sum(
                    all((p["metadata"].get("labels") or {}).get(k) == v for k, v in labels.items()) for p in pods
                ),
                "readyReplicas": sum(pod_ready(p) for p in pods),
                "availableReplicas": sum(available(p, min_ready, now) for p in pods),
                "observedGeneration": rs["metadata"].get("generation", 1),
            }
            status = {k: v for k, v in status.items() if v or k == "replicas"}  # (replicas is not omitempty)
            if rs.get("status", {}).get("conditions"):
                status["conditions"] = rs["status"]["conditions"]
            if status != (rs.get("status") or {}):
                new = copy.deepcopy(rs)
                new["status"] = status
                changed = self.s.write_status(key, new) or changed
        return changed

    def next_due(self) -> float | None:
        """When a Ready pod of a ReplicaSet with minReadySeconds becomes available."""
        now, due = self.s.now(), []
        for _, rs in self.s.objects(REPLICASET_KEY):
            min_ready = int((rs.get("spec") or {}).get("minReadySeconds") or 0)
            if min_ready <= 0:
                continue
            for _, pod in self.s.owned(POD_KEY, rs):
                since = ready_since(pod)
                if since is not None and active(pod) and since + min_ready > now:
                    due.append(since + min_ready)
        return min(due) if due else None

    def _manage(self, key: Key, rs: dict) -> bool:
        pods = [(k, p) for k, p in self.s.owned(POD_KEY, rs) if active(p)]
        diff = len(pods) - _replicas(rs)
        for _ in range(-diff):
            self.s.create(POD_KEY, key[2], self._pod_for(rs))
        if diff > 0:
            for pod_key, _ in sorted(pods, key=lambda kp: deletion_rank(kp[1]))[:diff]:
                self.s.delete(pod_key)
        return diff != 0

    @staticmethod
    def _pod_for(rs: dict) -> dict:
        template = (rs.get("spec") or {}).get("template") or {}
        meta = copy.deepcopy(template.get("metadata") or {})
        name = rs["metadata"]["name"]
        suffix = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(5))
        meta["name"] = f"{name}-{suffix}"
        meta["namespace"] = rs["metadata"]["namespace"]
        meta["ownerReferences"] = [
            {
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "name": name,
                "uid": rs["metadata"]["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": copy.deepcopy(template.get("spec") or {})}
