"""The disruption controller: each PodDisruptionBudget's status, as kube-controller-manager computes it, which the
Eviction subresource (:mod:`tests.support.k8s.eviction`) then enforces.

Over the pods its selector matches in its namespace: ``expectedPods`` (``minAvailable`` as an int: the number of
such pods; a percentage or ``maxUnavailable``: the sum of the replicas their controllers want, a ReplicaSet's
Deployment's included; pods without a controller are ignored), ``desiredHealthy`` (``minAvailable``, its
percentage rounded up, or expected minus ``maxUnavailable`` rounded up), ``currentHealthy`` (Ready pods not
being deleted and not recently evicted), ``disruptionsAllowed`` (their difference, 0 when none or no pods
expected), ``disruptedPods`` (evictions not yet seen through, dropped after 2 minutes), ``observedGeneration``
and the ``DisruptionAllowed`` condition. A controller without a replica count (a DaemonSet) or one that
cannot be found fails safe: ``disruptionsAllowed: 0``, ``DisruptionAllowed=False`` reason ``SyncFailed``.
"""

from __future__ import annotations

import copy
from typing import Any

from tests.support.k8s.clock import parse_time
from tests.support.k8s.selectors import selector_matches
from tests.support.k8s.workloads.objects import PDB_KEY, POD_KEY, Key, Store, controller_of, pod_ready, scaled_value

DELETION_TIMEOUT_S = 120.0  # an eviction the controller has not seen go through by then no longer counts


class SyncFailed(Exception):
    """The expected pod count cannot be known (kube-controller-manager then fails safe)."""


class DisruptionController:
    """PodDisruptionBudget status."""

    def __init__(self, store: Store) -> None:
        self.s = store

    def run(self) -> bool:
        changed = False
        for key, pdb in self.s.objects(PDB_KEY):
            changed = self._sync(key, pdb) or changed
        return changed

    def next_due(self) -> float | None:
        now, due = self.s.now(), []
        for _, pdb in self.s.objects(PDB_KEY):
            for stamp in ((pdb.get("status") or {}).get("disruptedPods") or {}).values():
                at = parse_time(stamp)
                if at is not None and at + DELETION_TIMEOUT_S > now:
                    due.append(at + DELETION_TIMEOUT_S)
        return min(due) if due else None

    def _sync(self, key: Key, pdb: dict) -> bool:
        selector = (pdb.get("spec") or {}).get("selector")
        pods = [
            (k, p)
            for k, p in self.s.objects(POD_KEY)
            if k[2] == key[2] and selector_matches(selector, p["metadata"].get("labels"))
        ]
        generation = pdb["metadata"].get("generation", 1)
        before = pdb.get("status") or {}
        try:
            expected, desired = self._expected(pdb, [p for _, p in pods])
        except SyncFailed as exc:
            status = {
                "disruptionsAllowed": 0,
                "currentHealthy": 0,
                "desiredHealthy": 0,
                "expectedPods": 0,
                "observedGeneration": generation,
                "conditions": self._condition(before, "False", "SyncFailed", str(exc), generation),
            }
            return self._write(key, pdb, status)
        disrupted = self._disrupted(before, {k[3]: p for k, p in pods})
        healthy = sum(
            1
            for _, p in pods
            if not p["metadata"].get("deletionTimestamp") and p["metadata"]["name"] not in disrupted and pod_ready(p)
        )
        allowed = healthy - desired
        if expected <= 0 or allowed <= 0:
            allowed = 0
        status: dict[str, Any] = {
            "disruptionsAllowed": allowed,
            "currentHealthy": healthy,
            "desiredHealthy": desired,
            "expectedPods": expected,
            "observedGeneration": generation,
        }
        if disrupted:
            status["disruptedPods"] = disrupted
        reason = ("True", "SufficientPods") if allowed > 0 else ("False", "InsufficientPods")
        status["conditions"] = self._condition(before, *reason, "", generation)
        return self._write(key, pdb, status)

    def _expected(self, pdb: dict, pods: list[dict]) -> tuple[int, int]:
        """(expectedPods, desiredHealthy): ``getExpectedPodCount``."""
        spec = pdb.get("spec") or {}
        if spec.get("maxUnavailable") is not None:
            expected = self._scale(pods)
            unavailable = scaled_value(spec["maxUnavailable"], expected, round_up=True, default=0)
            return expected, max(0, expected - unavailable)
        minimum = spec.get("minAvailable")
        if isinstance(minimum, int):
            return len(pods), minimum
        if isinstance(minimum, str):
            expected = self._scale(pods)
            return expected, scaled_value(minimum, expected, round_up=True, default=0)
        return 0, 0

    def _scale(self, pods: list[dict]) -> int:
        """The replicas the controllers of `pods` want, each controller once (a ReplicaSet's Deployment instead)."""
        scales: dict[str, int] = {}
        for pod in pods:
            ref = controller_of(pod)
            if ref is None:
                continue  # NOTE: as kube-controller-manager, unmanaged pods are ignored for percentages
            owner = self._owner(ref)
            if owner is None:
                raise SyncFailed(f'found no controllers for pod "{pod["metadata"]["name"]}"')
            above = controller_of(owner)
            if owner.get("kind") == "ReplicaSet" and above is not None and above.get("kind") == "Deployment":
                owner = self._owner(above) or owner
            replicas = (owner.get("spec") or {}).get("replicas")
            if owner.get("kind") not in ("Deployment", "ReplicaSet", "StatefulSet", "ReplicationController"):
                raise SyncFailed(f'found no controllers for pod "{pod["metadata"]["name"]}"')
            scales[owner["metadata"]["uid"]] = int(1 if replicas is None else replicas)
        return sum(scales.values())

    def _owner(self, ref: dict) -> dict | None:
        key = self.s.kube._uids.get(ref.get("uid") or "")
        return None if key is None else self.s.get(key)

    def _disrupted(self, before: dict, pods: dict[str, dict]) -> dict[str, str]:
        """Recent evictions still pending: the pod exists, is not being deleted, and the entry is not too old."""
        now, kept = self.s.now(), {}
        for name, stamp in (before.get("disruptedPods") or {}).items():
            pod, at = pods.get(name), parse_time(stamp)
            if pod is None or pod["metadata"].get("deletionTimestamp") or at is None or at + DELETION_TIMEOUT_S <= now:
                continue
            kept[name] = stamp
        return kept

    def _condition(self, before: dict, status: str, reason: str, message: str, generation: int) -> list[dict]:
        current = next((c for c in before.get("conditions") or [] if c.get("type") == "DisruptionAllowed"), None)
        since = current.get("lastTransitionTime") if current is not None and current.get("status") == status else None
        cond = {
            "type": "DisruptionAllowed",
            "status": status,
            "reason": reason,
            "message": message,
            "observedGeneration": generation,
            "lastTransitionTime": since or self.s.iso(),
        }
        return [c for c in before.get("conditions") or [] if c.get("type") != "DisruptionAllowed"] + [cond]

    def _write(self, key: Key, pdb: dict, status: dict) -> bool:
        if status == (pdb.get("status") or {}):
            return False
        new = copy.deepcopy(pdb)
        new["status"] = status
        return self.s.write_status(key, new)
