"""The autoscaler's pure decision: desired replicas per role from queue metrics and token rates; called by the
operator's timer, `pdfleet up`, the simulator and the bench."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from pdfleet_operator.api.inference_deployment import InferenceDeploymentSpec, ScalingDecisionStatus
from pdfleet_operator.api.meta import Condition, parse_duration
from pdfleet_operator.decide.metric_names import RATE_WINDOW_S
from pdfleet_operator.decide.metrics_snapshot import MetricsSnapshot, RoleMetrics
from pdfleet_operator.decide.scaler_state import ScalerState
from pdfleet_operator.decide.token_rate import (
    SATURATED_WAITING,
    SERVED_TOKENS,
    WHOLE_ROLE,
    TokenRate,
    arrival_rate,
    generation_ratio,
    observe_rate,
    rate_floor,
    rate_peak,
    recent,
    replicas_for,
    surge_growth,
    tokens_needed,
)

Direction = Literal["up", "down", "hold"]

# Machine reasons (ScalingDecision.reason, status.lastScalingDecision.reason, the metric's `reason` label).
QUEUE_ABOVE_TARGET = "QueueAboveTarget"
QUEUE_BELOW_TARGET = "QueueBelowTarget"
PREFILL_BACKLOG = "PrefillBacklog"  # decode grown ahead of work still queued at prefill
QUEUE_GROWING = "QueueGrowing"  # sized for the queue expected at the next interval
TOKEN_RATE_ABOVE_CAPACITY = "TokenRateAboveCapacity"  # token arrivals need more than the replicas serve
TOKEN_RATE_BELOW_CAPACITY = "TokenRateBelowCapacity"  # fewer replicas serve the token arrivals (queues empty)
WITHIN_TOLERANCE = "WithinTolerance"
SCALE_UP_STABILIZING = "ScaleUpStabilizing"
SCALE_DOWN_STABILIZING = "ScaleDownStabilizing"
SCALE_DOWN_DELAYED = "ScaleDownDelayed"  # grace period after a scale-up of the same role
MIN_REPLICAS = "MinReplicas"
MAX_REPLICAS = "MaxReplicas"
RATIO_BOUND = "RatioBound"
REQUESTS_WAITING = "RequestsWaiting"  # a scale-down held: requests wait, or fewer replicas exceed the target
SCALING_LIMITED = "ScalingLimited"  # not enough free accelerators for what the queue asks
METRICS_UNAVAILABLE = "MetricsUnavailable"
AUTOSCALING_DISABLED = "AutoscalingDisabled"

REASONS = (
    QUEUE_ABOVE_TARGET,
    QUEUE_BELOW_TARGET,
    PREFILL_BACKLOG,
    QUEUE_GROWING,
    TOKEN_RATE_ABOVE_CAPACITY,
    TOKEN_RATE_BELOW_CAPACITY,
    WITHIN_TOLERANCE,
    SCALE_UP_STABILIZING,
    SCALE_DOWN_STABILIZING,
    SCALE_DOWN_DELAYED,
    MIN_REPLICAS,
    MAX_REPLICAS,
    RATIO_BOUND,
    SCALING_LIMITED,
    REQUESTS_WAITING,
    METRICS_UNAVAILABLE,
    AUTOSCALING_DISABLED,
)

_EPS = 1e-9
# The queue trend applies only to a surge: a queue at least this many times what the replicas carry at
# target. Noise of +-30% around target never gets there.
SURGE = 1.5
# The token rate sizes a role to run at this share of its saturated throughput: the headroom a burst
# meets before the replicas it makes the autoscaler ask for are ready.
# It is the spec's `autoscaling.targetUtilization` (default below) unless a Policy overrides it; the
# tolerance still applies on top, as the dead band. With drain sizing the headroom is (1/u - 1) times
# the lowest rate of the scale-down window (`tokens_needed`). `bench/autoscaler.py --utilization`
# sweeps it (10 seeds; bursty replica-hours / the clairvoyant oracle's, the worst trace's
# under-provisioning / per-role's, noisy-steady direction changes per 10 min): 0.65 -> 1.50, 0.75,
# 0.6; 0.7 -> 1.44, 0.84, 0.8; 0.75 -> 1.36, 0.93, 1.1; 0.8 -> 1.34, 0.97, 1.0.
TARGET_UTILIZATION = 0.7
# A drained role (nothing waiting at this decision nor the one before, its throughput measured) scales
# down over `autoscaling.drainedScaleDownStabilization` instead of `scaleDownStabilization` once its
# served rate has fallen to at most this share of its highest over the scale-down window: the end of a
# burst, not noise.
# NOTE: a 1-minute rate of arrivals that step +-30% every 15 s moves about +-15%, so its low is about
# 0.74 of its high. Tuned on bursty and noisy-steady (10 seeds; bursty replica-hours / the clairvoyant
# oracle's, noisy-steady direction changes in 15 min), with a 60 s drained window: 0.6 -> 1.51 and 0.8,
# 0.65 -> 1.50 and 0.8, 0.7 -> 1.48 and 1.0, 0.75 -> 1.45 and 1.7, 0.8 -> 1.43 and 2.2; with 30 s (the
# default) 0.7 -> 1.44 and 1.2. A first version compared the size asked for with the size run (<= 0.75
# of it): one replica of 3-4 is that much, and a steady noisy rate flapped 3 -> 4 -> 3.
DRAINED_FALL = 0.7


@dataclass(frozen=True)
class Policy:
    """Which mechanisms beyond one HPA per role run; the bench switches them off to measure each."""

    prefill_lookahead: bool = True  # decode counts requests queued at prefill beyond its tolerance
    queue_trend: bool = True  # a queue that grew since the last interval is sized for the next one
    token_rate: bool = True  # also size prefill/decode for their token arrival rate (`rate_need`)
    utilization: float | None = None  # the token rate's target share of saturated throughput; None: the spec's
    ratio_bounds: bool = True  # spec.autoscaling.pdRatio
    rate_trend: bool = True  # with token_rate: in a surge, size for the rate when new replicas serve
    # with token_rate and a learned throughput: size by the token rate and the time to drain (`rate_tokens`),
    # not by the queue targets
    drain_sizing: bool = True
    # with token_rate: a drained role whose rate asks for DRAINED_FALL or less scales down over the short window
    drained_scale_down: bool = True


PDFLEET = Policy()
# Each role on its own queue, like one HPA per role (same targets, tolerance, windows, steps, bounds).
PER_ROLE = Policy(
    prefill_lookahead=False,
    queue_trend=False,
    token_rate=False,
    ratio_bounds=False,
    rate_trend=False,
    drain_sizing=False,
    drained_scale_down=False,
)


@dataclass(frozen=True)
class ScalingDecision:
    """What one role should run next interval, and why."""

    role: str
    current: int
    desired: int
    direction: Direction
    reason: str
    message: str

    def __post_init__(self) -> None:
        expected = "up" if self.desired > self.current else "down" if self.desired < self.current else "hold"
        assert self.direction == expected, f"{self.role}: direction {self.direction} for {self.current}->{self.desired}"
        assert self.reason in REASONS, f"unknown reason {self.reason!r}"
        assert self.desired >= 0, f"{self.role}: negative desired replicas {self.desired}"


@dataclass
class _Draft:
    """A role's decision while the chain of policies works on it."""

    current: int
    desired: int
    reason: str
    message: str

    def set(self, desired: int, reason: str, message: str) -> None:
        self.desired, self.reason, self.message = desired, reason, message


