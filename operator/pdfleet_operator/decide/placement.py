"""Placement: which AcceleratorClasses each role runs on and how many replicas on each (pure).

The reconcile path (handlers) and the simulator call `plan(...)`; the autoscaler reads `capacity()`.
Rules: a replica must fit (weights + KV for one full-length sequence); prefill is compute-bound
(ranked by TFLOP/s, or TFLOP/s per $ in the cost tier), decode and colocated are bandwidth-bound
(GB/s, or GB/s per $); only classes whose roofline estimate meets the SLO are used while any does;
the user's preference order breaks ties; never more than the free capacity, and every shortfall
says which class and how many units are missing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from pdfleet_operator.api import ROLES, AcceleratorClassSpec, InferenceDeploymentSpec, parse_duration
from pdfleet_operator.decide import perf
from pdfleet_operator.decide.inventory import Inventory

# Scores within 2% of each other are ties (then the user's order decides).
TIE_STEP = 1.02


@dataclass(frozen=True)
class PlannedPool:
    role: str
    accelerator_class: str
    replicas: int


@dataclass(frozen=True)
class Shortfall:
    """Capacity the plan wanted and could not get (-> ScalingLimited).

    `missing_units` counts units of the class's resource; with no usable class at all
    (`accelerator_class` None) it counts the replicas that could not be placed anywhere.
    """

    role: str
    accelerator_class: str | None
    missing_units: int
    reason: str  # machine-readable: InsufficientCapacity, FitsNowhere
    message: str = ""


@dataclass(frozen=True)
class Candidate:
    """A class a role may use, with why it ranks where it does."""

    name: str
    spec: AcceleratorClassSpec
    meets_slo: bool
    score: float  # higher is better in the role's tier
    preference: int  # position in the user's list


@dataclass(frozen=True)
class FleetPlan:
    pools: tuple[PlannedPool, ...]
    shortfalls: tuple[Shortfall, ...] = ()
    reasons: tuple[str, ...] = ()
    targets: Mapping[str, int] = field(default_factory=dict)  # replicas asked per role (after min/max)
    capacities: Mapping[str, int] = field(default_factory=dict)
    ranking: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # role -> (class, most replicas of the role placeable on it) in the order the plan fills them
    class_capacities: Mapping[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)

    def replicas(self, role: str) -> int:
        return sum(p.replicas for p in self.pools if p.role == role)

    def capacity(self, role: str) -> int:
        """Most replicas of `role` placeable (up to its maxReplicas), counting what the plan holds."""
        return self.capacities.get(role, 0)

    def class_capacity(self, role: str) -> tuple[tuple[str, int], ...]:
        """(AcceleratorClass, most replicas of `role` placeable on it, counting the plan's) in placement
        order: the classes a growing role lands on next (the autoscaler's token-rate sizing)."""
        return self.class_capacities.get(role, ())

    def pools_for(self, role: str) -> tuple[PlannedPool, ...]:
        return tuple(p for p in self.pools if p.role == role)

    def roles(self) -> tuple[str, ...]:
        return tuple(r for r in ROLES if r in self.targets)


def _bucket(x: float) -> float:
    if math.isinf(x):
        return math.inf
    return round(math.log(max(x, 1e-12)) / math.log(TIE_STEP))


def _speed(role: str, cls: AcceleratorClassSpec) -> float:
    if role == "prefill":
        return cls.peak_tflops * cls.count
    return cls.memory_bandwidth_gbps * cls.count


def _meets_slo(role: str, spec: InferenceDeploymentSpec, cls: AcceleratorClassSpec) -> tuple[bool, str]:
    ttft, itl = perf.ttft_seconds(spec, cls), perf.itl_seconds(spec, cls)
    if ttft is None or itl is None:
        return True, "SLO not checked (no model.architecture)"
    checks = []
    if role in ("prefill", "colocated"):
        checks.append(("TTFT", ttft, parse_duration(spec.slo.ttft)))
    if role in ("decode", "colocated"):
        checks.append(("ITL", itl, parse_duration(spec.slo.itl)))
    misses = [f"{what} ~{est * 1000:.0f}ms > {slo * 1000:.0f}ms" for what, est, slo in checks if est > slo]
    if misses:
        return False, "misses the SLO: " + ", ".join(misses)
    return True, "meets the SLO: " + ", ".join(f"{w} ~{e * 1000:.0f}ms" for w, e, _ in checks)


def rank(
    role: str, spec: InferenceDeploymentSpec, classes: Mapping[str, AcceleratorClassSpec], reasons: list[str]
) -> list[Candidate]:
    """The classes `role` may use, best first; appends why each was skipped or ranked to `reasons`."""
    role_spec = spec.roles()[role]
    found: list[Candidate] = []
    for idx, name in enumerate(role_spec.accelerator_classes):
        cls = classes.get(name)
        if cls is None:
            reasons.append(f"{role}: AcceleratorClass {name} does not exist")
            continue
        f = perf.fit(spec, cls)
        if not f.fits:
            reasons.append(f"{role}: {name} skipped: {f.message}")
            continue
        ok, why = _meets_slo(role, spec, cls)
        speed = _speed(role, cls)
        # Per $/h of one replica: speed and price both scale with the units a replica requests.
        replica_price = cls.cost_per_hour * cls.count
        score = speed if spec.tier == "latency" else (speed / replica_price if replica_price > 0 else math.inf)
        found.append(Candidate(name, cls, ok, score, idx))
        reasons.append(f"{role}: {name} {why}")
    eligible = [c for c in found if c.meets_slo]
    fallback = not eligible and bool(found)
    if fallback:
        # Running below the SLO beats not running: fall back to the fastest classes that fit.
        reasons.append(f"{role}: no class meets the SLO; using the fastest that fit")
        eligible = [Candidate(c.name, c.spec, False, _speed(role, c.spec), c.preference) for c in found]
    eligible.sort(key=lambda c: (-_bucket(c.score), c.preference))
    unit = "TFLOP/s" if role == "prefill" else "GB/s"
    how = (
        "fastest (SLO fallback)"
        if fallback
        else f"{spec.tier} tier, by {unit}" + (" per $/h" if spec.tier == "cost" else "")
    )
    if eligible:
        reasons.append(f"{role}: order {', '.join(c.name for c in eligible)} ({how})")
    return eligible


def plan(
    spec: InferenceDeploymentSpec,
    classes: Mapping[str, AcceleratorClassSpec],
    inventory: Inventory,
    desired: Mapping[str, int] | None = None,
) -> FleetPlan:
    """Pools per role sized to `desired` (each role's minReplicas when None), within free capacity.

    Every role first gets up to its minimum, then up to its target, so that one role's growth never
    starves another below its minimum on shared hardware.
    """
    roles = spec.roles()
    desired = dict(desired or {})
    unknown = sorted(set(desired) - set(roles))
    if unknown:
        raise ValueError(f"desired replicas for roles {unknown} that the spec does not have (roles: {sorted(roles)})")
    reasons: list[str] = []
    targets: dict[str, int] = {}
    for role, rs in roles.items():
        want = desired.get(role, rs.min_replicas)
        if want < 0:
            raise ValueError(f"desired replicas for {role} must be >= 0, got {want}")
        clamped = min(max(want, rs.min_replicas), rs.max_replicas)
        if clamped != want:
            reasons.append(
                f"{role}: {want} replicas asked, clamped to {clamped} (min {rs.min_replicas}, max {rs.max_replicas})"
            )
        targets[role] = clamped

    ranking = {role: rank(role, spec, classes, reasons) for role in roles}
    placed: dict[tuple[str, str], int] = {}
    inv = inventory
    minimums = {role: min(rs.min_replicas, targets[role]) for role, rs in roles.items()}
    for goal in (minimums, targets):
        for role in roles:
            need = goal[role] - sum(v for (r, _), v in placed.items() if r == role)
            for cand in ranking[role]:
                if need <= 0:
                    break
                inv, got = inv.take(cand.spec, need)
                if got:
                    placed[(role, cand.name)] = placed.get((role, cand.name), 0) + got
                    need -= got

    pools: list[PlannedPool] = []
    shortfalls: list[Shortfall] = []
    capacities: dict[str, int] = {}
    by_class: dict[str, tuple[tuple[str, int], ...]] = {}
    for role in (r for r in ROLES if r in roles):
        for cand in ranking[role]:
            n = placed.get((role, cand.name), 0)
            if n:
                pools.append(PlannedPool(role, cand.name, n))
        have = sum(p.replicas for p in pools if p.role == role)
        missing = targets[role] - have
        assert missing >= 0, f"placed {have} {role} replicas for a target of {targets[role]}"
        if missing and not ranking[role]:
            listed = ", ".join(roles[role].accelerator_classes)
            shortfalls.append(
                Shortfall(
                    role,
                    None,
                    missing,
                    "FitsNowhere",
                    f"{role}: no usable AcceleratorClass among {listed}; {missing} replicas unplaced",
                )
            )
        elif missing:
            first = ranking[role][0]
            units = missing * first.spec.count
            free = {c.name: inventory.free_units(c.spec) for c in ranking[role]}
            shortfalls.append(
                Shortfall(
                    role,
                    first.name,
                    units,
                    "InsufficientCapacity",
                    f"{role}: {have}/{targets[role]} replicas placed; missing {units} x {first.spec.resource_name} "
                    f"on {first.name} (free before planning: " + ", ".join(f"{k}={v}" for k, v in free.items()) + ")",
                )
            )
        # What the autoscaler may grow to: the plan's replicas plus what still fits after it.
        extra, spare = 0, inv
        cap = roles[role].max_replicas
        slots = []
        for cand in ranking[role]:
            got = 0
            if have + extra < cap:
                spare, got = spare.take(cand.spec, cap - have - extra)
                extra += got
            if placed.get((role, cand.name), 0) + got:
                slots.append((cand.name, placed.get((role, cand.name), 0) + got))
        capacities[role] = have + extra
        by_class[role] = tuple(slots)
        reasons.append(
            f"{role}: {have} of {targets[role]} replicas placed"
            + (
                ": " + ", ".join(f"{p.replicas} on {p.accelerator_class}" for p in pools if p.role == role)
                if have
                else ""
            )
        )
    return FleetPlan(
        tuple(pools),
        tuple(shortfalls),
        tuple(reasons) + inventory.notes,
        targets,
        capacities,
        {r: tuple(c.name for c in ranking[r]) for r in ranking},
        by_class,
    )


def surge_room(
    plan: FleetPlan,
    classes: Mapping[str, AcceleratorClassSpec],
    inventory: Inventory,
    held: Mapping[tuple[str, str], int] | None = None,
) -> frozenset[tuple[str, str]]:
    """The pools (role, class) that may roll with one surge replica: after every pool of `plan` has its
    replicas on `inventory`, one more replica of the pool still fits. `held`: replicas per pool that already
    hold their units outside `inventory` (a live pool's, when `inventory` is what is free now); they are not
    taken again.

    A pool with room replaces its pods one at a time without ever dropping below its size (maxSurge 1,
    maxUnavailable 0): an image change or a rollback keeps every replica serving. A pool without room takes
    one down first (maxSurge 0, maxUnavailable 1): a surge pod would sit Pending and the rollout would stall.
    Each spare replica's room is given to one pool only, in plan order.
    """
    inv = inventory
    for pool in plan.pools:
        grow = pool.replicas - (held or {}).get((pool.role, pool.accelerator_class), 0)
        if pool.accelerator_class in classes and grow > 0:
            inv, _ = inv.take(classes[pool.accelerator_class], grow)
    out = set()
    for pool in plan.pools:
        cls = classes.get(pool.accelerator_class)
        if cls is None or pool.replicas < 1:
            continue
        inv, placed = inv.take(cls, 1)
        if placed:
            out.add((pool.role, pool.accelerator_class))
    return frozenset(out)
