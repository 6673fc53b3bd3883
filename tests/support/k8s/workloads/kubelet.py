"""The kubelets of every Node: start bound pods (``Running``, ``startTime``, container statuses), report readiness
(``Ready``/``ContainersReady``: True at once unless a test holds or fails it, see ``Workloads.hold_ready``),
and finish graceful terminations when their grace period has passed on the emulator's clock.

A kubelet whose Node is not Ready does nothing for it (the node lifecycle controller marks its pods not ready);
one whose Node is ``Unknown`` (unreachable) never finishes a termination, so such pods stay ``Terminating``
as on a cluster, until the node returns or is deleted (then the pod garbage collector removes them).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from tests.support.k8s.clock import parse_time
from tests.support.k8s.workloads.objects import FINISHED, NODE_KEY, POD_KEY, Key, Store, node_ready, pod_ready

if TYPE_CHECKING:  # pragma: no cover
    from tests.support.k8s.workloads import Workloads

HOST_IP = "10.0.0.1"


class Kubelet:
    """Pod lifecycle on the nodes."""

    def __init__(self, workloads: Workloads) -> None:
        self.wl = workloads
        self.s: Store = workloads.store

    def run(self) -> bool:
        nodes = {k[3]: n for k, n in self.s.objects(NODE_KEY)}
        now = self.s.now()
        changed = False
        for key, pod in self.s.objects(POD_KEY):
            node = nodes.get((pod.get("spec") or {}).get("nodeName") or "")
            if node is None or (pod.get("status") or {}).get("phase") in FINISHED:
                continue
            if pod["metadata"].get("deletionTimestamp"):
                changed = self._terminate(key, pod, node, now) or changed
            elif node_ready(node) == "True":
                changed = self._run(key, pod, now) or changed
        return changed

    def next_due(self) -> float | None:
        """The next held readiness that runs out, or the next grace period that ends."""
        nodes = {k[3]: n for k, n in self.s.objects(NODE_KEY)}
        now, due = self.s.now(), []
        for _, pod in self.s.objects(POD_KEY):
            node = nodes.get((pod.get("spec") or {}).get("nodeName") or "")
            if node is None:
                continue
            deleting = pod["metadata"].get("deletionTimestamp")
            if (
                deleting
                and self.wl.graceful_termination
                and pod["metadata"].get("deletionGracePeriodSeconds")
                and node_ready(node) != "Unknown"
            ):
                at = parse_time(deleting)
                if at is not None and at > now:
                    due.append(at)
            elif not deleting and not pod_ready(pod):
                started = parse_time((pod.get("status") or {}).get("startTime"))
                due += [d for d in self.wl.readiness_due(pod, started) if d > now]
        return min(due) if due else None

    def _run(self, key: Key, pod: dict, now: float) -> bool:
        st = pod.get("status") or {}
        if st.get("phase") not in (None, "Pending", "Running"):
            return False
        start = st.get("startTime") or self.s.iso(now)
        ready = self.wl.ready(pod, parse_time(start) or now, now)
        status = {
            **st,
            "phase": "Running",
            "hostIP": st.get("hostIP") or HOST_IP,
            "startTime": start,
            "conditions": self._conditions(pod, ready, now),
            "containerStatuses": self._containers(pod, ready, start),
        }
        return self._write(key, pod, status)

    def _terminate(self, key: Key, pod: dict, node: dict, now: float) -> bool:
        """A graceful deletion: the pod stops being ready at once and is removed when its grace period is over."""
        grace = pod["metadata"].get("deletionGracePeriodSeconds")
        if not self.wl.graceful_termination or not grace or node_ready(node) == "Unknown":
            return False  # held by finalizers only, or a kubelet nobody can reach
        st = pod.get("status") or {}
        status = {**st, "conditions": self._conditions(pod, False, now)}
        if st.get("startTime"):
            status["containerStatuses"] = self._containers(pod, False, st["startTime"])
        changed = self._write(key, pod, status)
        due = parse_time(pod["metadata"]["deletionTimestamp"])
        if due is not None and now >= due:
            self.wl.store.kube._finish_termination(key)
            changed = True
        return changed

    def _conditions(self, pod: dict, ready: bool, now: float) -> list[dict]:
        current = {c.get("type"): c for c in (pod.get("status") or {}).get("conditions") or []}
        names = [c.get("name") for c in (pod.get("spec") or {}).get("containers") or []]
        out = []
        for type_, ok in (("PodScheduled", True), ("Initialized", True), ("ContainersReady", ready), ("Ready", ready)):
            cond = {"type": type_, "status": "True" if ok else "False"}
            if not ok:
                cond["reason"] = "ContainersNotReady"
                cond["message"] = f"containers with unready status: [{' '.join(str(n) for n in names)}]"
            before = current.get(type_) or {}
            same = before.get("status") == cond["status"]
            cond["lastTransitionTime"] = (
                before.get("lastTransitionTime") if same and before.get("lastTransitionTime") else self.s.iso(now)
            )
            out.append(cond)
        return out

    @staticmethod
    def _containers(pod: dict, ready: bool, start: str) -> list[dict]:
        out = []
        for c in (pod.get("spec") or {}).get("containers") or []:
            out.append(
                {
                    "name": c.get("name"),
                    "image": c.get("image"),
                    "imageID": "",
                    "ready": ready,
                    "started": True,
                    "restartCount": 0,
                    "state": {"running": {"startedAt": start}},
                }
            )
        return out

    def _write(self, key: Key, pod: dict, status: dict) -> bool:
        if status == (pod.get("status") or {}):
            return False
        new = copy.deepcopy(pod)
        new["status"] = status
        return self.s.write_status(key, new)