def decide(
    spec: InferenceDeploymentSpec,
    state: ScalerState,
    snapshot: MetricsSnapshot,
    now: float,
    capacity: Mapping[str, int],
    current: Mapping[str, int] | None = None,
    policy: Policy = PDFLEET,
    order: Mapping[str, Sequence[tuple[str, int]]] | None = None,
) -> tuple[dict[str, ScalingDecision], ScalerState]:
    """Desired replicas per role for this interval, and the state to pass to the next call.

    `capacity` is the most replicas of each role placeable on free accelerators (placement's
    `FleetPlan.capacity(role)`; a role absent from it is unbounded). `current` overrides the sizes in
    `state` (what the Deployments ask for now). `order` is, per role, (AcceleratorClass, most replicas
    placeable on it) in the order placement fills them (`FleetPlan.class_capacity(role)`): the token
    rate sizes a role by the learned throughput of the classes its next replicas land on. The chain: queue
    recommendation with tolerance -> stabilization windows -> grace period after a scale-up -> step limits -> min/max ->
    capacity -> P:D ratio bounds; the reason is that of the last policy that changed the number.

    `policy=PER_ROLE` scales each role on its own queue only (no prefill look-ahead for decode, no
    queue trend, no token rate, no ratio bounds): the HPA-style baseline `bench/autoscaler.py`
    compares against.
    """
    roles = spec.roles()
    sizes = dict(state.replicas)
    sizes.update(current or {})
    cur = {role: int(sizes.get(role, rs.min_replicas)) for role, rs in roles.items()}
    auto = spec.autoscaling

    if not auto.enabled:
        drafts = {
            role: _Draft(
                cur[role],
                rs.min_replicas,
                AUTOSCALING_DISABLED,
                f"autoscaling is disabled: running minReplicas ({rs.min_replicas})",
            )
            for role, rs in roles.items()
        }
        return _finish(drafts, state, now, record=None, needs=None, rates=None)

    problem = metrics_problem(snapshot, roles, now, parse_duration(auto.metrics_max_age))
    if problem:
        drafts = {
            role: _Draft(cur[role], cur[role], METRICS_UNAVAILABLE, f"holding {cur[role]} replicas: {problem}")
            for role in roles
        }
        return _finish(drafts, state, now, record=None, needs=None, rates=None)

    down_window = parse_duration(auto.scale_down_stabilization)
    rates = (
        {
            role: observe_rate(role, snapshot.roles[role], state, now, max_num_seqs=spec.engine.max_num_seqs)
            for role in roles
            if role in SERVED_TOKENS
        }
        if policy.token_rate
        else {}
    )
    keep = max(2 * RATE_WINDOW_S, down_window)
    rate_history = {
        role: recent(state.rate_history.get(role, ()), now, keep) + ((now, r.served, sum(r.replicas.values())),)
        for role, r in rates.items()
        if r.served is not None
    }
    for role, hist in rate_history.items():
        growth = surge_growth(hist, now, spec.interval_seconds()) if policy.rate_trend else 0.0
        rates[role] = replace(
            rates[role], growth=growth, floor=rate_floor(hist, now, down_window), peak=rate_peak(hist, now, down_window)
        )
    ratio = state.generation_per_prompt
    if "prefill" in rates and "decode" in rates:
        ratio = generation_ratio(ratio, rates["prefill"], rates["decode"])
        p = rates["prefill"]
        if ratio is not None and p.served is not None:
            arriving = arrival_rate(p.served, p.queued, state.last_queue.get("prefill"), now, spec.interval_seconds())
            # with drain sizing, prefill's backlog reaches decode within drainTime too
            draining = (
                (p.queued or 0.0) / parse_duration(auto.drain_time) if policy.drain_sizing and p.per_replica else 0.0
            )
            rates["decode"] = replace(rates["decode"], ahead=ratio * (arriving + p.growth + draining))
    recommended: dict[str, int] = {}
    needs: dict[str, float] = {}
    drafts = {}
    for role in roles:
        rec, reason, message, needs[role] = _recommend(
            spec,
            role,
            snapshot.roles,
            cur,
            policy,
            state.last_need.get(role),
            now,
            rates.get(role),
            state.last_queue.get(role),
            (order or {}).get(role),
        )
        floor, why = queue_floor(spec, role, snapshot.roles[role], cur[role])
        if rec < floor:  # a partial scale-down keeps the reason that asked for it, as the windows do
            reason = REQUESTS_WAITING if floor == cur[role] else reason
            rec, message = floor, f"{message}; held at {floor}: {why}"
        recommended[role] = rec
        drafts[role] = _Draft(cur[role], rec, reason, message)

    history = _history(state, recommended, now, max(parse_duration(auto.scale_up_stabilization), down_window))
    for role, draft in drafts.items():
        rs = roles[role]
        window = down_window
        rate = rates.get(role)
        if (
            policy.drained_scale_down
            and rate is not None
            and rate.per_replica
            and rate.steady
            and rate.served is not None
            and rate.peak
            and rate.served <= DRAINED_FALL * rate.peak
        ):
            window = min(down_window, parse_duration(auto.drained_scale_down_stabilization))
        _stabilize(
            draft,
            history[role],
            now,
            parse_duration(auto.scale_up_stabilization),
            window,
            state.watching_since.get(role, now),
        )
        _grace(draft, state.last_scale_up.get(role), now, parse_duration(auto.scale_down_delay_after_scale_up))
        _step(draft, auto.max_scale_up_step, auto.max_scale_down_step)
        _bounds(draft, rs.min_replicas, rs.max_replicas)
        _capacity(draft, capacity.get(role))
    if policy.ratio_bounds and "prefill" in drafts and "decode" in drafts:
        _ratio(drafts["prefill"], drafts["decode"], spec, capacity, auto.pd_ratio.min, auto.pd_ratio.max)
    for role, draft in drafts.items():
        _hold_for_queue(draft, *queue_floor(spec, role, snapshot.roles[role], cur[role]), roles[role].max_replicas)
    new_state = replace(state, generation_per_prompt=ratio, rate_history={**state.rate_history, **rate_history})
    return _finish(drafts, new_state, now, record=history, needs=needs, rates=rates)


