"""The node lifecycle controller: the taints Kubernetes puts on Nodes by their state, pods marked not ready on a
Node that is not Ready, and taint-based eviction.

* ``spec.unschedulable`` (a cordon) → ``node.kubernetes.io/unschedulable:NoSchedule``; running pods stay.
* ``Ready=False`` → ``node.kubernetes.io/not-ready`` (NoSchedule and NoExecute), ``Ready=Unknown`` →
  ``node.kubernetes.io/unreachable`` (both), NoExecute ones with ``timeAdded``; removed when Ready again.
  The pods on such a node get ``Ready=False`` (``MarkPodsNotReady``).
* NoExecute taints evict: a pod that does not tolerate one is deleted at once; one that tolerates them with
  ``tolerationSeconds`` is deleted that long (the shortest of its matching tolerations) after the controller
  first saw it on the tainted node, on the emulator's clock; tolerations without seconds keep it forever.
  An evicted pod gets ``DisruptionTarget=True`` (reason ``DeletionByTaintManager``) before its deletion.

Not emulated: the controller setting ``Ready=Unknown`` when a kubelet stops posting status (tests set the
condition), rate-limited zone evictions, the other condition taints (memory/disk/PID pressure).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from tests.support.k8s.workloads.objects import FINISHED, NODE_KEY, POD_KEY, Key, Store, node_ready
from tests.support.k8s.workloads.scheduler import matching_toleration

if TYPE_CHECKING:  # pragma: no cover
    from tests.support.k8s.workloads import Workloads

UNSCHEDULABLE = "node.kubernetes.io/unschedulable"
NOT_READY = "node.kubernetes.io/not-ready"
UNREACHABLE = "node.kubernetes.io/unreachable"
MANAGED = frozenset({UNSCHEDULABLE, NOT_READY, UNREACHABLE})


def wanted_taints(node: dict) -> list[tuple[str, str]]:
    """(key, effect) of the taints the controller keeps on this node."""
    out = [(UNSCHEDULABLE, "NoSchedule")] if (node.get("spec") or {}).get("unschedulable") else []
    ready = node_ready(node)
    if ready == "False":
        out += [(NOT_READY, "NoSchedule"), (NOT_READY, "NoExecute")]
    elif ready != "True":
        out += [(UNREACHABLE, "NoSchedule"), (UNREACHABLE, "NoExecute")]
    return out


class NodeLifecycle:
    """Node taints, pods on unready nodes, NoExecute evictions."""

    def __init__(self, workloads: Workloads) -> None:
        self.wl = workloads
        self.s: Store = workloads.store
        # pod key -> (when the controller first saw it tolerating the node's NoExecute taints, when it goes)
        self.scheduled: dict[Key, tuple[float, float]] = {}

    def run(self) -> bool:
        changed = False
        for key, node in self.s.objects(NODE_KEY):
            changed = self._taint(key, node) or changed
        nodes = {k[3]: n for k, n in self.s.objects(NODE_KEY)}
        for key, pod in self.s.objects(POD_KEY):
            node = nodes.get((pod.get("spec") or {}).get("nodeName") or "")
            if node is None or (pod.get("status") or {}).get("phase") in FINISHED:
                self.scheduled.pop(key, None)
                continue
            if node_ready(node) != "True":
                changed = self._mark_not_ready(key, pod) or changed
            if not pod["metadata"].get("deletionTimestamp"):
                changed = self._evict_if_due(key, pod, node) or changed
        for key in [k for k in self.scheduled if k not in self.s.kube._store]:
            del self.scheduled[key]
        return changed

    def next_due(self) -> float | None:
        now = self.s.now()
        due = [at for _, at in self.scheduled.values() if at > now]
        return min(due) if due else None

    def _taint(self, key: Key, node: dict) -> bool:
        wanted = wanted_taints(node)
        kept, present = [], set()
        for taint in (node.get("spec") or {}).get("taints") or []:
            pair = (taint.get("key"), taint.get("effect"))
            if taint.get("key") not in MANAGED:
                kept.append(taint)
            elif pair in wanted and pair not in present:
                kept.append(taint)
                present.add(pair)
        for k, effect in wanted:
            if (k, effect) not in present:
                kept.append(
                    {"key": k, "effect": effect, **({"timeAdded": self.s.iso()} if effect == "NoExecute" else {})}
                )
        if kept == ((node.get("spec") or {}).get("taints") or []):
            return False
        new = copy.deepcopy(node)
        new.setdefault("spec", {})["taints"] = kept
        if not kept:
            new["spec"].pop("taints")
        return self.s.update(key, new)

    def _mark_not_ready(self, key: Key, pod: dict) -> bool:
        conditions = (pod.get("status") or {}).get("conditions") or []
        if not any(c.get("type") == "Ready" and c.get("status") != "False" for c in conditions):
            return False
        new = copy.deepcopy(pod)
        for cond in new["status"]["conditions"]:
            if cond.get("type") == "Ready":
                cond["status"] = "False"
                cond["lastTransitionTime"] = self.s.iso()
        return self.s.write_status(key, new)

    def _evict_if_due(self, key: Key, pod: dict, node: dict) -> bool:
        taints = [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("effect") == "NoExecute"]
        if not taints:
            self.scheduled.pop(key, None)
            return False
        tolerations = (pod.get("spec") or {}).get("tolerations") or []
        used = [matching_toleration(tolerations, t) for t in taints]
        now = self.s.now()
        if any(tol is None for tol in used):
            return self._evict(key, pod)
        seconds = [
            int(tol["tolerationSeconds"])
            for tol in used
            if tol is not None and tol.get("tolerationSeconds") is not None
        ]
        if not seconds:
            self.scheduled.pop(key, None)  # tolerated for ever
            return False
        start = self.scheduled[key][0] if key in self.scheduled else now
        self.scheduled[key] = (start, start + max(0, min(seconds)))
        return self._evict(key, pod) if now >= self.scheduled[key][1] else False

    def _evict(self, key: Key, pod: dict) -> bool:
        self.scheduled.pop(key, None)
        self.wl.mark_disruption(key, pod, "DeletionByTaintManager", "Taint manager: deleting due to NoExecute taint")
        self.wl.taint_evictions.append(f"{key[2]}/{key[3]}")
        self.s.delete(key)
        return True
