"""Make-before-break: from the pools that serve now and the pools placement would plan from scratch, the pools to
run next (pure); the reconcile chain (`decide.reconcile`) calls `step` once per reconcile.

Placement answers "where would this deployment's replicas go on an empty slate" (`ideal`). What runs is
never an empty slate: pools serve traffic, nodes get cordoned, go NotReady or lose a label, classes are
edited or deleted. `step` walks from what runs towards the ideal without ever taking serving capacity away:

1. **grow**: each class the ideal wants more of gets new replicas, as many as capacity free *now* allows
   (the units this deployment's own pods hold are not free). Replicas on a cordoned or NotReady node
   (`LivePool.displaced`) count as missing: their replacement is created while they still run.
2. **retain**: a pool the ideal no longer wants (an inventory change, a better class, a deleted class) keeps
   its replicas. Replicas that do not serve (Pending, starting) go at once; serving ones go only as the
   role's ready replicas exceed its target, i.e. once their replacements serve. The autoscaler or the spec
   lowering the target is the only thing that removes serving replicas without a replacement.
3. **move one at a time** where the only capacity for the replacement is what the old pool holds: with
   every replica of the role ready and the role above its minimum, one old replica is released and its
   replacement is asked for in the same step, so that it waits (Pending) for exactly those units and no other
   deployment's plan takes them; the next move waits until that one is ready.

NOTE: a Deployment's ReplicaSet chooses which pods a scale-down removes (not ready first, then the newest),
so a displaced replica cannot be singled out: its pool keeps one replica more than the ideal for every
displaced pod until the pod goes (a drain evicts it, a NotReady node's pods are evicted after their
tolerationSeconds) or its node recovers. A cordon is read as the first half of a drain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdfleet_operator.api import AcceleratorClassSpec
from pdfleet_operator.decide.inventory import Inventory

Pool = tuple[str, str]  # (role, AcceleratorClass)

# Why a pool is not where the ideal plan would put it (the PlacementDrift condition's reasons).
NODE_CORDONED = "NodeCordoned"
NODE_NOT_READY = "NodeNotReady"
NODE_GONE = "NodeGone"
CLASS_DELETED = "ClassDeleted"
CLASS_MISSING = "ClassMissing"
CLASS_UNUSABLE = "ClassUnusable"
BETTER_PLACEMENT = "BetterPlacement"


@dataclass(frozen=True)
class LivePool:
    """One worker Deployment of the deployment, as the cluster reports it."""

    name: str
    role: str
    accelerator_class: str
    replicas: int  # spec.replicas
    ready: int  # pods passing readiness, whichever template: they serve
    displaced: int = 0  # pods on a cordoned, NotReady or vanished node (not being deleted)
    displaced_why: tuple[str, ...] = ()  # NODE_CORDONED, NODE_NOT_READY, NODE_GONE: one per such pod's node state
    rolling: bool = False  # not every replica runs the Deployment's current template and is ready

    @property
    def key(self) -> Pool:
        return (self.role, self.accelerator_class)

    @property
    def unready(self) -> int:
        """Replicas that do not serve (Pending, starting, on a NotReady node)."""
        return max(0, self.replicas - self.ready)


@dataclass(frozen=True)
class Drift:
    """A pool that is not where or how the ideal plan would have it, and why (PlacementDrift)."""

    pool: str
    reason: str
    message: str


@dataclass(frozen=True)
class Step:
    """The pools to run next: replicas per (role, class), 0 for a live pool that goes."""

    replicas: Mapping[Pool, int]
    drift: tuple[Drift, ...] = ()
    moving: tuple[str, ...] = ()  # what is being handed over, one line per role (Progressing)
    stuck: tuple[str, ...] = ()  # roles whose move cannot progress, with why (PlacementDrift message)
    released: tuple[Pool, ...] = ()  # pools that gave up a serving replica for one-at-a-time moves

    def of(self, role: str) -> dict[str, int]:
        return {c: n for (r, c), n in self.replicas.items() if r == role}


def step(
    targets: Mapping[str, int],
    minimums: Mapping[str, int],
    ideal: Mapping[Pool, int],
    ranking: Mapping[str, Sequence[str]],
    live: Sequence[LivePool],
    free_now: Inventory,
    classes: Mapping[str, AcceleratorClassSpec],
    *,
    unusable: Mapping[str, tuple[str, str]] | None = None,
    holding: frozenset[str] = frozenset(),
) -> Step:
    """The next pools of every role in `targets`.

    `ideal`: replicas per pool placement would plan on capacity that counts this deployment's own units as free
    (healthy nodes only); `ranking`: each role's classes in placement order; `free_now`: capacity free for new
    replicas now; `classes`: the classes that can be rendered (a live pool whose class is absent keeps its
    size until it can go whole); `unusable`: class -> (reason, message): why placement may no longer use it;
    `holding`: roles in the middle of a rollout, whose serving replicas stay until it ends.
    """
    out = Step({})
    free = free_now
    for role, target in targets.items():
        pools = {p.accelerator_class: p for p in live if p.role == role}
        order = list(ranking.get(role, ())) + sorted(c for c in pools if c not in ranking.get(role, ()))
        role_step, free = _role_step(
            role,
            target,
            minimums.get(role, 0),
            order,
            ideal,
            pools,
            free,
            classes,
            dict(unusable or {}),
            holding=role in holding,
        )
        out = Step(
            {**out.replicas, **role_step.replicas},
            out.drift + role_step.drift,
            out.moving + role_step.moving,
            out.stuck + role_step.stuck,
            out.released + role_step.released,
        )
    return out


def _role_step(
    role: str,
    target: int,
    minimum: int,
    order: Sequence[str],
    ideal: Mapping[Pool, int],
    pools: Mapping[str, LivePool],
    free: Inventory,
    classes: Mapping[str, AcceleratorClassSpec],
    unusable: Mapping[str, tuple[str, str]],
    *,
    holding: bool,
) -> tuple[Step, Inventory]:
    """One role: grow towards the ideal, shed what neither serves nor is needed, shed serving surplus above the
    target, then (nothing else in flight) move one replica where the only room is what an old replica holds."""
    replicas, free = _grow(role, order, ideal, pools, free, classes)
    want = {c: ideal.get((role, c), 0) for c in order}
    _shed_idle(replicas, want, pools, classes, target)
    if not holding:
        _shed_serving(replicas, want, pools, order, sum(p.ready for p in pools.values()) - target, classes)
    missing = sum(max(0, want[c] - (replicas[c] - _displaced(pools, c))) for c in order)
    # Replicas on their way to serving: starting ones (not those stuck on a NotReady node) and new ones.
    in_flight = sum(max(0, p.unready - p.displaced) for p in pools.values()) + sum(
        max(0, replicas[c] - (pools[c].replicas if c in pools else 0)) for c in order
    )
    surplus = {c: replicas[c] - want[c] - p.displaced for c, p in pools.items() if replicas[c] > want[c] + p.displaced}
    moving: list[str] = []
    stuck: list[str] = []
    released: list[Pool] = []
    if missing and surplus:
        move = _one_at_a_time(
            order, want, replicas, pools, surplus, classes, free, minimum, in_flight=in_flight, holding=holding
        )
        if move is not None and move[0] is not None:
            victim, replacement = move
            replicas[victim] -= 1
            replicas[replacement] += 1
            released.append((role, victim))
            moving.append(
                f"{role}: moving one replica from {pools[victim].name} to {replacement} (the only "
                f"capacity for it is what the old replica holds)"
            )
        elif move is not None:
            stuck.append(f"{role}: {move[1]}")
    displaced = sum(p.displaced for p in pools.values())
    if displaced and not in_flight and sum(replicas.values()) - displaced < target:
        stuck.append(f"{role}: no free capacity for a replacement of its {displaced} displaced replica(s)")
    drift = [d for c, p in pools.items() for d in _drift(p, want.get(c, 0), replicas[c], unusable, classes)]
    kept = [c for c in order if c in pools and replicas[c] > want[c] + pools[c].displaced]
    if kept:
        moving.append(
            f"{role}: keeping "
            + ", ".join(f"{pools[c].name} {pools[c].ready}/{replicas[c]} ready" for c in kept)
            + f" until the replacements serve ({sum(p.ready for p in pools.values())} of {target} "
            f"ready in the role)"
        )
    runs = {(role, c): n for c, n in replicas.items() if n > 0 or c in pools}
    return Step(runs, tuple(drift), tuple(moving), tuple(stuck), tuple(released)), free


def _displaced(pools: Mapping[str, LivePool], c: str) -> int:
    return pools[c].displaced if c in pools else 0


def _grow(
    role: str,
    order: Sequence[str],
    ideal: Mapping[Pool, int],
    pools: Mapping[str, LivePool],
    free: Inventory,
    classes: Mapping[str, AcceleratorClassSpec],
) -> tuple[dict[str, int], Inventory]:
    """Each class up to what the ideal wants of it on healthy nodes, within capacity free now."""
    replicas: dict[str, int] = {}
    for c in order:
        live = pools.get(c)
        have = live.replicas if live else 0
        healthy = have - (live.displaced if live else 0)
        want = ideal.get((role, c), 0)
        added = 0
        if want > healthy and c in classes:
            free, added = free.take(classes[c], want - healthy)
        replicas[c] = have + added
    return replicas, free


def _shed_idle(
    replicas: dict[str, int],
    want: Mapping[str, int],
    pools: Mapping[str, LivePool],
    classes: Mapping[str, AcceleratorClassSpec],
    target: int,
) -> None:
    """Surplus replicas that do not serve go at once (a ReplicaSet removes its not-ready pods first), but never
    below the role's target: where the ideal is short of capacity (a NotReady node's pods evicted, their
    replacements Pending) those replicas are how the role comes back, not surplus."""
    budget = sum(replicas.values()) - target
    for c, p in pools.items():
        if c not in classes or budget <= 0:
            continue  # cannot be rendered: kept whole (see _shed_serving)
        surplus = replicas[c] - want.get(c, 0) - p.displaced
        cut = min(max(0, surplus), p.unready, budget)
        replicas[c] -= cut
        budget -= cut


def _shed_serving(
    replicas: dict[str, int],
    want: Mapping[str, int],
    pools: Mapping[str, LivePool],
    order: Sequence[str],
    excess: int,
    classes: Mapping[str, AcceleratorClassSpec],
) -> None:
    """Serving surplus goes worst class first, only as far as the role's ready replicas exceed its target."""
    for c in reversed(order):
        if excess <= 0:
            return
        p = pools.get(c)
        if p is None:
            continue
        surplus = replicas[c] - want.get(c, 0) - p.displaced
        if surplus <= 0:
            continue
        if c not in classes:
            # A pool whose class is gone cannot be re-rendered at another size: it goes whole, or stays.
            if p.ready <= excess and want.get(c, 0) == 0:
                excess -= p.ready
                replicas[c] = 0
            continue
        cut = min(surplus, excess)
        replicas[c] -= cut
        excess -= cut