def metrics_problem(snapshot: MetricsSnapshot, roles: Mapping[str, object], now: float, max_age: float) -> str:
    """Why this snapshot cannot be acted on ('' when it can): unavailable, a role missing, or too old."""
    if not snapshot.ok:
        return f"metrics unavailable ({snapshot.error})"
    missing = sorted(set(roles) - set(snapshot.roles))
    if missing:
        return f"no metrics for role(s) {', '.join(missing)}"
    stale = {role: snapshot.age(role, now) for role in roles if snapshot.age(role, now) > max_age}
    if stale:
        worst = max(stale, key=lambda r: stale[r])
        return f"metrics of {worst} are {stale[worst]:.0f}s old (metricsMaxAge {max_age:.0f}s)"
    return ""


def _recommend(
    spec: InferenceDeploymentSpec,
    role: str,
    metrics: Mapping[str, RoleMetrics],
    cur: Mapping[str, int],
    policy: Policy,
    last: tuple[float, float] | None,
    now: float,
    rate: TokenRate | None = None,
    last_queue: tuple[float, float] | None = None,
    order: Sequence[tuple[str, int]] | None = None,
) -> tuple[int, str, str, float]:
    """Replicas the role's queue asks for, HPA-style: ceil(load / target), unchanged within tolerance.

    With a token rate (`policy.token_rate`), the larger of that and what the token arrival rate asks
    for (`tokens_needed` over the throughput of the replicas placement would run, `replicas_for`). Also returns the
    role's own need (replicas' worth of its queue) for the next interval's trend.
    """
    m, rs, n = metrics[role], spec.roles()[role], cur[role]
    tolerance = spec.autoscaling.tolerance
    target = spec.target_queue(role)
    lookahead = 0.0
    if role == "prefill":
        need = m.waiting / target
        what = f"{m.waiting:g} waiting requests (target {target:g}/replica)"
        token_target = rs.target_prompt_tokens_per_replica
        if token_target and m.prompt_tokens_waiting is not None and m.prompt_tokens_waiting / token_target > need:
            need = m.prompt_tokens_waiting / token_target
            what = f"{m.prompt_tokens_waiting:g} waiting prompt tokens (target {token_target}/replica)"
        elif token_target and m.prompt_tokens_waiting is None:
            what += "; prompt tokens waiting not reported, scaled on requests only"
    else:
        load = m.running + m.waiting
        if policy.prefill_lookahead and role == "decode" and "prefill" in metrics:
            lookahead = prefill_backlog(
                metrics["prefill"].waiting, cur.get("prefill", 0), spec.target_queue("prefill"), tolerance
            )
        need = load / target
        what = f"{load:g} running+waiting requests (target {target:g}/replica)"
        if lookahead:
            what += f" + {lookahead:g} requests queued at prefill beyond its target"
    own = need
    need += lookahead / target
    queue_need = need
    by_rate = False
    drain_sized = False
    if rate is not None and rate.served is not None and rate.per_replica:
        arriving = arrival_rate(rate.served, rate.queued, last_queue, now, spec.interval_seconds())
        if rate.growth > 0:
            what += (
                f"; arrivals surging: {arriving:.0f} tokens/s + {rate.growth:.0f} expected by when new replicas serve"
            )
            arriving += rate.growth
        if rate.ahead is not None and rate.ahead > arriving:
            what += f"; {rate.ahead:.0f} tokens/s on their way from prefill's arrivals"
            arriving = rate.ahead
        utilization = policy.utilization if policy.utilization is not None else spec.autoscaling.target_utilization
        if policy.drain_sizing:
            tokens = tokens_needed(
                arriving, rate.queued, utilization, parse_duration(spec.autoscaling.drain_time), floor=rate.floor
            )
        else:
            tokens = tokens_needed(arriving, rate.queued, utilization)
        token_need = replicas_for(tokens, rate.slots(order))
        if policy.drain_sizing and (role != "prefill" or rate.queued is not None):
            # NOTE: the measured throughput replaces the queue targets. They ask for what drains the queue
            # in a few seconds (the bench's 6,000 prompt tokens per replica is 1.5 s of a replica's work),
            # so a burst's backlog took prefill to maxReplicas while the rate needed half that. Prefill's
            # queued tokens now drain within drainTime; decode keeps its running+waiting target (its
            # concurrency), but not the look-ahead, which prefill's arrivals and backlog now carry.
            need = own if role != "prefill" else 0.0
            queue_need = need
            drain_sized = True
            what += "; queue targets yield to the measured rate"
        by_rate = token_need > need
        classes = sorted((k, v) for k, v in rate.per_class.items() if k != WHOLE_ROLE)
        what += (
            f"; {arriving:.0f} tokens/s arriving"
            + (f" + {rate.queued:g} queued" if rate.queued else "")
            + f" at {rate.per_replica:.0f} tokens/s per saturated replica"
            + (f" ({', '.join(f'{k} {v:.0f}' for k, v in classes)})" if len(classes) > 1 else "")
            + f": {token_need:.2f} replicas' worth"
        )
        need = max(need, token_need)

    if n > 0 and abs(need / n - 1.0) <= tolerance:
        return n, WITHIN_TOLERANCE, f"{what}: {need:.2f} replicas' worth is within {tolerance:g} of {n}", own
    rec = max(0, math.ceil(need - _EPS))
    if rec > n:
        reason = (
            TOKEN_RATE_ABOVE_CAPACITY
            if by_rate
            else PREFILL_BACKLOG
            if math.ceil(own - _EPS) <= n
            else QUEUE_ABOVE_TARGET
        )
        surging = policy.queue_trend and not (drain_sized and role == "prefill") and own >= SURGE * max(n, 1)
        growth = queue_growth(last, now, own, spec.interval_seconds()) if surging else 0.0
        ahead = max(0, math.ceil(queue_need + growth - _EPS))
        if ahead > rec:
            return (
                ahead,
                QUEUE_GROWING,
                (
                    f"{what}: needs {rec}, and the queue grew by {growth:.2f} replicas' "
                    f"worth over the last interval: sized for the next, {ahead}"
                ),
                own,
            )
        return rec, reason, f"{what}: needs {rec}", own
    if rec < n:
        return rec, TOKEN_RATE_BELOW_CAPACITY if by_rate else QUEUE_BELOW_TARGET, f"{what}: needs {rec}", own
    return n, WITHIN_TOLERANCE, f"{what}: needs {n}", own


