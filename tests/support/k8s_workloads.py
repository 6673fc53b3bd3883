"""The emulator's controllers (opt-in, ``KubernetesApiEmulator.enable_workloads()``): Deployments make Pods,
a scheduler binds Pods to Nodes by their resource requests, a kubelet marks bound Pods running.

What a cluster does between "a Deployment is written" and "its pods hold accelerators", close enough that
capacity bugs show up as they would on a cluster:

* Deployment controller: keeps ``spec.replicas`` pods per Deployment, owned by it (``ownerReferences``,
  so they go with it by garbage collection), made from ``spec.template`` with a ``pod-template-hash``
  label; scales down Pending pods first, then the newest; a changed template replaces the old pods
  (all at once: no ReplicaSets, no maxSurge/maxUnavailable pacing); writes ``status`` (replicas,
  updatedReplicas, readyReplicas, availableReplicas, observedGeneration).
* scheduler: Pending pods in creation order; a node fits when it is Ready and not cordoned, matches
  ``nodeSelector`` and required ``nodeAffinity`` (In, NotIn, Exists, DoesNotExist, Gt, Lt on labels),
  its NoSchedule/NoExecute taints are tolerated, and its free allocatable (allocatable minus the
  requests of the non-finished pods bound to it; limits stand in for missing requests, as the API
  server defaults extended resources) covers every request, ``pods`` included. Among fitting nodes
  the fullest (MostAllocated) wins. A pod that fits nowhere stays ``Pending`` with
  ``PodScheduled=False``, reason ``Unschedulable`` and kube-scheduler's "0/N nodes are available: ..."
  message; it is retried on every change of pods, nodes or Deployments, so it binds when capacity frees.
* kubelet: a bound pod becomes ``Running`` with ``Ready=True`` at once (no images, no probes).

``Workloads.hold()`` keeps new pods unbound (kube-scheduler lagging behind a burst of pods) until
``hold(False)``; ``unschedulable_pods`` names every pod ever left Pending, for "no pile-up" assertions.
"""

from __future__ import annotations

import copy
import hashlib
import json
import secrets
import string
from typing import TYPE_CHECKING, Any

from pdfleet_operator.api import parse_quantity

if TYPE_CHECKING:  # pragma: no cover
    from tests.support.k8s_emulator import KubernetesApiEmulator

POD_KEY = ("", "pods")
NODE_KEY = ("", "nodes")
DEPLOYMENT_KEY = ("apps", "deployments")
WATCHED = frozenset({POD_KEY, NODE_KEY, DEPLOYMENT_KEY})
FINISHED = frozenset({"Succeeded", "Failed"})
BLOCKING = frozenset({"NoSchedule", "NoExecute"})
MAX_PASSES = 50


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


def _ready(node: dict) -> bool:
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return True


