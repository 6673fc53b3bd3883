"""The scheduler: binds Pending pods to Nodes by their requests, or leaves them ``Pending`` with
``PodScheduled=False``/``Unschedulable`` and kube-scheduler's "0/N nodes are available: ..." message.

Pending pods go in creation order; a node fits when it is Ready and not cordoned (unless the pod tolerates
``node.kubernetes.io/unschedulable``, as DaemonSet pods do), matches ``nodeSelector`` and required
``nodeAffinity`` (In, NotIn, Exists, DoesNotExist, Gt, Lt on labels), its NoSchedule/NoExecute taints are
tolerated, and its free allocatable (allocatable minus the requests of the non-finished pods bound to it,
terminating ones included; limits stand in for missing requests, as the API server defaults extended resources)
covers every request, ``pods`` included. Among fitting nodes the fullest (MostAllocated) wins. Pods are retried
on every change of pods, nodes or workloads, so a Pending pod binds when capacity frees.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from pdfleet_operator.api import parse_quantity
from tests.support.k8s.workloads.objects import FINISHED, NODE_KEY, POD_KEY, Key, Store, node_ready, requests_of

if TYPE_CHECKING:  # pragma: no cover
    from tests.support.k8s.workloads import Workloads

BLOCKING = frozenset({"NoSchedule", "NoExecute"})
UNSCHEDULABLE = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}


def matching_toleration(tolerations: list[dict], taint: dict) -> dict | None:
    """The first toleration that tolerates `taint` (``ToleratesTaint``), or None."""
    for tol in tolerations:
        if tol.get("effect") and tol["effect"] != taint.get("effect"):
            continue
        op = tol.get("operator") or "Equal"
        if not tol.get("key") and op == "Exists":
            return tol
        if tol.get("key") != taint.get("key"):
            continue
        if op == "Exists" or (tol.get("value") or "") == (taint.get("value") or ""):
            return tol
    return None


def tolerates(tolerations: list[dict], taint: dict) -> bool:
    return matching_toleration(tolerations, taint) is not None


# NOTE: the node-affinity and request arithmetic below mirror decide/inventory.py on purpose: this is the test
# cluster's scheduler, the oracle the operator's inventory is checked against, so it must not import it.
def _expression_holds(expr: dict, labels: dict[str, str]) -> bool:
    key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return key not in labels or labels[key] not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    if op in ("Gt", "Lt"):
        try:
            have, want = int(labels[key]), int(values[0])
        except (KeyError, IndexError, ValueError):
            return False
        return have > want if op == "Gt" else have < want
    return False


def _affinity_matches(pod_spec: dict, labels: dict[str, str]) -> bool:
    required = ((pod_spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms") or []
    if not terms:
        return True
    return any(all(_expression_holds(e, labels) for e in term.get("matchExpressions") or []) for term in terms)


class Scheduler:
    """kube-scheduler, for the emulator's pods."""

    def __init__(self, workloads: Workloads) -> None:
        self.wl = workloads
        self.s: Store = workloads.store

    def free_by_node(self) -> dict[str, dict[str, float]]:
        """Allocatable minus the requests of the non-finished pods bound to each node (every node, even cordoned)."""
        free: dict[str, dict[str, float]] = {}
        for (_, _, _, name), node in self.s.objects(NODE_KEY):
            free[name] = {}
            for r, q in ((node.get("status") or {}).get("allocatable") or {}).items():
                try:
                    free[name][r] = parse_quantity(q)
                except ValueError:
                    continue
        for _, pod in self.s.objects(POD_KEY):
            node = (pod.get("spec") or {}).get("nodeName")
            if not node or node not in free or (pod.get("status") or {}).get("phase") in FINISHED:
                continue
            for r, v in requests_of(pod).items():
                free[node][r] = free[node].get(r, 0.0) - v
        return free

    def run(self) -> bool:
        changed = False
        nodes = self.s.objects(NODE_KEY)
        free = self.free_by_node()
        pending = [
            (k, p)
            for k, p in self.s.objects(POD_KEY)
            if not (p.get("spec") or {}).get("nodeName")
            and not p["metadata"].get("deletionTimestamp")
            and (p.get("status") or {}).get("phase") not in FINISHED
        ]
        pending.sort(
            key=lambda kp: (kp[1]["metadata"].get("creationTimestamp", ""), int(kp[1]["metadata"]["resourceVersion"]))
        )
        for key, pod in pending:
            try:
                want = requests_of(pod)
            except ValueError as exc:
                changed = self._unschedulable(key, pod, f"invalid resource quantity: {exc}") or changed
                continue
            spec = pod.get("spec") or {}
            fits: list[str] = []
            why: dict[str, int] = {}

            def miss(reason: str) -> None:
                why[reason] = why.get(reason, 0) + 1

            for (_, _, _, name), node in nodes:
                labels = node["metadata"].get("labels") or {}
                if not node_ready(node) == "True":
                    miss("node(s) were not Ready")
                    continue
                if (node.get("spec") or {}).get("unschedulable") and not tolerates(
                    spec.get("tolerations") or [], UNSCHEDULABLE
                ):
                    miss("node(s) were unschedulable")
                    continue
                if any(
                    labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()
                ) or not _affinity_matches(spec, labels):
                    miss("node(s) didn't match Pod's node affinity/selector")
                    continue
                untolerated = [
                    t
                    for t in (node.get("spec") or {}).get("taints") or []
                    if t.get("effect") in BLOCKING and not tolerates(spec.get("tolerations") or [], t)
                ]
                if untolerated:
                    t = untolerated[0]
                    miss(f"node(s) had untolerated taint {{{t.get('key')}: {t.get('value') or ''}}}")
                    continue
                short = [r for r, v in sorted(want.items()) if v > 0 and free[name].get(r, 0.0) + 1e-9 < v]
                if short:
                    for r in short:
                        miss(f"Insufficient {r}")
                    continue
                fits.append(name)
            if not fits:
                reasons = ", ".join(f"{n} {r}" for r, n in sorted(why.items()))
                message = (
                    f"0/{len(nodes)} nodes are available: {reasons}."
                    if nodes
                    else "no nodes available to schedule pods"
                )
                changed = self._unschedulable(key, pod, message) or changed
                continue
            extended = [r for r in want if r not in ("cpu", "memory", "pods", "ephemeral-storage")]
            # MostAllocated: the node left with the least of the pod's scarce resource (then by name).
            best = min(fits, key=lambda n: (tuple(free[n].get(r, 0.0) - want[r] for r in sorted(extended)), n))
            for r, v in want.items():
                free[best][r] = free[best].get(r, 0.0) - v
            new = copy.deepcopy(pod)
            new["spec"]["nodeName"] = best
            new["status"] = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]}
            self.s.write_status(key, new)
            self.wl.bound += 1
            changed = True
        return changed

    def _unschedulable(self, key: Key, pod: dict, message: str) -> bool:
        status = {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}],
        }
        if (pod.get("status") or {}) == status:
            return False
        new = copy.deepcopy(pod)
        new["status"] = status
        self.s.write_status(key, new)
        self.wl.unschedulable += 1
        self.wl.unschedulable_pods.add(f"{key[2]}/{key[3]}")
        return True