def queue_floor(spec: InferenceDeploymentSpec, role: str, m: RoleMetrics, current: int) -> tuple[int, str]:
    """The fewest replicas a scale-down may leave a role, and why ('' when nothing holds it): every replica
    while it is saturated (at least SATURATED_WAITING requests waiting per replica), else as many as carry
    its queue at its target, without the tolerance.

    NOTE: this bounds scale-downs only; the queue targets still size scale-ups as `_recommend` says (with
    drain sizing, prefill's queue target yields to the measured rate). A token rate learned while a
    replica had the machine to itself once took the demo's prefill 2 -> 1 with 37 requests waiting
    ("TokenRateBelowCapacity": the rate said the queue drains in a second), and back to 2 one interval
    later. A backlog is evidence the replicas do not keep up, whatever the rate says.
    """
    target = spec.target_queue(role)
    if current > 0 and m.waiting >= SATURATED_WAITING * current:
        return current, f"{m.waiting:g} requests waiting on {current} replicas (saturated)"
    if role == "prefill":
        need, what = m.waiting / target, f"{m.waiting:g} waiting requests"
        token_target = spec.roles()[role].target_prompt_tokens_per_replica
        if token_target and m.prompt_tokens_waiting and m.prompt_tokens_waiting / token_target > need:
            need, what = m.prompt_tokens_waiting / token_target, f"{m.prompt_tokens_waiting:g} waiting prompt tokens"
    else:
        need, what = (m.running + m.waiting) / target, f"{m.running + m.waiting:g} running+waiting requests"
    floor = min(current, max(0, math.ceil(need - _EPS)))
    if floor == 0:
        return 0, ""
    return floor, f"{what} need {floor} replicas at the target ({target:g}/replica)"