def _tolerates(tolerations: list[dict], taint: dict) -> bool:
    for tol in tolerations:
        if tol.get("effect") and tol["effect"] != taint.get("effect"):
            continue
        op = tol.get("operator") or "Equal"
        if not tol.get("key") and op == "Exists":
            return True
        if tol.get("key") != taint.get("key"):
            continue
        if op == "Exists" or (tol.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


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
    required = (((pod_spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = required.get("nodeSelectorTerms") or []
    if not terms:
        return True
    return any(all(_expression_holds(e, labels) for e in term.get("matchExpressions") or []) for term in terms)


class Workloads:
    """The controllers of one emulator; `run()` brings pods and Deployments to a fixed point."""

    def __init__(self, emulator: KubernetesApiEmulator) -> None:
        self.kube = emulator
        self.bound = 0          # pods bound so far (for tests and benches)
        self.unschedulable = 0  # times a pod was marked Unschedulable
        self.unschedulable_pods: set[str] = set()  # `namespace/name` of every pod ever marked Unschedulable
        # False: the scheduler is held (pods stay unbound, as while kube-scheduler lags behind); `hold(False)` resumes.
        self.scheduling = True

    def hold(self, held: bool = True) -> None:
        """Hold the scheduler (pods are created but not bound) or resume it (and bind what fits now)."""
        self.scheduling = not held
        if not held:
            self.kube.run_workloads()

    # --- state access -------------------------------------------------------------------------
    def _objects(self, group_plural: tuple[str, str]) -> list[tuple[tuple[str, str, str, str], dict]]:
        return [(k, o) for k, o in sorted(self.kube._store.items()) if k[:2] == group_plural]

    def _write(self, key: tuple[str, str, str, str], new: dict) -> None:
        old = self.kube._store.get(key)
        if old is None or old == new:
            return
        self.kube._put(key, new, "MODIFIED", old)

    # --- the pass -------------------------------------------------------------------------------
    def run(self) -> bool:
        """One round of every controller; True when it changed something."""
        changed = self._deployments()
        changed = self._kubelet() or changed
        if self.scheduling:
            changed = self._schedule() or changed
        changed = self._deployment_status() or changed
        return changed

    # --- Deployment controller -------------------------------------------------------------------
    def _owned_pods(self, deploy: dict) -> list[tuple[tuple[str, str, str, str], dict]]:
        uid, ns = deploy["metadata"]["uid"], deploy["metadata"]["namespace"]
        return [(k, p) for k, p in self._objects(POD_KEY) if k[2] == ns
                and any(r.get("uid") == uid and r.get("controller") for r in p["metadata"].get("ownerReferences") or [])]

    def _deployments(self) -> bool:
        changed = False
        pods_res = self.kube.resource_for("", "v1", "pods")
        for key, deploy in self._objects(DEPLOYMENT_KEY):
            if deploy["metadata"].get("deletionTimestamp"):
                continue
            spec = deploy.get("spec") or {}
            template = spec.get("template") or {}
            want_hash = template_hash(template)
            want = int(spec.get("replicas", 1) if spec.get("replicas") is not None else 1)
            live = [(k, p) for k, p in self._owned_pods(deploy)
                    if (p.get("status") or {}).get("phase") not in FINISHED and not p["metadata"].get("deletionTimestamp")]
            outdated = [(k, p) for k, p in live if (p["metadata"].get("labels") or {}).get("pod-template-hash") != want_hash]
            current = [(k, p) for k, p in live if (k, p) not in outdated]
            for k, _ in outdated:
                if k in self.kube._store:
                    self.kube._delete_key(k, propagation="Background")
                    changed = True
            if len(current) > want:
                # Unbound pods go first, then the newest (as the ReplicaSet controller ranks them).
                ranked = sorted(current, key=lambda kp: (bool((kp[1].get("spec") or {}).get("nodeName")),
                                                         kp[1]["metadata"].get("creationTimestamp", ""), kp[0][3]))
                unbound = [kp for kp in ranked if not (kp[1].get("spec") or {}).get("nodeName")]
                bound = [kp for kp in ranked if (kp[1].get("spec") or {}).get("nodeName")]
                victims = (unbound + bound[::-1])[:len(current) - want]
                for k, _ in victims:
                    if k in self.kube._store:
                        self.kube._delete_key(k, propagation="Background")
                        changed = True
            for _ in range(want - len(current)):
                self.kube._create(pods_res, key[2], self._pod_for(deploy, template, want_hash))
                changed = True
        return changed

    @staticmethod
    def _pod_for(deploy: dict, template: dict, hash_: str) -> dict:
        meta = copy.deepcopy(template.get("metadata") or {})
        name = deploy["metadata"]["name"]
        suffix = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(5))
        meta["name"] = f"{name}-{hash_}-{suffix}"
        meta["namespace"] = deploy["metadata"]["namespace"]
        meta["labels"] = {**(meta.get("labels") or {}), "pod-template-hash": hash_}
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "Deployment", "name": name,
                                    "uid": deploy["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": copy.deepcopy(template.get("spec") or {})}

    def _deployment_status(self) -> bool:
        changed = False
        for key, deploy in self._objects(DEPLOYMENT_KEY):
            template = (deploy.get("spec") or {}).get("template") or {}
            want_hash = template_hash(template)
            live = [p for _, p in self._owned_pods(deploy) if (p.get("status") or {}).get("phase") not in FINISHED]
            updated = [p for p in live if (p["metadata"].get("labels") or {}).get("pod-template-hash") == want_hash]
            ready = [p for p in updated if any(c.get("type") == "Ready" and c.get("status") == "True"
                                               for c in (p.get("status") or {}).get("conditions") or [])]
            status = {**(deploy.get("status") or {}), "observedGeneration": deploy["metadata"].get("generation", 1),
                      "replicas": len(live), "updatedReplicas": len(updated), "readyReplicas": len(ready),
                      "availableReplicas": len(ready), "unavailableReplicas": max(0, len(live) - len(ready))}
            if status != (deploy.get("status") or {}):
                new = copy.deepcopy(deploy)
                new["status"] = status
                self._write(key, new)
                changed = True
        return changed

    # --- kubelet ---------------------------------------------------------------------------------------
    def _kubelet(self) -> bool:
        changed = False
        nodes = {k[3] for k, _ in self._objects(NODE_KEY)}
        for key, pod in self._objects(POD_KEY):
            node = (pod.get("spec") or {}).get("nodeName")
            st = pod.get("status") or {}
            if not node or node not in nodes or st.get("phase") not in (None, "Pending"):
                continue
            new = copy.deepcopy(pod)
            new["status"] = {**st, "phase": "Running", "hostIP": "10.0.0.1",
                             "conditions": [{"type": t, "status": "True"}
                                            for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]}
            self._write(key, new)
            changed = True
        return changed

    # --- scheduler ------------------------------------------------------------------------------------
    def free_by_node(self) -> dict[str, dict[str, float]]:
        """Allocatable minus the requests of the non-finished pods bound to each node (every node, even cordoned)."""
        free: dict[str, dict[str, float]] = {}
        for (_, _, _, name), node in self._objects(NODE_KEY):
            free[name] = {}
            for r, q in ((node.get("status") or {}).get("allocatable") or {}).items():
                try:
                    free[name][r] = parse_quantity(q)
                except ValueError:
                    continue
        for _, pod in self._objects(POD_KEY):
            node = (pod.get("spec") or {}).get("nodeName")
            if not node or node not in free or (pod.get("status") or {}).get("phase") in FINISHED:
                continue
            for r, v in requests_of(pod).items():
                free[node][r] = free[node].get(r, 0.0) - v
        return free

    def _schedule(self) -> bool:
        changed = False
        nodes = self._objects(NODE_KEY)
        free = self.free_by_node()
        pending = [(k, p) for k, p in self._objects(POD_KEY)
                   if not (p.get("spec") or {}).get("nodeName") and not p["metadata"].get("deletionTimestamp")
                   and (p.get("status") or {}).get("phase") not in FINISHED]
        pending.sort(key=lambda kp: (kp[1]["metadata"].get("creationTimestamp", ""), int(kp[1]["metadata"]["resourceVersion"])))
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
                if not _ready(node):
                    miss("node(s) were not Ready")
                    continue
                if (node.get("spec") or {}).get("unschedulable"):
                    miss("node(s) were unschedulable")
                    continue
                if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()) \
                        or not _affinity_matches(spec, labels):
                    miss("node(s) didn't match Pod's node affinity/selector")
                    continue
                untolerated = [t for t in (node.get("spec") or {}).get("taints") or []
                               if t.get("effect") in BLOCKING and not _tolerates(spec.get("tolerations") or [], t)]
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
                message = f"0/{len(nodes)} nodes are available: {reasons}." if nodes else "no nodes available to schedule pods"
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
            self._write(key, new)
            self.bound += 1
            changed = True
        return changed

    def _unschedulable(self, key: tuple[str, str, str, str], pod: dict, message: str) -> bool:
        status = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                                                      "reason": "Unschedulable", "message": message}]}
        if (pod.get("status") or {}) == status:
            return False
        new = copy.deepcopy(pod)
        new["status"] = status
        self._write(key, new)
        self.unschedulable += 1
        self.unschedulable_pods.add(f"{key[2]}/{key[3]}")
        return True
