"""A pure simulated clock for autoscaler tests: feeds scripted per-role queue metrics to `decide` every interval."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pdfleet_operator.api import InferenceDeploymentSpec
from pdfleet_operator.decide import autoscaler
from pdfleet_operator.decide.metrics_snapshot import MetricsSnapshot, RoleMetrics

# A script answers, at simulated time t and the replicas running then, each role's queues as
# {"waiting": .., "running": .., "prompt_tokens_waiting": ..}, or a MetricsSnapshot to hand over as is
# (a gap, stale samples, an error).
Script = Callable[[float, Mapping[str, int]], "Mapping[str, Mapping[str, float]] | MetricsSnapshot"]


@dataclass(frozen=True)
class Step:
    t: float
    decisions: dict[str, autoscaler.ScalingDecision]
    replicas: dict[str, int]


def spec(**overrides: Any) -> InferenceDeploymentSpec:
    """A PD spec for tests (wire names); `overrides` replace top-level keys, e.g. autoscaling={...}."""
    body: dict[str, Any] = {
        "model": {"name": "tiny", "source": {"local": {"path": "models/tiny"}}},
        "prefill": {"acceleratorClasses": ["h100"], "minReplicas": 1, "maxReplicas": 8, "targetQueuePerReplica": 4},
        "decode": {"acceleratorClasses": ["h100"], "minReplicas": 1, "maxReplicas": 16, "targetQueuePerReplica": 16},
        "autoscaling": {"interval": "15s"},
    }
    body.update(overrides)
    return InferenceDeploymentSpec.model_validate(body)


def snapshot(
    t: float,
    roles: Mapping[str, Mapping[str, float]],
    replicas: Mapping[str, int] | None = None,
    sample_time: float | None = None,
) -> MetricsSnapshot:
    """An ok snapshot taken at t from per-role queue numbers."""
    return MetricsSnapshot(
        taken_at=t,
        source="script",
        roles={
            role: RoleMetrics(
                waiting=q.get("waiting", 0.0),
                running=q.get("running", 0.0),
                prompt_tokens_waiting=q.get("prompt_tokens_waiting"),
                replicas_reporting=max(1, (replicas or {}).get(role, 1)),
                sample_time=t if sample_time is None else sample_time,
            )
            for role, q in roles.items()
        },
    )


def simulate(
    s: InferenceDeploymentSpec,
    script: Script,
    duration: float,
    *,
    replicas: Mapping[str, int] | None = None,
    capacity: Mapping[str, int] | None = None,
    start: float = 1_000_000.0,
) -> list[Step]:
    """Call decide every spec interval for `duration` simulated seconds; the decided sizes take effect at once."""
    state = autoscaler.ScalerState.initial(s, replicas)
    interval = s.interval_seconds()
    steps: list[Step] = []
    t = start
    while t < start + duration:
        current = dict(state.replicas)
        got = script(t - start, current)
        snap = got if isinstance(got, MetricsSnapshot) else snapshot(t, got, current)
        decisions, state = autoscaler.decide(s, state, snap, t, capacity or {})
        # the state must survive the trip through an annotation
        state = autoscaler.ScalerState.from_json(state.to_json())
        steps.append(Step(t - start, decisions, dict(state.replicas)))
        t += interval
    return steps


def direction_changes(steps: list[Step], role: str) -> int:
    """How often the role's scaling direction flipped (up after down or down after up)."""
    moves = [st.decisions[role].direction for st in steps if st.decisions[role].direction != "hold"]
    return sum(1 for a, b in zip(moves, moves[1:]) if a != b)


def first(steps: list[Step], role: str, predicate: Callable[[autoscaler.ScalingDecision], bool]) -> Step | None:
    return next((st for st in steps if predicate(st.decisions[role])), None)
