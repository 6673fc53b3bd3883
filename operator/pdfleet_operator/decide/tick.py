"""One autoscaling tick, the same in every backend: what runs now, what capacity is free, what the autoscaler decides
(pure).

The operator (`kube.scaling`), `pdfleet up` (`local.up`) and the simulator (`sim.simulator`) each read
a `MetricsSnapshot` their own way and act on the outcome their own way; between the two they call
`scale`, so "current replicas" and "free capacity" mean one thing everywhere: the replicas the last
plan runs (or what the backend says runs, when it counts pods still starting), and the most replicas
that plan found placeable per role and per AcceleratorClass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pdfleet_operator.api import InferenceDeploymentSpec
from pdfleet_operator.decide import autoscaler
from pdfleet_operator.decide.autoscaler import Policy, ScalingDecision
from pdfleet_operator.decide.metrics_snapshot import MetricsSnapshot
from pdfleet_operator.decide.placement import FleetPlan
from pdfleet_operator.decide.scaler_state import ScalerState


@dataclass(frozen=True)
class ScalingTick:
    """What one tick decided: a decision per role and the autoscaler state for the next tick."""

    decisions: Mapping[str, ScalingDecision]
    state: ScalerState

    @property
    def desired(self) -> dict[str, int]:
        """Total replicas per role to plan for (placement caps them at capacity)."""
        return {role: d.desired for role, d in self.decisions.items()}

    @property
    def moved(self) -> list[ScalingDecision]:
        """The decisions that change a role's size."""
        return [d for d in self.decisions.values() if d.direction != "hold"]

    def why(self) -> str:
        """'prefill 1->2 (QueueAboveTarget), ...' for the roles that move ('' when none does)."""
        return ", ".join(f"{d.role} {d.current}->{d.desired} ({d.reason})" for d in self.moved)


def scale(
    spec: InferenceDeploymentSpec,
    state: ScalerState,
    snapshot: MetricsSnapshot,
    now: float,
    plan: FleetPlan | None,
    *,
    current: Mapping[str, int] | None = None,
    policy: Policy = autoscaler.PDFLEET,
) -> ScalingTick:
    """Decide every role's size from `snapshot` against `plan`, the deployment's last plan (None before the first).

    Capacity and the order in which classes fill come from `plan` (no plan: unbounded, no order).
    `current` is what runs now when the backend knows better than the plan (the simulator counts pods
    still starting); by default it is the plan's replicas.
    """
    roles = plan.roles() if plan is not None else ()
    capacity = {role: plan.capacity(role) for role in roles}
    order = {role: plan.class_capacity(role) for role in roles} or None
    if current is None:
        current = {role: plan.replicas(role) for role in roles}
    decisions, state = autoscaler.decide(
        spec, state, snapshot, now, capacity, current=dict(current) or None, policy=policy, order=order
    )
    return ScalingTick(decisions, state)
