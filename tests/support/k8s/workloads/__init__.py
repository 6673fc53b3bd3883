"""The emulator's controllers (opt-in, ``KubernetesApiEmulator.enable_workloads()``): what a cluster does between
"a Deployment is written" and "its pods serve", close enough that capacity and availability bugs show up as
they would on a cluster.

* Deployment controller (:mod:`.deployments`, arithmetic in :mod:`.rollout`): ReplicaSets per pod template,
  RollingUpdate paced by maxSurge/maxUnavailable (int or %, surge rounded up, unavailable down) as pods become
  available, Recreate, proportional scaling mid-rollout, revisions, status and the Available/Progressing
  conditions with the progress deadline; a rollout whose surge pod cannot be scheduled stays stuck as on a
  cluster.
* ReplicaSet controller (:mod:`.replicasets`): pods per ReplicaSet, surplus removed in Kubernetes' order.
* scheduler (:mod:`.scheduler`): binds by requests, selectors, affinity, taints; Unschedulable otherwise.
* kubelet (:mod:`.kubelet`): bound pods run and turn Ready at once, unless held (:meth:`Workloads.hold_ready`)
  or failing (:meth:`Workloads.fail_ready`); graceful terminations end after their grace period.
* node lifecycle (:mod:`.nodes`): cordon and NotReady/Unknown taints, pods marked not ready, NoExecute evictions
  after ``tolerationSeconds``; pod GC (:mod:`.podgc`) removes pods of deleted nodes.
* disruption controller (:mod:`.disruption`): PodDisruptionBudget status, which the Eviction subresource
  enforces.

Time: everything due later (tolerationSeconds, grace periods, held readiness with seconds, minReadySeconds,
progress deadlines, PDB bookkeeping) is due on the emulator's clock (``emulator.clock``); a timer on the
emulator's loop runs the controllers when the next thing falls due, and ``emulator.advance(seconds)`` moves
the clock and runs them at once, so tests never wait for real time.

Switches: ``graceful_termination`` (off by default: deleted pods go at once, as the emulator always did; on:
a pod of a node gets ``deletionTimestamp`` and stays, not ready but holding its node's resources, for its
grace period), ``hold()`` (the scheduler lags: pods stay unbound), ``hold_ready``/``fail_ready``/``release``.
Counters for assertions: ``bound``, ``unschedulable``, ``unschedulable_pods`` (every pod ever left Pending),
``taint_evictions`` (pods the node lifecycle controller evicted).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tests.support.k8s.selectors import parse_label_selector
from tests.support.k8s.workloads.deployments import DeploymentController
from tests.support.k8s.workloads.disruption import DisruptionController
from tests.support.k8s.workloads.kubelet import Kubelet
from tests.support.k8s.workloads.nodes import NodeLifecycle
from tests.support.k8s.workloads.objects import (
    DEPLOYMENT_KEY,
    FINISHED,
    HASH_LABEL,
    NODE_KEY,
    POD_KEY,
    WATCHED,
    Key,
    Store,
    requests_of,
    template_hash,
    with_condition,
)
from tests.support.k8s.workloads.podgc import PodGC
from tests.support.k8s.workloads.replicasets import ReplicaSetController
from tests.support.k8s.workloads.scheduler import Scheduler

if TYPE_CHECKING:  # pragma: no cover
    from tests.support.k8s.emulator import KubernetesApiEmulator

__all__ = [
    "Workloads",
    "ReadinessRule",
    "MAX_PASSES",
    "WATCHED",
    "FINISHED",
    "POD_KEY",
    "NODE_KEY",
    "DEPLOYMENT_KEY",
    "requests_of",
    "template_hash",
]

MAX_PASSES = 200  # a pass moves every rollout one step; a burst of changes converges long before this
PodPredicate = Callable[[dict], bool]


@dataclass(eq=False)
class ReadinessRule:
    """A test's say over readiness: `hold` keeps matching pods that are not Ready yet from becoming Ready (for
    `seconds` after they started, or until released); `fail` makes matching pods not Ready (a failing probe)."""

    workloads: Workloads
    predicate: PodPredicate
    mode: str  # "hold" or "fail"
    seconds: float | None = None

    def release(self) -> None:
        """Drop this rule (call on the emulator's loop: ``kube.call(rule.release)``)."""
        self.workloads.release(self)


class Workloads:
    """The controllers of one emulator; `run()` is one pass of all of them."""

    def __init__(self, emulator: KubernetesApiEmulator, *, graceful_termination: bool = False) -> None:
        self.kube = emulator
        self.store = Store(emulator)
        self.bound = 0  # pods bound so far (for tests and benches)
        self.unschedulable = 0  # times a pod was marked Unschedulable
        self.unschedulable_pods: set[str] = set()  # `namespace/name` of every pod ever marked Unschedulable
        self.taint_evictions: list[str] = []  # `namespace/name` of every pod a NoExecute taint evicted
        # False: the scheduler is held (pods stay unbound, as while kube-scheduler lags behind); `hold(False)` resumes.
        self.scheduling = True
        # Deleted pods of a node stay (deletionTimestamp, not ready, holding resources) for their grace period.
        self.graceful_termination = graceful_termination
        self.rules: list[ReadinessRule] = []
        self.nodes = NodeLifecycle(self)
        self.podgc = PodGC(self)
        self.deployments = DeploymentController(self.store)
        self.replicasets = ReplicaSetController(self.store)
        self.scheduler = Scheduler(self)
        self.kubelet = Kubelet(self)
        self.disruption = DisruptionController(self.store)

    def watches(self, key: Key) -> bool:
        """Whether a change of this object calls for another pass of the controllers."""
        return key[:2] in WATCHED

    # --- what tests switch --------------------------------------------------------------------------
    def hold(self, held: bool = True) -> None:
        """Hold the scheduler (pods are created but not bound) or resume it (and bind what fits now)."""
        self.scheduling = not held
        if not held:
            self.kube.run_workloads()

    def hold_ready(self, predicate: PodPredicate | None = None, *, seconds: float | None = None) -> ReadinessRule:
        """Pods matching `predicate` (all: None) that are not Ready do not become Ready: for `seconds` after they
        started (on the emulator's clock), or until the rule is released. Pods already Ready stay Ready."""
        return self._rule(predicate, "hold", seconds)

    def fail_ready(self, predicate: PodPredicate | None = None) -> ReadinessRule:
        """Pods matching `predicate` (all: None) are not Ready, Ready ones included, until the rule is released."""
        return self._rule(predicate, "fail", None)

    def release(self, rule: ReadinessRule | None = None) -> None:
        """Drop one readiness rule, or every one (None); pods then become Ready as the kubelet sees fit."""
        self.rules = [] if rule is None else [r for r in self.rules if r is not rule]
        self.kube.run_workloads()

    def set_graceful_termination(self, on: bool = True) -> None:
        self.graceful_termination = on

    def _rule(self, predicate: PodPredicate | None, mode: str, seconds: float | None) -> ReadinessRule:
        if predicate is not None and not callable(predicate):
            raise TypeError(f"a readiness predicate must be callable on a pod dict, not {predicate!r}")
        if seconds is not None and seconds < 0:
            raise ValueError(f"seconds must be >= 0, not {seconds}")
        rule = ReadinessRule(self, predicate or (lambda _pod: True), mode, seconds)
        self.rules.append(rule)
        self.kube.run_workloads()
        return rule

    # --- predicates for the rules ----------------------------------------------------------------------
    @staticmethod
    def selecting(label_selector: str, namespace: str | None = None) -> PodPredicate:
        """Pods matching a label selector (``app=x,tier in (a,b)``), in one namespace or any."""
        matches = parse_label_selector(label_selector)
        return lambda pod: (
            (namespace is None or pod["metadata"].get("namespace") == namespace)
            and matches(pod["metadata"].get("labels") or {})
        )

    def updated_pods_of(self, deployment: str, namespace: str = "default") -> PodPredicate:
        """Pods of the Deployment's current template (its new ReplicaSet's), whatever the template is when asked."""

        def predicate(pod: dict) -> bool:
            d = self.store.get(DEPLOYMENT_KEY + (namespace, deployment))
            if d is None or pod["metadata"].get("namespace") != namespace:
                return False
            want = template_hash((d.get("spec") or {}).get("template") or {})
            return (pod["metadata"].get("labels") or {}).get(HASH_LABEL) == want

        return predicate

    # --- what the controllers ask ------------------------------------------------------------------------
    def ready(self, pod: dict, started: float, now: float) -> bool:
        """Whether the kubelet reports this running pod Ready."""
        if any(r.mode == "fail" and r.predicate(pod) for r in self.rules):
            return False
        current = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in (pod.get("status") or {}).get("conditions") or []
        )
        if current:
            return True
        return not any(
            r.mode == "hold" and r.predicate(pod) and (r.seconds is None or now < started + r.seconds)
            for r in self.rules
        )

    def readiness_due(self, pod: dict, started: float | None) -> list[float]:
        """When holds with seconds on this not-ready pod run out."""
        if started is None:
            return []
        return [
            started + r.seconds for r in self.rules if r.mode == "hold" and r.seconds is not None and r.predicate(pod)
        ]

    def mark_disruption(self, key: Key, pod: dict, reason: str, message: str) -> None:
        """The ``DisruptionTarget`` condition a pod gets before a controller or the Eviction API deletes it."""
        current = self.store.get(key)
        if current is None:
            return
        new = copy.deepcopy(current)
        status = new.setdefault("status", {})
        status["conditions"] = with_condition(
            status.get("conditions") or [],
            {"type": "DisruptionTarget", "status": "True", "reason": reason, "message": message},
            self.store.iso(),
        )
        self.store.write_status(key, new)

    def free_by_node(self) -> dict[str, dict[str, float]]:
        """Allocatable minus the requests of the non-finished pods bound to each node (every node, even cordoned)."""
        return self.scheduler.free_by_node()

    # --- the pass ----------------------------------------------------------------------------------------
    def run(self) -> bool:
        """One round of every controller; True when it changed something."""
        changed = self.nodes.run()
        changed = self.podgc.run() or changed
        changed = self.deployments.run() or changed
        changed = self.replicasets.run() or changed
        if self.scheduling:
            changed = self.scheduler.run() or changed
        changed = self.kubelet.run() or changed
        changed = self.replicasets.statuses() or changed
        changed = self.disruption.run() or changed
        return changed

    def next_due(self) -> float | None:
        """The emulator time at which a controller has something to do next, if any."""
        due = [
            d
            for d in (
                self.nodes.next_due(),
                self.podgc.next_due(),
                self.deployments.next_due(),
                self.replicasets.next_due(),
                self.kubelet.next_due(),
                self.disruption.next_due(),
            )
            if d is not None and d > self.store.now()
        ]
        return min(due) if due else None