def _hold_for_queue(d: _Draft, floor: int, why: str, max_replicas: int) -> None:
    """The last stage: no later stage (the ratio bounds) shrinks a role below its queue floor; maxReplicas still
    does (the spec's own shrink)."""
    keep = min(floor, max_replicas)
    if d.desired < d.current and d.desired < keep:
        d.set(keep, REQUESTS_WAITING if keep == d.current else d.reason, f"{d.message}; held at {keep}: {why}")


def queue_growth(last: tuple[float, float] | None, now: float, need: float, interval: float) -> float:
    """How much a role's need (replicas' worth of queue) grew per interval since the last decision; 0 if it shrank.

    NOTE: used only in a surge (the queue asks for SURGE times the replicas that run). A replica asked
    for now serves one start-up time later at the earliest, by when a growing queue is larger still;
    sizing for the next interval's queue takes one step of the chase off. It never starts a scale-up by
    itself, and a gap of more than three intervals voids it.
    """
    if last is None or not 0 < now - last[0] <= 3 * interval:
        return 0.0
    return max(0.0, (need - last[1]) / (now - last[0]) * interval)


def prefill_backlog(prefill_waiting: float, prefill_replicas: int, prefill_target: float, tolerance: float) -> float:
    """Requests waiting at prefill beyond what its replicas tolerate: work about to reach decode.

    NOTE: decode counts this surge before it arrives. A per-role scaler sees it only after prefill has
    drained it into decode's queue, one interval (plus replica start-up) too late; at prefill's target
    the term is zero, so it adds nothing in steady state.
    """
    return max(0.0, prefill_waiting - (1.0 + tolerance) * prefill_target * prefill_replicas)


