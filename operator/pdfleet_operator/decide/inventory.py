"""Free accelerator units per node, built from Node and Pod objects; placement reads it, handlers build it.

Pure: takes the JSON of Nodes and Pods (as the API server returns them) and answers "how many units
of resource R are free on which nodes that a class can use". A replica's `count` units must come from
one node (a pod cannot span nodes), so the inventory keeps nodes apart instead of summing them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pdfleet_operator.api import AcceleratorClassSpec, parse_quantity

# Taint effects that keep a pod off a node unless tolerated.
BLOCKING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})
# Pods in these phases hold no resources.
FINISHED_PHASES = frozenset({"Succeeded", "Failed"})
DEPLOYMENT_LABEL = "pdfleet.io/deployment"


@dataclass(frozen=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"


@dataclass(frozen=True)
class NodeInventory:
    """One schedulable node: its labels, taints and free units per resource name (whole units)."""

    name: str
    labels: Mapping[str, str]
    taints: tuple[Taint, ...]
    free: Mapping[str, int]

    def admits(self, cls: AcceleratorClassSpec) -> bool:
        """Whether a pod of this class may land here: selector matches and every blocking taint is tolerated."""
        if any(self.labels.get(k) != v for k, v in cls.node_selector.items()):
            return False
        return all(_tolerated(t, cls) for t in self.taints if t.effect in BLOCKING_EFFECTS)


@dataclass(frozen=True)
class Inventory:
    """Free capacity of the cluster as placement sees it. Immutable; `take` returns a new one."""

    nodes: tuple[NodeInventory, ...] = ()
    notes: tuple[str, ...] = field(default=(), compare=False)

    def nodes_for(self, cls: AcceleratorClassSpec) -> list[NodeInventory]:
        return [n for n in self.nodes if n.admits(cls)]

    def free_units(self, cls: AcceleratorClassSpec) -> int:
        """Units of the class's resource free on the nodes the class may use."""
        return sum(n.free.get(cls.resource_name, 0) for n in self.nodes_for(cls))

    def slots(self, cls: AcceleratorClassSpec) -> int:
        """Replicas of this class that fit on free capacity (each needs `count` units on one node)."""
        return sum(n.free.get(cls.resource_name, 0) // cls.count for n in self.nodes_for(cls))

    def take(self, cls: AcceleratorClassSpec, replicas: int) -> tuple[Inventory, int]:
        """Allocate up to `replicas` replicas of `cls`, fullest-fitting node first; returns (rest, placed).

        NOTE: best fit (the node with the least room that still fits) keeps big free blocks for
        classes that need several units per replica, as the scheduler's MostAllocated scoring does.
        """
        if replicas < 0:
            raise ValueError(f"cannot take {replicas} replicas of {cls.resource_name}")
        resource, count = cls.resource_name, cls.count
        free = {n.name: n.free.get(resource, 0) for n in self.nodes}
        placed = 0
        while placed < replicas:
            fitting = [n for n in self.nodes if n.admits(cls) and free[n.name] >= count]
            if not fitting:
                break
            best = min(fitting, key=lambda n: (free[n.name], n.name))
            room = free[best.name] // count
            step = min(room, replicas - placed)
            free[best.name] -= step * count
            placed += step
        nodes = tuple(
            n if free[n.name] == n.free.get(resource, 0)
            else NodeInventory(n.name, n.labels, n.taints, {**n.free, resource: free[n.name]})
            for n in self.nodes)
        return Inventory(nodes, self.notes), placed


def _tolerated(taint: Taint, cls: AcceleratorClassSpec) -> bool:
    for tol in cls.tolerations:
        if tol.effect is not None and tol.effect != taint.effect:
            continue
        if tol.key is None and tol.operator == "Exists":
            return True
        if tol.key != taint.key:
            continue
        if tol.operator == "Exists" or (tol.value or "") == taint.value:
            return True
    return False


def _units(resource: str, quantity: object) -> float:
    """A quantity in placement units: whole cores for cpu, plain counts for extended resources."""
    value = parse_quantity(quantity)  # type: ignore[arg-type]
    return value if resource == "cpu" else float(value)


def _node_ready(node: dict) -> bool:
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    # NOTE: a node without a Ready condition has not reported yet; kubelets always report one, but
    # hand-made test nodes often do not, so only an explicit False/Unknown excludes a node.
    return True


def pod_requests(pod: dict) -> dict[str, float]:
    """What a pod asks the scheduler for: the sum over containers, or the largest init container if bigger.

    Extended resources are often given only as limits; the API server then defaults requests to them.
    """
    spec = pod.get("spec") or {}

    def of(container: dict) -> dict[str, float]:
        res = container.get("resources") or {}
        merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        return {k: _units(k, v) for k, v in merged.items()}

    total: dict[str, float] = {}
    for c in spec.get("containers") or []:
        for k, v in of(c).items():
            total[k] = total.get(k, 0.0) + v
    for c in spec.get("initContainers") or []:
        for k, v in of(c).items():
            total[k] = max(total.get(k, 0.0), v)
    for k, v in ((spec.get("overhead") or {}).items()):
        total[k] = total.get(k, 0.0) + _units(k, v)
    return total


def taints_of(node: dict) -> tuple[Taint, ...]:
    return tuple(Taint(t.get("key", ""), t.get("value") or "", t.get("effect", "NoSchedule"))
                 for t in (node.get("spec") or {}).get("taints") or [])


def build(nodes: Iterable[dict], pods: Iterable[dict], *, exclude_deployment: tuple[str, str] | None = None) -> Inventory:
    """The free capacity: allocatable of Ready, schedulable nodes minus what bound, running pods request.

    `exclude_deployment=(namespace, name)` leaves out that InferenceDeployment's own pods, so that
    re-planning a deployment counts the units it already holds as available to it.
    """
    used: dict[str, dict[str, float]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        node_name = (pod.get("spec") or {}).get("nodeName")
        if not node_name or (pod.get("status") or {}).get("phase") in FINISHED_PHASES:
            continue
        if exclude_deployment is not None and (meta.get("namespace"), (meta.get("labels") or {}).get(DEPLOYMENT_LABEL)) \
                == exclude_deployment:
            continue
        acc = used.setdefault(node_name, {})
        for k, v in pod_requests(pod).items():
            acc[k] = acc.get(k, 0.0) + v

    out: list[NodeInventory] = []
    notes: list[str] = []
    for node in sorted(nodes, key=lambda n: n["metadata"]["name"]):
        name = node["metadata"]["name"]
        if (node.get("spec") or {}).get("unschedulable"):
            notes.append(f"node {name} is cordoned")
            continue
        if not _node_ready(node):
            notes.append(f"node {name} is not Ready")
            continue
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        free: dict[str, int] = {}
        for resource, quantity in allocatable.items():
            try:
                left = _units(resource, quantity) - used.get(name, {}).get(resource, 0.0)
            except ValueError:
                notes.append(f"node {name}: unreadable allocatable {resource}={quantity!r}")
                continue
            # NOTE: 1e-9 absorbs float error of milli-CPU sums before rounding down to whole units.
            free[resource] = max(0, math.floor(left + 1e-9))
        out.append(NodeInventory(name, dict((node.get("metadata") or {}).get("labels") or {}), taints_of(node), free))
    return Inventory(tuple(out), tuple(notes))