def _one_at_a_time(
    order: Sequence[str],
    want: Mapping[str, int],
    replicas: Mapping[str, int],
    pools: Mapping[str, LivePool],
    surplus: Mapping[str, int],
    classes: Mapping[str, AcceleratorClassSpec],
    free: Inventory,
    minimum: int,
    *,
    in_flight: int,
    holding: bool,
) -> tuple[str | None, str] | None:
    """(class to release one serving replica of, class of its replacement, which binds in the released units); None
    to wait (a move is in flight); (None, why) when no move can progress."""
    if in_flight or holding:
        return None
    ready = sum(p.ready for p in pools.values())
    wanted = [c for c in order if want[c] > replicas[c] - _displaced(pools, c) and c in classes]
    victims = [c for c in reversed(order) if surplus.get(c, 0) > 0 and c in classes and pools[c].ready > 0]
    if ready - 1 < max(1, minimum):
        return (
            None,
            f"its {ready} ready replica(s) are its minimum ({max(1, minimum)}): no replica can be moved "
            f"without a free accelerator for its replacement",
        )
    for victim in victims:
        for target in wanted:
            if _frees_room_for(classes[victim], classes[target], free):
                return victim, target
    return (
        None,
        "no free capacity for "
        + ", ".join(wanted)
        + ", and releasing a replica of "
        + ", ".join(victims)
        + " would not make room for one",
    )