def _history(
    state: ScalerState, recommended: Mapping[str, int], now: float, keep: float
) -> dict[str, tuple[tuple[float, int], ...]]:
    """Each role's recommendations within the longest window, with this interval's appended."""
    out = {}
    for role, rec in recommended.items():
        past = tuple((t, n) for t, n in state.recommendations.get(role, ()) if now - t < keep and t < now)
        out[role] = past + ((now, rec),)
    return out


def _stabilize(
    d: _Draft, history: tuple[tuple[float, int], ...], now: float, up_window: float, down_window: float, since: float
) -> None:
    """Scale up to the lowest recommendation of the up window, down to the highest of the down window.

    NOTE: a role watched for less than the down window (a fresh state, e.g. after an operator restart
    that lost it) counts its current size as recommended: nothing shrinks on a partial view.
    """
    if d.desired > d.current:
        floor = min(n for t, n in history if t == now or now - t < up_window)
        if floor <= d.current:
            d.set(
                d.current,
                SCALE_UP_STABILIZING,
                f"{d.message}; holding {d.current}: a recommendation in the last {up_window:g}s was {floor}",
            )
        elif floor < d.desired:
            d.set(floor, d.reason, f"{d.message}; stabilized to {floor} over {up_window:g}s")
    elif d.desired < d.current:
        ceiling = max(n for t, n in history if t == now or now - t < down_window)
        if now - since < down_window:
            d.set(
                d.current,
                SCALE_DOWN_STABILIZING,
                f"{d.message}; holding {d.current}: watched for {now - since:.0f}s of the {down_window:g}s down window",
            )
        elif ceiling >= d.current:
            d.set(
                d.current,
                SCALE_DOWN_STABILIZING,
                f"{d.message}; holding {d.current}: the highest recommendation in the last {down_window:g}s "
                f"was {ceiling}",
            )
        elif ceiling > d.desired:
            d.set(ceiling, d.reason, f"{d.message}; stabilized to {ceiling} over {down_window:g}s")


def _grace(d: _Draft, last_up: float | None, now: float, delay: float) -> None:
    if d.desired < d.current and last_up is not None and now - last_up < delay:
        d.set(
            d.current,
            SCALE_DOWN_DELAYED,
            f"{d.message}; holding {d.current}: scaled up {now - last_up:.0f}s ago, "
            f"scaleDownDelayAfterScaleUp is {delay:g}s",
        )


def _step(d: _Draft, max_up: int, max_down: int) -> None:
    if d.desired > d.current + max_up:
        d.set(d.current + max_up, d.reason, f"{d.message}; +{max_up} this interval (maxScaleUpStep)")
    elif d.desired < d.current - max_down:
        d.set(d.current - max_down, d.reason, f"{d.message}; -{max_down} this interval (maxScaleDownStep)")


