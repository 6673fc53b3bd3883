"""The Deployment controller's arithmetic (pure, from Kubernetes' ``deployment/util`` and ``rolling.go``): maxSurge and
maxUnavailable resolved against replicas, how far a new ReplicaSet may grow, how far old ones may shrink, and
proportional scaling; the controller in :mod:`.deployments` applies it to the ReplicaSets it owns."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tests.support.k8s.workloads.objects import scaled_value

DEFAULT_SURGE = "25%"
DEFAULT_UNAVAILABLE = "25%"


@dataclass
class Set:
    """One ReplicaSet as the arithmetic sees it."""

    name: str
    spec: int  # spec.replicas
    available: int = 0  # status.availableReplicas
    created: str = ""  # creationTimestamp (then name) orders old sets oldest first
    max_replicas: int | None = None  # the deployment.kubernetes.io/max-replicas annotation


def rolling_params(deployment: dict) -> dict:
    return (((deployment.get("spec") or {}).get("strategy") or {}).get("rollingUpdate")) or {}


def is_rolling(deployment: dict) -> bool:
    return (((deployment.get("spec") or {}).get("strategy") or {}).get("type") or "RollingUpdate") == "RollingUpdate"


def replicas_of(deployment: dict) -> int:
    value = (deployment.get("spec") or {}).get("replicas")
    return 1 if value is None else int(value)


def fenceposts(deployment: dict) -> tuple[int, int]:
    """(maxSurge, maxUnavailable) as ``ResolveFenceposts``: surge rounds up, unavailable down; both 0 becomes
    unavailable 1 (percentages that round to 0; literal zeros are refused at admission)."""
    params, replicas = rolling_params(deployment), replicas_of(deployment)
    surge = scaled_value(params.get("maxSurge"), replicas, round_up=True, default=DEFAULT_SURGE)
    unavailable = scaled_value(params.get("maxUnavailable"), replicas, round_up=False, default=DEFAULT_UNAVAILABLE)
    if surge == 0 and unavailable == 0:
        unavailable = 1
    return surge, unavailable


def max_surge(deployment: dict) -> int:
    return fenceposts(deployment)[0] if is_rolling(deployment) else 0


def max_unavailable(deployment: dict) -> int:
    replicas = replicas_of(deployment)
    if not is_rolling(deployment) or replicas == 0:
        return 0
    return min(fenceposts(deployment)[1], replicas)


def new_set_replicas(deployment: dict, all_sets: list[Set], new_spec: int) -> int:
    """``NewRSNewReplicas``: the new set's size this step (rolling: within replicas + maxSurge in total)."""
    replicas = replicas_of(deployment)
    if not is_rolling(deployment):
        return replicas
    if new_spec == replicas:
        return replicas
    current = sum(s.spec for s in all_sets)
    max_total = replicas + max_surge(deployment)
    if current >= max_total:
        return new_spec
    return new_spec + min(max_total - current, replicas - new_spec)


def old_scale_down(deployment: dict, new: Set, old: list[Set]) -> dict[str, int]:
    """``reconcileOldReplicaSets``: the new spec of each old set this step (unhealthy replicas first, then available
    ones while availability stays at replicas - maxUnavailable); sets not listed keep their size."""
    old_count = sum(s.spec for s in old)
    if old_count == 0:
        return {}
    all_count = old_count + new.spec
    min_available = replicas_of(deployment) - max_unavailable(deployment)
    new_unavailable = new.spec - new.available
    max_scaled_down = all_count - min_available - new_unavailable
    if max_scaled_down <= 0:
        return {}
    sizes = {s.name: s.spec for s in old}
    ordered = sorted(old, key=lambda s: (s.created, s.name))
    cleaned = 0
    for s in ordered:  # cleanupUnhealthyReplicas
        if cleaned >= max_scaled_down:
            break
        if s.spec == 0 or s.spec == s.available:
            continue
        count = min(max_scaled_down - cleaned, s.spec - s.available)
        sizes[s.name] = s.spec - count
        cleaned += count
    # scaleDownOldReplicaSetsForRollingUpdate: what is available beyond min_available may go (statuses as read).
    available = new.available + sum(s.available for s in old)
    if available > min_available:
        budget, done = available - min_available, 0
        for s in ordered:
            if done >= budget:
                break
            if sizes[s.name] == 0:
                continue
            count = min(sizes[s.name], budget - done)
            sizes[s.name] -= count
            done += count
    return {name: size for name, size in sizes.items() if size != next(s.spec for s in old if s.name == name)}


def proportional(deployment: dict, sets: list[Set], status_replicas: int, *, newest_first: list[str]) -> dict[str, int]:
    """``scale`` during a rollout: spread replicas + maxSurge over the active sets in proportion to their sizes
    (``getProportion``), the rounding leftover to the largest; `newest_first` names the sets newest first."""
    replicas = replicas_of(deployment)
    allowed = replicas + max_surge(deployment) if replicas > 0 else 0
    to_add = allowed - sum(s.spec for s in sets)
    if to_add == 0:
        return {s.name: s.spec for s in sets}
    age = {name: i for i, name in enumerate(newest_first)}
    if to_add > 0:  # ReplicaSetsBySizeNewer
        ordered = sorted(sets, key=lambda s: (-s.spec, age.get(s.name, 0)))
    else:  # ReplicaSetsBySizeOlder
        ordered = sorted(sets, key=lambda s: (-s.spec, -age.get(s.name, 0)))
    sizes, added = {}, 0
    for s in ordered:
        share = _proportion(s, replicas, max_surge(deployment), status_replicas, to_add, added)
        sizes[s.name] = s.spec + share
        added += share
    if added != to_add and ordered:
        first = ordered[0].name
        sizes[first] = max(0, sizes[first] + to_add - added)
    return {name: max(0, size) for name, size in sizes.items()}


def _proportion(s: Set, replicas: int, surge: int, status_replicas: int, to_add: int, added: int) -> int:
    if s.spec == 0 or to_add == 0 or to_add == added:
        return 0
    if replicas == 0:
        fraction = -s.spec
    else:
        annotated = s.max_replicas if s.max_replicas else status_replicas
        fraction = _round(s.spec * (replicas + surge) / annotated) - s.spec if annotated else 0
    allowed = to_add - added
    return min(fraction, allowed) if to_add > 0 else max(fraction, allowed)


def _round(value: float) -> int:
    """Go's ``math.Round``: halves away from zero (Python's round() goes to even)."""
    return int(math.floor(value + 0.5)) if value >= 0 else -int(math.floor(-value + 0.5))
