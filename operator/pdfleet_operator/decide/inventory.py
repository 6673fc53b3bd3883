"""Free accelerator units per node, built from Node and Pod objects; placement reads it, handlers build it.

Pure: takes the JSON of Nodes and Pods (as the API server returns them) and answers "how many units
of resource R are free on which nodes that a class can use". A replica's `count` units must come from
one node (a pod cannot span nodes), so the inventory keeps nodes apart instead of summing them.

Free means free for a new plan: allocatable minus what bound pods request, minus what pods that are
not bound yet will take as soon as the scheduler gets to them (Pending pods, and replicas another
InferenceDeployment's plan holds whose pods do not exist yet: `Reservation`). Those claims are placed
the way the scheduler would (selector, required node affinity, taints, every requested resource, the
fullest fitting node first); a claim that fits nowhere holds nothing now and is noted. Without them
two plans made before either's pods bind would both count the same free GPUs.
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
ROLE_LABEL = "pdfleet.io/role"
ACCELERATOR_LABEL = "pdfleet.io/accelerator"
# Resources every node has plenty of names for: left out of the notes on what claims hold.
COMMON_RESOURCES = frozenset({"cpu", "memory", "pods", "ephemeral-storage"})


@dataclass(frozen=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"


@dataclass(frozen=True)
class Tolerance:
    """One toleration, from a class (`api.Toleration`) or a pod's spec."""

    key: str | None = None
    operator: str = "Equal"
    value: str | None = None
    effect: str | None = None


@dataclass(frozen=True)
class Reservation:
    """Replicas an InferenceDeployment's last plan holds on a class (the operator's own memory of its plans)."""

    namespace: str
    deployment: str
    role: str
    accelerator_class: str
    cls: AcceleratorClassSpec
    replicas: int


@dataclass(frozen=True)
class Claim:
    """Resources that a pod not bound yet takes as soon as the scheduler binds it."""

    what: (
        str  # for the notes: "pod ns/name (Pending)" or "3 planned replicas on l40s-48gb of 2 other deployments (...)"
    )
    requests: Mapping[str, float]
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Tolerance, ...] = ()
    # Required node affinity: any term matches when all its (key, operator, values) expressions hold.
    affinity: tuple[tuple[tuple[str, str, tuple[str, ...]], ...], ...] = ()
    replicas: int = 1


@dataclass(frozen=True)
class NodeInventory:
    """One schedulable node: its labels, taints and free units per resource name (whole units)."""

    name: str
    labels: Mapping[str, str]
    taints: tuple[Taint, ...]
    free: Mapping[str, int]

    def admits(self, cls: AcceleratorClassSpec) -> bool:
        """Whether a pod of this class may land here: selector matches and every blocking taint is tolerated."""
        return self.admits_pod(cls.node_selector, _class_tolerances(cls))

    def admits_pod(
        self,
        node_selector: Mapping[str, str],
        tolerations: tuple[Tolerance, ...],
        affinity: tuple[tuple[tuple[str, str, tuple[str, ...]], ...], ...] = (),
    ) -> bool:
        if any(self.labels.get(k) != v for k, v in node_selector.items()):
            return False
        if affinity and not any(all(_expression_holds(e, self.labels) for e in term) for term in affinity):
            return False
        return all(_tolerated(t, tolerations) for t in self.taints if t.effect in BLOCKING_EFFECTS)


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
            n
            if free[n.name] == n.free.get(resource, 0)
            else NodeInventory(n.name, n.labels, n.taints, {**n.free, resource: free[n.name]})
            for n in self.nodes
        )
        return Inventory(nodes, self.notes), placed


def _class_tolerances(cls: AcceleratorClassSpec) -> tuple[Tolerance, ...]:
    return tuple(Tolerance(t.key, t.operator, t.value, t.effect) for t in cls.tolerations)