def _bounds(d: _Draft, lo: int, hi: int) -> None:
    if d.desired < lo:
        d.set(lo, MIN_REPLICAS, f"{d.message}; raised to minReplicas {lo}")
    elif d.desired > hi:
        d.set(hi, MAX_REPLICAS, f"{d.message}; capped at maxReplicas {hi}")


def _capacity(d: _Draft, cap: int | None) -> None:
    """Never plan beyond free accelerators; a shortage never shrinks what already runs."""
    if cap is not None and d.desired > cap and d.desired > d.current:
        limit = max(cap, d.current)
        d.set(limit, SCALING_LIMITED, f"{d.message}; only {limit} placeable on free accelerators (asked {d.desired})")


def _ratio(
    p: _Draft, d: _Draft, spec: InferenceDeploymentSpec, capacity: Mapping[str, int], lo: float, hi: float
) -> None:
    """Keep prefill/decode within [lo, hi]: grow the smaller side when it may, else shrink the larger."""
    roles = spec.roles()

    def ceiling(role: str, draft: _Draft) -> int:
        cap = capacity.get(role)
        top = roles[role].max_replicas if cap is None else min(roles[role].max_replicas, cap)
        return max(top, draft.desired)

    before = f"{p.desired}:{d.desired}"
    if p.desired > hi * d.desired + _EPS:
        need = math.ceil(p.desired / hi - _EPS)
        grown = min(need, ceiling("decode", d))
        if grown > d.desired:
            d.set(
                grown,
                RATIO_BOUND,
                f"prefill:decode {before} above pdRatio.max {hi:g}; decode raised to {grown} "
                f"(queue alone: {d.message})",
            )
        if p.desired > hi * d.desired + _EPS:
            shrunk = max(math.floor(hi * d.desired + _EPS), roles["prefill"].min_replicas)
            p.set(
                shrunk,
                RATIO_BOUND,
                f"prefill:decode {before} above pdRatio.max {hi:g} and decode cannot grow "
                f"past {d.desired}; prefill lowered to {shrunk} (queue alone: {p.message})",
            )
    elif p.desired < lo * d.desired - _EPS:
        need = math.ceil(lo * d.desired - _EPS)
        grown = min(need, ceiling("prefill", p))
        if grown > p.desired:
            p.set(
                grown,
                RATIO_BOUND,
                f"prefill:decode {before} below pdRatio.min {lo:g}; prefill raised to {grown} "
                f"(queue alone: {p.message})",
            )
        if p.desired < lo * d.desired - _EPS:
            shrunk = max(math.floor(p.desired / lo + _EPS), roles["decode"].min_replicas)
            d.set(
                shrunk,
                RATIO_BOUND,
                f"prefill:decode {before} below pdRatio.min {lo:g} and prefill cannot grow "
                f"past {p.desired}; decode lowered to {shrunk} (queue alone: {d.message})",
            )


def _finish(
    drafts: Mapping[str, _Draft],
    state: ScalerState,
    now: float,
    record: Mapping[str, tuple[tuple[float, int], ...]] | None,
    needs: Mapping[str, float] | None,
    rates: Mapping[str, TokenRate] | None,
) -> tuple[dict[str, ScalingDecision], ScalerState]:
    decisions = {}
    for role, d in drafts.items():
        direction: Direction = "up" if d.desired > d.current else "down" if d.desired < d.current else "hold"
        decisions[role] = ScalingDecision(role, d.current, d.desired, direction, d.reason, d.message)
    ups = {role: now for role, dec in decisions.items() if dec.direction == "up"}
    watched = {role: state.watching_since.get(role, now) for role in (record or {})}
    new_state = replace(
        state,
        watching_since={**state.watching_since, **watched},
        last_need={**state.last_need, **{role: (now, need) for role, need in (needs or {}).items()}},
        replicas={**state.replicas, **{role: dec.desired for role, dec in decisions.items()}},
        recommendations=dict(record) if record is not None else state.recommendations,
        last_scale_up={**state.last_scale_up, **ups},
        throughput={
            **state.throughput,
            **{role: r.per_class[WHOLE_ROLE] for role, r in (rates or {}).items() if WHOLE_ROLE in r.per_class},
        },
        samples={
            **{role: hist for role, hist in state.samples.items() if role not in (rates or {})},
            **{role: r.samples[WHOLE_ROLE] for role, r in (rates or {}).items() if WHOLE_ROLE in r.samples},
        },
        class_throughput={
            **state.class_throughput,
            **{
                role: {k: v for k, v in r.per_class.items() if k != WHOLE_ROLE}
                for role, r in (rates or {}).items()
                if len(r.per_class) > (WHOLE_ROLE in r.per_class)
            },
        },
        class_samples={
            **{role: by_class for role, by_class in state.class_samples.items() if role not in (rates or {})},
            **{
                role: {k: v for k, v in r.samples.items() if k != WHOLE_ROLE}
                for role, r in (rates or {}).items()
                if len(r.samples) > (WHOLE_ROLE in r.samples)
            },
        },
        last_queue={
            **state.last_queue,
            **{role: (now, r.queued) for role, r in (rates or {}).items() if r.queued is not None},
        },
    )
    return decisions, new_state


