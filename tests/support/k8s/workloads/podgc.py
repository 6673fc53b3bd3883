"""The pod garbage collector's orphan rule: a pod bound to a Node that no longer exists is force-deleted
(``DisruptionTarget`` reason ``DeletionByPodGC``) once the node has been missing for the quarantine time, as
kube-controller-manager does (40 s, on the emulator's clock). Terminated-pod thresholds are not emulated."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tests.support.k8s.workloads.objects import NODE_KEY, POD_KEY, Key, Store

if TYPE_CHECKING:  # pragma: no cover
    from tests.support.k8s.workloads import Workloads

QUARANTINE_S = 40.0


class PodGC:
    """Removes pods whose node is gone."""

    def __init__(self, workloads: Workloads) -> None:
        self.wl = workloads
        self.s: Store = workloads.store
        self.orphaned_since: dict[Key, float] = {}  # pod -> when its node was first seen missing

    def run(self) -> bool:
        nodes = {k[3] for k, _ in self.s.objects(NODE_KEY)}
        now, changed, seen = self.s.now(), False, set()
        for key, pod in self.s.objects(POD_KEY):
            node = (pod.get("spec") or {}).get("nodeName")
            if not node or node in nodes:
                continue
            seen.add(key)
            since = self.orphaned_since.setdefault(key, now)
            if now >= since + QUARANTINE_S:
                self.wl.mark_disruption(key, pod, "DeletionByPodGC", "PodGC: node no longer exists")
                self.s.delete(key, grace=0)
                changed = True
        self.orphaned_since = {k: v for k, v in self.orphaned_since.items() if k in seen and k in self.s.kube._store}
        return changed

    def next_due(self) -> float | None:
        now = self.s.now()
        due = [since + QUARANTINE_S for since in self.orphaned_since.values() if since + QUARANTINE_S > now]
        return min(due) if due else None
