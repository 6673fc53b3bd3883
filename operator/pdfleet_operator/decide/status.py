"""The InferenceDeployment status the reconcile path writes: pools, P:D, $/h, endpoint and conditions (pure).

`compute(...)` takes the plan, its cost, what the children report as ready, how the pools are being handed
over (`transition.Step`) and the previous status, and returns the new status; conditions other than the ones
it owns (MetricsAvailable, RolledBack, set by the autoscaler and rollback through the same reconcile) and their
fields are carried over.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pdfleet_operator.api import Condition, InferenceDeploymentStatus, PoolStatus, names, set_condition
from pdfleet_operator.decide.cost import PlanCost
from pdfleet_operator.decide.placement import FleetPlan
from pdfleet_operator.decide.transition import Drift

OWNED_CONDITIONS = ("Ready", "Progressing", "Degraded", "ScalingLimited", "PlacementDrift", "RolloutBlocked")


@dataclass(frozen=True)
class Observed:
    """What the children say (ready replicas per Deployment name, the router's) and how the pools move."""

    ready: Mapping[str, int] = field(default_factory=dict)
    router_ready: int = 0
    problems: tuple[str, ...] = ()  # objects that could not be applied (name conflicts, rejections)
    drift: tuple[Drift, ...] = ()  # pools not where the ideal plan would put them, and why (`transition`)
    moving: tuple[str, ...] = ()  # hand-overs in progress
    stuck: tuple[str, ...] = ()  # roles whose hand-over cannot progress, and why
    blocked: tuple[str, ...] = ()  # pools whose rollout is held (no room to keep a replica serving)


def pd_ratio(plan: FleetPlan) -> str:
    if "colocated" in plan.targets:
        return "-"
    return f"{plan.replicas('prefill')}:{plan.replicas('decode')}"


def _cond(type_: str, ok: bool, reason: str, message: str, now: dt.datetime, generation: int | None) -> Condition:
    return Condition(
        type=type_,
        status="True" if ok else "False",
        reason=reason,
        message=message[:32000],
        last_transition_time=now,
        observed_generation=generation,
    )


def compute(
    *,
    name: str,
    namespace: str,
    plan: FleetPlan,
    cost: PlanCost,
    observed: Observed,
    previous: InferenceDeploymentStatus | None,
    generation: int | None,
    revision: int,
    router_replicas: int,
    now: dt.datetime,
    extra_conditions: Sequence[Condition] = (),
    worker_image: str | None = None,
) -> InferenceDeploymentStatus:
    """`worker_image`: the pdfleet worker image of the served revision's pools whose class names none."""
    prev = previous or InferenceDeploymentStatus()
    pools = [
        PoolStatus(
            name=names.pool_name(name, p.role, p.accelerator_class),
            role=p.role,
            accelerator_class=p.accelerator_class,
            desired=p.replicas,
            ready=observed.ready.get(names.pool_name(name, p.role, p.accelerator_class), 0),
            cost_per_hour=round(cost.of(p.role, p.accelerator_class), 4),
        )
        for p in plan.pools
    ]
    roles = plan.roles()
    serving_by_role = {r: sum(p.ready for p in pools if p.role == r) for r in roles}
    # A role's size: what it runs, not counting replicas kept only until their replacements serve (a hand-over,
    # a surge for a displaced replica): the autoscaler's target where the plan could place it all.
    desired_by_role = {r: min(plan.replicas(r), plan.targets.get(r, plan.replicas(r))) for r in roles}

    conditions = list(prev.conditions)
    # Others' conditions first too, so that what is decided below sees them (RolledBack -> Degraded).
    for extra in extra_conditions:
        conditions = set_condition(conditions, extra)
    # ScalingLimited: the plan is short of its targets.
    if plan.shortfalls:
        first = plan.shortfalls[0]
        conditions = set_condition(
            conditions,
            _cond("ScalingLimited", True, first.reason, "; ".join(s.message for s in plan.shortfalls), now, generation),
        )
    else:
        conditions = set_condition(
            conditions,
            _cond(
                "ScalingLimited", False, "CapacityAvailable", "every role has the replicas it asks for", now, generation
            ),
        )
    # Degraded: a role that cannot run at all, or children that could not be applied.
    unplaced = [r for r in roles if plan.targets.get(r, 0) > 0 and desired_by_role[r] == 0]
    if observed.problems:
        conditions = set_condition(
            conditions, _cond("Degraded", True, "ApplyFailed", "; ".join(observed.problems), now, generation)
        )
    elif unplaced:
        conditions = set_condition(
            conditions,
            _cond(
                "Degraded",
                True,
                "RoleUnplaced",
                f"no replica of {', '.join(unplaced)} could be placed",
                now,
                generation,
            ),
        )
    elif _is_true(conditions, "RolledBack"):
        pass  # rollback owns Degraded while a rolled-back revision is served
    else:
        conditions = set_condition(
            conditions, _cond("Degraded", False, "AsExpected", "every role has a pool", now, generation)
        )
    # Progressing: children not yet at their desired size.
    behind = [f"{p.name} {p.ready}/{p.desired}" for p in pools if p.ready < p.desired]
    if observed.router_ready < router_replicas:
        behind.append(f"{names.router_name(name)} {observed.router_ready}/{router_replicas}")
    if behind or observed.moving:
        conditions = set_condition(
            conditions,
            _cond(
                "Progressing",
                True,
                "RollingOut",
                "; ".join((["waiting for " + ", ".join(behind)] if behind else []) + list(observed.moving)),
                now,
                generation,
            ),
        )
    else:
        conditions = set_condition(
            conditions, _cond("Progressing", False, "Complete", "every pool is at its desired size", now, generation)
        )
    # PlacementDrift: pools kept where the ideal plan would not put them (a cordoned node, a deleted class, ...).
    if observed.drift or observed.stuck:
        reason = observed.drift[0].reason if observed.drift else "NoCapacityToMove"
        conditions = set_condition(
            conditions,
            _cond(
                "PlacementDrift",
                True,
                reason,
                "; ".join([d.message for d in observed.drift] + list(observed.stuck)),
                now,
                generation,
            ),
        )
    else:
        conditions = set_condition(
            conditions,
            _cond("PlacementDrift", False, "AsPlanned", "every pool is where placement would put it", now, generation),
        )
    # RolloutBlocked: a new template waits rather than take a role's only ready replica down.
    if observed.blocked:
        conditions = set_condition(
            conditions,
            _cond("RolloutBlocked", True, "NoCapacityForSurge", "; ".join(observed.blocked), now, generation),
        )
    else:
        conditions = set_condition(
            conditions, _cond("RolloutBlocked", False, "AsExpected", "no rollout is held", now, generation)
        )
    # Ready: a request can be served end to end (router plus at least one worker per role, counting
    # a pool kept serving while its replacement starts).
    missing = [r for r in roles if serving_by_role[r] == 0]
    if observed.router_ready == 0:
        missing.append("router")
    if missing:
        conditions = set_condition(
            conditions,
            _cond("Ready", False, "NotServing", "no ready replica of " + ", ".join(missing), now, generation),
        )
    else:
        conditions = set_condition(
            conditions,
            _cond(
                "Ready",
                True,
                "Serving",
                ", ".join(f"{r} {serving_by_role[r]}/{desired_by_role[r]}" for r in roles)
                + f", router {observed.router_ready}/{router_replicas}",
                now,
                generation,
            ),
        )
    for extra in extra_conditions:
        conditions = set_condition(conditions, extra)

    if "colocated" in roles:
        prefill_replicas, decode_replicas = None, desired_by_role["colocated"]
    else:
        prefill_replicas, decode_replicas = desired_by_role["prefill"], desired_by_role["decode"]
    return prev.model_copy(
        update={
            "observed_generation": generation,
            "conditions": conditions,
            "pools": pools,
            "prefill_replicas": prefill_replicas,
            "decode_replicas": decode_replicas,
            "pd_ratio": pd_ratio(plan),
            "cost_per_hour": round(cost.total_per_hour, 4),
            "endpoint": names.endpoint(name, namespace),
            "current_revision": revision,
            "worker_image": worker_image,
        }
    )


def _is_true(conditions: Sequence[Condition], type_: str) -> bool:
    return any(c.type == type_ and c.status == "True" for c in conditions)


def refused(previous: Mapping | None, message: str, generation: int | None, now: dt.datetime) -> list[dict] | None:
    """The conditions of a CR whose spec the operator refused (a rule across objects, e.g. `decide.runtimes`), or
    None when they already say so. `Degraded=True, InvalidSpec`; `Ready=False` too while nothing was ever planned:
    pools that serve an earlier generation keep serving it, and Ready keeps saying so."""
    previous = previous or {}
    conditions = [Condition.model_validate(c) for c in previous.get("conditions") or []]
    serving = bool(previous.get("pools"))
    detail = (
        message
        if not serving
        else (
            f"generation {generation} refused, the pools keep serving generation "
            f"{previous.get('observedGeneration')}: {message}"
        )
    )
    out = set_condition(
        conditions,
        Condition(
            type="Degraded",
            status="True",
            reason="InvalidSpec",
            message=detail,
            last_transition_time=now,
            observed_generation=generation,
        ),
    )
    if not serving:
        out = set_condition(
            out,
            Condition(
                type="Ready",
                status="False",
                reason="InvalidSpec",
                message=detail,
                last_transition_time=now,
                observed_generation=generation,
            ),
        )
    wire = [c.wire() for c in out]
    return None if wire == (previous.get("conditions") or []) else wire