# --- what the operator shows ------------------------------------------------------------------------


def pd_ratio(decisions: Mapping[str, ScalingDecision]) -> float | None:
    """Desired prefill / decode replicas; None when colocated or decode is at zero."""
    if "prefill" not in decisions or "decode" not in decisions or decisions["decode"].desired == 0:
        return None
    return decisions["prefill"].desired / decisions["decode"].desired


def ratio_text(decisions: Mapping[str, ScalingDecision]) -> str:
    """status.pdRatio: desired prefill:decode in lowest terms ('1:2'); '-' when colocated."""
    if "prefill" not in decisions or "decode" not in decisions:
        return "-"
    p, d = decisions["prefill"].desired, decisions["decode"].desired
    g = math.gcd(p, d) or 1
    return f"{p // g}:{d // g}"


def headline(decisions: Mapping[str, ScalingDecision]) -> ScalingDecision:
    """The decision worth reporting: a change if any, else a hold that needs attention, else the first."""
    ordered = list(decisions.values())
    assert ordered, "no decisions"
    for d in ordered:
        if d.direction != "hold":
            return d
    for d in ordered:
        if d.reason in (METRICS_UNAVAILABLE, SCALING_LIMITED):
            return d
    return ordered[0]


def status_decision(decisions: Mapping[str, ScalingDecision], now: float) -> ScalingDecisionStatus:
    """status.lastScalingDecision for this round."""
    d = headline(decisions)
    return ScalingDecisionStatus(
        time=dt.datetime.fromtimestamp(now, dt.timezone.utc),
        role=d.role,  # type: ignore[arg-type]
        from_replicas=d.current,
        to_replicas=d.desired,
        reason=d.reason,
        message=d.message[:4096],
    )


def conditions(decisions: Mapping[str, ScalingDecision], now: float, generation: int | None = None) -> list[Condition]:
    """MetricsAvailable and ScalingLimited for status.conditions (merge with `set_condition`)."""
    at = dt.datetime.fromtimestamp(now, dt.timezone.utc)
    unavailable = [d for d in decisions.values() if d.reason == METRICS_UNAVAILABLE]
    limited = [d for d in decisions.values() if d.reason == SCALING_LIMITED]
    if unavailable:
        metrics = Condition(
            type="MetricsAvailable",
            status="False",
            reason=METRICS_UNAVAILABLE,
            message=unavailable[0].message,
            last_transition_time=at,
            observed_generation=generation,
        )
    elif all(d.reason == AUTOSCALING_DISABLED for d in decisions.values()):
        metrics = Condition(
            type="MetricsAvailable",
            status="Unknown",
            reason=AUTOSCALING_DISABLED,
            message="autoscaling is disabled; metrics are not read",
            last_transition_time=at,
            observed_generation=generation,
        )
    else:
        metrics = Condition(
            type="MetricsAvailable",
            status="True",
            reason="MetricsFresh",
            message="queue metrics of every role are fresh",
            last_transition_time=at,
            observed_generation=generation,
        )
    scaling = (
        Condition(
            type="ScalingLimited",
            status="True",
            reason=SCALING_LIMITED,
            message="; ".join(f"{d.role}: {d.message}" for d in limited),
            last_transition_time=at,
            observed_generation=generation,
        )
        if limited
        else Condition(
            type="ScalingLimited",
            status="False",
            reason="CapacityAvailable",
            message="every role fits on free accelerators",
            last_transition_time=at,
            observed_generation=generation,
        )
    )
    return [metrics, scaling]