def _tolerated(taint: Taint, tolerations: tuple[Tolerance, ...]) -> bool:
    for tol in tolerations:
        if tol.effect and tol.effect != taint.effect:
            continue
        if not tol.key and tol.operator == "Exists":
            return True
        if tol.key != taint.key:
            continue
        if tol.operator == "Exists" or (tol.value or "") == taint.value:
            return True
    return False


def _expression_holds(expr: tuple[str, str, tuple[str, ...]], labels: Mapping[str, str]) -> bool:
    key, op, values = expr
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
    return False  # NOTE: an operator the scheduler would refuse: the claim is taken to fit nowhere


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
    for k, v in (spec.get("overhead") or {}).items():
        total[k] = total.get(k, 0.0) + _units(k, v)
    return total


def taints_of(node: dict) -> tuple[Taint, ...]:
    return tuple(
        Taint(t.get("key", ""), t.get("value") or "", t.get("effect", "NoSchedule"))
        for t in (node.get("spec") or {}).get("taints") or []
    )


# Pods not bound to a node yet are indexed under this key (what they will take is not free).
UNBOUND = ""
POOL_LABELS = (DEPLOYMENT_LABEL, ROLE_LABEL, ACCELERATOR_LABEL)


def pod_view(pod: Mapping) -> dict | None:
    """What the inventory reads of a pod (the operator keeps only this in memory); None for finished pods."""
    spec = pod.get("spec") or {}
    node_name = spec.get("nodeName")
    if (pod.get("status") or {}).get("phase") in FINISHED_PHASES:
        return None
    meta = pod.get("metadata") or {}
    view: dict = {
        "metadata": {
            "namespace": meta.get("namespace"),
            "name": meta.get("name"),
            "labels": {k: v for k, v in (meta.get("labels") or {}).items() if k in POOL_LABELS},
        },
        "spec": {
            "nodeName": node_name,
            "containers": [{"resources": c.get("resources") or {}} for c in spec.get("containers") or []],
            "initContainers": [{"resources": c.get("resources") or {}} for c in spec.get("initContainers") or []],
            **({"overhead": spec["overhead"]} if spec.get("overhead") else {}),
        },
    }
    if not node_name:  # where the scheduler may bind it, and in which order
        view["metadata"].update({k: meta[k] for k in ("creationTimestamp", "deletionTimestamp") if meta.get(k)})
        view["spec"].update({k: spec[k] for k in ("nodeSelector", "tolerations") if spec.get(k)})
        required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        )
        if required:
            view["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}
    return view


def pod_claim(pod: dict) -> Claim:
    """What a pod that is not bound yet will take, and where it may land."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    tolerations = tuple(
        Tolerance(t.get("key") or None, t.get("operator") or "Equal", t.get("value"), t.get("effect") or None)
        for t in spec.get("tolerations") or []
    )
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    affinity = tuple(
        tuple(
            (str(e.get("key")), str(e.get("operator")), tuple(str(v) for v in e.get("values") or []))
            for e in term.get("matchExpressions") or []
        )
        for term in required.get("nodeSelectorTerms") or []
    )
    return Claim(
        f"pod {meta.get('namespace')}/{meta.get('name')} (Pending)",
        pod_requests(pod),
        dict(spec.get("nodeSelector") or {}),
        tolerations,
        affinity,
    )


def _pool_of(pod: dict) -> tuple[str | None, str | None, str | None, str | None]:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    return meta.get("namespace"), labels.get(DEPLOYMENT_LABEL), labels.get(ROLE_LABEL), labels.get(ACCELERATOR_LABEL)


def claims(
    pods: Iterable[dict], reserved: Iterable[Reservation] = (), *, exclude_deployment: tuple[str, str] | None = None
) -> list[Claim]:
    """Claims on capacity not bound yet: every Pending pod, oldest first, then the replicas of `reserved` plans
    whose pods do not exist yet (a plan's replicas minus its pool's pods, bound or not); never the excluded
    deployment's."""
    pods = [p for p in pods if (p.get("status") or {}).get("phase") not in FINISHED_PHASES]
    out: list[Claim] = []
    existing: dict[tuple, int] = {}
    unbound = []
    for pod in pods:
        ns, dep, role, acc = _pool_of(pod)
        if not (pod.get("metadata") or {}).get("deletionTimestamp"):  # (a terminating pod's replacement is due)
            existing[(ns, dep, role, acc)] = existing.get((ns, dep, role, acc), 0) + 1
        if exclude_deployment is not None and (ns, dep) == exclude_deployment:
            continue
        if not (pod.get("spec") or {}).get("nodeName") and not (pod.get("metadata") or {}).get("deletionTimestamp"):
            unbound.append(pod)
    unbound.sort(
        key=lambda p: (
            str((p.get("metadata") or {}).get("creationTimestamp") or ""),
            str((p.get("metadata") or {}).get("name") or ""),
        )
    )
    out += [pod_claim(p) for p in unbound]
    # The unborn replicas of one class are one claim, however many plans hold them (they are alike).
    by_class: dict[str, tuple[AcceleratorClassSpec, list[tuple[str, int]]]] = {}
    for r in reserved:
        if exclude_deployment is not None and (r.namespace, r.deployment) == exclude_deployment:
            continue
        unborn = r.replicas - existing.get((r.namespace, r.deployment, r.role, r.accelerator_class), 0)
        if unborn > 0:
            by_class.setdefault(r.accelerator_class, (r.cls, []))[1].append(
                (f"{r.namespace}/{r.deployment} {unborn} {r.role}", unborn)
            )
    for name, (cls, holders) in by_class.items():
        total = sum(n for _, n in holders)
        shown = "; ".join(h for h, _ in holders[:3]) + (f"; {len(holders) - 3} more" if len(holders) > 3 else "")
        out.append(
            Claim(
                f"{total} planned replicas on {name} of {len(holders)} other deployment"
                f"{'s' if len(holders) > 1 else ''} ({shown})",
                {cls.resource_name: float(cls.count)},
                dict(cls.node_selector),
                _class_tolerances(cls),
                replicas=total,
            )
        )
    return out


def build(
    nodes: Iterable[dict],
    pods: Iterable[dict],
    *,
    exclude_deployment: tuple[str, str] | None = None,
    reserved: Iterable[Reservation] = (),
) -> Inventory:
    """The free capacity: allocatable of Ready, schedulable nodes minus what bound pods request, minus the
    claims of pods not bound yet (Pending pods, `reserved` replicas whose pods do not exist yet).

    `exclude_deployment=(namespace, name)` leaves out that InferenceDeployment's own reservation and gives it back
    the units its bound pods hold, so that re-planning a deployment counts what it already holds as available to
    it. NOTE: those units are given back after the other claims are placed: a claim waiting for capacity (another
    deployment's Pending pod or unborn replicas) cannot bind where this deployment's pods run, so it never takes
    them from it (else a deployment that serves would yield its units, in its own plan, to one that waits).
    """
    pods = list(pods)
    used: dict[str, dict[str, float]] = {}
    own: dict[str, dict[str, float]] = {}  # the excluded deployment's bound pods: node -> requests
    for pod in pods:
        meta = pod.get("metadata") or {}
        node_name = (pod.get("spec") or {}).get("nodeName")
        if not node_name or (pod.get("status") or {}).get("phase") in FINISHED_PHASES:
            continue
        mine = (
            exclude_deployment is not None
            and (meta.get("namespace"), (meta.get("labels") or {}).get(DEPLOYMENT_LABEL)) == exclude_deployment
        )
        for target in (used, own) if mine else (used,):
            acc = target.setdefault(node_name, {})
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
    nodes_out, held = _place_claims(out, claims(pods, reserved, exclude_deployment=exclude_deployment))
    if own:
        nodes_out = [
            n
            if n.name not in own
            else NodeInventory(
                n.name,
                n.labels,
                n.taints,
                {r: q + max(0, math.floor(own[n.name].get(r, 0.0) + 1e-9)) for r, q in n.free.items()},
            )
            for n in nodes_out
        ]
    return Inventory(tuple(nodes_out), tuple(notes) + held)


def _place_claims(nodes: list[NodeInventory], pending: list[Claim]) -> tuple[list[NodeInventory], tuple[str, ...]]:
    """Take each claim from the node the scheduler would bind it to (every request fits, fullest node first).

    NOTE: claims alike (same requests and constraints: the replicas of one class, however many plans hold
    them) are placed together, as many per node as fit at once, so a fleet of hundreds of plans costs
    a pass per node and kind of claim, not per replica.
    """
    if not pending:
        return nodes, ()
    free: dict[str, dict[str, float]] = {n.name: {k: float(v) for k, v in n.free.items()} for n in nodes}
    groups: dict[tuple, list[Claim]] = {}
    for claim in pending:
        sig = (
            tuple(sorted(claim.requests.items())),
            tuple(sorted(claim.node_selector.items())),
            claim.tolerations,
            claim.affinity,
        )
        groups.setdefault(sig, []).append(claim)
    held: dict[str, float] = {}
    holders: list[str] = []
    nowhere: list[str] = []
    for alike in groups.values():
        first = alike[0]
        requests = {k: v for k, v in first.requests.items() if v > 0}
        scarce = sorted(k for k in requests if k not in COMMON_RESOURCES) or sorted(requests)
        admitting = [n for n in nodes if n.admits_pod(first.node_selector, first.tolerations, first.affinity)]
        want = sum(c.replicas for c in alike)

        def room(n: NodeInventory) -> int:
            if not requests:
                return want
            return min(math.floor(free[n.name].get(k, 0.0) / v + 1e-9) for k, v in requests.items())

        # Fullest fitting node first, as many as fit there; a node filled so is full for this kind, so one
        # pass over the nodes in that order places the group.
        placed = 0
        for best in sorted(
            (n for n in admitting if room(n) > 0),
            key=lambda n: (tuple(free[n.name].get(k, 0.0) for k in scarce), n.name),
        ):
            if placed >= want:
                break
            step = min(room(best), want - placed)
            for k, v in requests.items():
                if k in free[best.name]:
                    free[best.name][k] -= v * step
            placed += step
        # The claims of the group in their order: the first ones got the units.
        left = placed
        for claim in alike:
            got = min(claim.replicas, left)
            left -= got
            if got and any(k not in COMMON_RESOURCES for k in requests):
                for k, v in requests.items():
                    if k not in COMMON_RESOURCES:
                        held[k] = held.get(k, 0.0) + v * got
                holders.append(claim.what)
            if got < claim.replicas and any(k not in COMMON_RESOURCES for k in requests):
                nowhere.append(
                    claim.what if claim.replicas == 1 else f"{claim.what} ({claim.replicas - got} fit nowhere now)"
                )
    out = []
    for n in nodes:
        left = {k: max(0, math.floor(v + 1e-9)) for k, v in free[n.name].items()}
        out.append(n if left == dict(n.free) else NodeInventory(n.name, n.labels, n.taints, left))
    notes: list[str] = []
    if held:
        notes.append(
            "held by pods not bound yet: "
            + ", ".join(f"{v:g} x {k}" for k, v in sorted(held.items()))
            + " ("
            + "; ".join(holders[:5])
            + (f"; {len(holders) - 5} more" if len(holders) > 5 else "")
            + ")"
        )
    if nowhere:
        notes.append(
            "waiting for capacity that is not free now: "
            + "; ".join(nowhere[:5])
            + (f"; {len(nowhere) - 5} more" if len(nowhere) > 5 else "")
        )
    return out, tuple(notes)