def _frees_room_for(old: AcceleratorClassSpec, new: AcceleratorClassSpec, free: Inventory) -> bool:
    """Whether the units one replica of `old` holds could host one replica of `new`: the same resource, at least
    `new.count` units once freed, on a node both classes may use.

    NOTE: which node the released replica is on is the ReplicaSet's choice, so this asks whether any node
    admitting both could do; a wrong guess costs one extra move, never capacity (the move waits for readiness).
    """
    if old.resource_name != new.resource_name or old.count < new.count:
        return False
    return any(n.admits(old) and n.admits(new) for n in free.nodes)


def _drift(
    p: LivePool,
    want: int,
    keep: int,
    unusable: Mapping[str, tuple[str, str]],
    classes: Mapping[str, AcceleratorClassSpec],
) -> list[Drift]:
    out = []
    if p.accelerator_class not in classes:
        out.append(
            Drift(
                p.name,
                CLASS_MISSING,
                f"{p.name}: AcceleratorClass {p.accelerator_class} no longer exists; "
                f"the pool keeps running unchanged until its role's other pools "
                f"can take its place",
            )
        )
    elif p.accelerator_class in unusable:
        reason, why = unusable[p.accelerator_class]
        out.append(Drift(p.name, reason, f"{p.name}: {why}; kept with {p.ready} ready until replacements serve"))
    if p.displaced:
        why = sorted(set(p.displaced_why))
        out.append(
            Drift(
                p.name,
                why[0],
                f"{p.name}: {p.displaced} replica(s) on "
                + " / ".join(_NODE_TEXT[w] for w in why)
                + " node(s); kept serving while replacements start elsewhere",
            )
        )
    elif want < keep and p.accelerator_class in classes and p.accelerator_class not in unusable:
        out.append(
            Drift(
                p.name,
                BETTER_PLACEMENT,
                f"{p.name}: placement now prefers other classes for {keep - want} "
                f"of its replicas; kept until they serve",
            )
        )
    return out


_NODE_TEXT = {NODE_CORDONED: "cordoned", NODE_NOT_READY: "NotReady", NODE_GONE: "vanished"}


def node_state(node: Mapping | None) -> str | None:
    """Why pods on this node count as displaced (NODE_CORDONED, NODE_NOT_READY, NODE_GONE), or None."""
    if node is None:
        return NODE_GONE
    if (node.get("spec") or {}).get("unschedulable"):
        return NODE_CORDONED
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready" and cond.get("status") != "True":
            return NODE_NOT_READY
    return None


__all__ = ["Drift", "LivePool", "Step", "node_state", "step"]
