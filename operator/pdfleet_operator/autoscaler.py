"""The autoscaler's pure decision: desired replicas per role from queue metrics and token rates; called by the operator's timer, `pdfleet up`, the simulator and the bench."""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from pdfleet_operator.api.inference_deployment import InferenceDeploymentSpec, ScalingDecisionStatus
from pdfleet_operator.api.meta import Condition, parse_duration
from pdfleet_operator.metric_names import RATE_WINDOW_S
from pdfleet_operator.metrics_snapshot import MetricsSnapshot, RoleMetrics

Direction = Literal["up", "down", "hold"]

# Machine reasons (ScalingDecision.reason, status.lastScalingDecision.reason, the metric's `reason` label).
QUEUE_ABOVE_TARGET = "QueueAboveTarget"
QUEUE_BELOW_TARGET = "QueueBelowTarget"
PREFILL_BACKLOG = "PrefillBacklog"            # decode grown ahead of work still queued at prefill
QUEUE_GROWING = "QueueGrowing"                # sized for the queue expected at the next interval
TOKEN_RATE_ABOVE_CAPACITY = "TokenRateAboveCapacity"  # token arrivals need more than the replicas serve
TOKEN_RATE_BELOW_CAPACITY = "TokenRateBelowCapacity"  # fewer replicas serve the token arrivals (queues empty)
WITHIN_TOLERANCE = "WithinTolerance"
SCALE_UP_STABILIZING = "ScaleUpStabilizing"
SCALE_DOWN_STABILIZING = "ScaleDownStabilizing"
SCALE_DOWN_DELAYED = "ScaleDownDelayed"       # grace period after a scale-up of the same role
MIN_REPLICAS = "MinReplicas"
MAX_REPLICAS = "MaxReplicas"
RATIO_BOUND = "RatioBound"
SCALING_LIMITED = "ScalingLimited"            # not enough free accelerators for what the queue asks
METRICS_UNAVAILABLE = "MetricsUnavailable"
AUTOSCALING_DISABLED = "AutoscalingDisabled"

REASONS = (QUEUE_ABOVE_TARGET, QUEUE_BELOW_TARGET, PREFILL_BACKLOG, QUEUE_GROWING, TOKEN_RATE_ABOVE_CAPACITY,
           TOKEN_RATE_BELOW_CAPACITY, WITHIN_TOLERANCE, SCALE_UP_STABILIZING, SCALE_DOWN_STABILIZING, SCALE_DOWN_DELAYED, MIN_REPLICAS, MAX_REPLICAS, RATIO_BOUND, SCALING_LIMITED,
           METRICS_UNAVAILABLE, AUTOSCALING_DISABLED)

_EPS = 1e-9
# The queue trend applies only to a surge: a queue at least this many times what the replicas carry at
# target. Noise of +-30% around target never gets there.
SURGE = 1.5
# The token counter each role's throughput is measured in (RoleMetrics field of its rate). A colocated
# replica spends its steps on both kinds, so no single rate measures it: it scales on its queue only.
SERVED_TOKENS = {"prefill": "prompt_tokens_rate", "decode": "generation_tokens_rate"}
# Learned per-replica throughput follows new saturated readings at this weight (older ones decay).
THROUGHPUT_WEIGHT = 0.5
# The class name under which a role is learned as a whole: a source that cannot tell its replicas'
# AcceleratorClasses apart (no `pdfleet_accelerator` label), and state written before classes were.
WHOLE_ROLE = ""
# A class is saturated (its served rate is what its replicas can serve) while at least this many
# requests per replica wait on it.
# NOTE: not "any request waiting": a request that arrives during an engine step waits for the next
# one, so a scrape catches a few waiting on replicas with room to spare (the simulated fleet's decode
# pool, at ~10 running per replica, showed some at most scrapes); read as saturation, that taught a
# throughput of what arrived, not what the replicas serve. A full engine builds a backlog of more.
SATURATED_WAITING = 1.0
# Decode also needs its room used up: KV usage at least this, or running sequences at least
# SATURATED_SEATS of engine.maxNumSeqs per replica. (When the source has no KV usage, waiting decides.)
# NOTE: in a disaggregated pool a request waits on decode while its KV is pulled from prefill, so a
# burst of hand-offs looks like a backlog on replicas with most of their KV free. The simulated mixed
# fleet learned Hygon decode at 658 tokens/s per replica from such a moment of its cold start (KV 10%
# used), never queued again, and the token rate then kept 2-3x the replicas the queues needed.
SATURATED_KV = 0.8
SATURATED_SEATS = 0.9
# The token rate sizes a role to run at this share of its saturated throughput: the headroom a burst
# meets before the replicas it makes the autoscaler ask for are ready.
# It is the spec's `autoscaling.targetUtilization` (default below) unless a Policy overrides it; the
# tolerance still applies on top, as the dead band. `bench/autoscaler.py --utilization` sweeps it: on
# the bursty trace (10 seeds, with the rate trend) the under-provisioning reduction is 0.45 at 0.65,
# 0.39 at 0.70, 0.35 at 0.72 and 0.16 at 0.91 (= 1 / (1 + tolerance)), at 0.87-0.92 of the baseline's
# replica-hours throughout.
TARGET_UTILIZATION = 0.7
# The rate trend: a role's served token rate that rose at each of the last TREND_INTERVALS decisions, by
# at least SURGE_RISE of where it stood, with the same replicas serving, is a surge of arrivals; the
# role is then sized for the rate extrapolated TREND_HORIZON_S past now, plus the half rate window the
# 1-minute rate lags the arrivals by (`surge_growth`, `arrival_trend`).
# NOTE: SURGE_RISE is about three standard deviations of a 1-minute rate's 30 s change at a few
# requests per second (the bench's 4 req/s of 600-1500-token prompts); lower, noise fires it where
# nothing surges (bench, 10 seeds: long-output 3.36 replica-hours at 0.25, 3.57 at 0.2, 3.21 without
# the trend; noisy-steady 1.6 direction changes at 0.25, 2.2 at 0.2).
SURGE_RISE = 0.25
TREND_INTERVALS = 2
# About a replica's start-up plus one interval: when the replicas asked for now serve, and until the
# next decision can add more. A fleet whose replicas start slower gains from a longer one.
TREND_HORIZON_S = 60.0


@dataclass(frozen=True)
class Policy:
    """Which mechanisms beyond one HPA per role run; the bench switches them off to measure each."""

    prefill_lookahead: bool = True   # decode counts requests queued at prefill beyond its tolerance
    queue_trend: bool = True         # a queue that grew since the last interval is sized for the next one
    token_rate: bool = True          # also size prefill/decode for their token arrival rate (`rate_need`)
    utilization: float | None = None  # the token rate's target share of saturated throughput; None: the spec's
    ratio_bounds: bool = True        # spec.autoscaling.pdRatio
    rate_trend: bool = True          # with token_rate: in a surge, size for the rate when new replicas serve


PDFLEET = Policy()
# Each role on its own queue, like one HPA per role (same targets, tolerance, windows, steps, bounds).
PER_ROLE = Policy(prefill_lookahead=False, queue_trend=False, token_rate=False, ratio_bounds=False, rate_trend=False)


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


@dataclass(frozen=True)
class ScalerState:
    """What the autoscaler remembers between intervals; JSON-serializable (an annotation or memory).

    `replicas` is the size last decided per role; `recommendations` the (time, replicas) history the
    stabilization windows look back over; `last_scale_up` when each role last grew (grace period);
    `watching_since` when the autoscaler first saw each role's metrics; `last_need` the (time,
    replicas' worth) of each role's own queue at the last decision (the queue trend). For the token
    rate: `throughput` the tokens/s one replica of each role was seen to serve when saturated;
    `samples` the (time, replicas reporting, saturated) of each role at the decisions that cover the
    last rate window (what the rate was served by); `last_queue` the (time, tokens) queued at the
    last decision (the arrival rate counts the queue's growth); `generation_per_prompt` the tokens
    decode generates per prompt token prefill serves, learned while neither role has requests waiting
    (decode's look-ahead by token rate); `rate_history` the (time, tokens/s served, replicas reporting)
    of each role at the decisions over the last two rate windows (the rate trend).

    `throughput` and `samples` see a role as one class (`WHOLE_ROLE`): what a source without the
    per-class breakdown gives, and all that state written before the breakdown existed holds.
    `class_throughput` and `class_samples` are the same per AcceleratorClass (role -> class -> ...):
    a pool spread over classes of different speed has no single per-replica throughput.
    """

    replicas: Mapping[str, int] = field(default_factory=dict)
    recommendations: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    last_scale_up: Mapping[str, float] = field(default_factory=dict)
    watching_since: Mapping[str, float] = field(default_factory=dict)
    last_need: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    throughput: Mapping[str, float] = field(default_factory=dict)
    samples: Mapping[str, tuple[tuple[float, int, bool], ...]] = field(default_factory=dict)
    last_queue: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    generation_per_prompt: float | None = None
    class_throughput: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    class_samples: Mapping[str, Mapping[str, tuple[tuple[float, int, bool], ...]]] = field(default_factory=dict)
    rate_history: Mapping[str, tuple[tuple[float, float, int], ...]] = field(default_factory=dict)

    @classmethod
    def initial(cls, spec: InferenceDeploymentSpec, replicas: Mapping[str, int] | None = None) -> "ScalerState":
        """A fresh state at the given sizes (what the Deployments run now), or each role's minReplicas."""
        sizes = {role: rs.min_replicas for role, rs in spec.roles().items()}
        sizes.update({role: int(n) for role, n in (replicas or {}).items() if role in sizes})
        return cls(replicas=sizes)

    def to_json(self) -> str:
        return json.dumps({
            "replicas": dict(self.replicas),
            "recommendations": {role: [list(p) for p in hist] for role, hist in self.recommendations.items()},
            "lastScaleUp": dict(self.last_scale_up),
            "watchingSince": dict(self.watching_since),
            "lastNeed": {role: list(p) for role, p in self.last_need.items()},
            "throughput": dict(self.throughput),
            "samples": {role: [list(x) for x in hist] for role, hist in self.samples.items()},
            "lastQueue": {role: list(p) for role, p in self.last_queue.items()},
            "generationPerPrompt": self.generation_per_prompt,
            "classThroughput": {role: dict(by_class) for role, by_class in self.class_throughput.items()},
            "classSamples": {role: {cls: [list(x) for x in hist] for cls, hist in by_class.items()}
                             for role, by_class in self.class_samples.items()},
            "rateHistory": {role: [list(p) for p in hist] for role, hist in self.rate_history.items()},
        }, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "ScalerState":
        """Parse `to_json` output; ValueError naming the problem when it is not one.

        NOTE: the token-rate keys may be absent (a state written before they existed): that is a
        throughput not learned yet, not an error. State written before the per-class keys holds one
        number per role in `throughput`: it loads as the role learned as one class (`WHOLE_ROLE`).
        """
        try:
            raw = json.loads(text)
            return cls(
                replicas={str(r): int(n) for r, n in raw["replicas"].items()},
                recommendations={str(r): tuple((float(t), int(n)) for t, n in hist)
                                 for r, hist in raw["recommendations"].items()},
                last_scale_up={str(r): float(t) for r, t in raw["lastScaleUp"].items()},
                watching_since={str(r): float(t) for r, t in raw["watchingSince"].items()},
                last_need={str(r): (float(t), float(n)) for r, (t, n) in raw["lastNeed"].items()},
                throughput={str(r): float(c) for r, c in raw.get("throughput", {}).items()},
                samples={str(r): tuple((float(t), int(n), bool(sat)) for t, n, sat in hist)
                         for r, hist in raw.get("samples", {}).items()},
                last_queue={str(r): (float(t), float(q)) for r, (t, q) in raw.get("lastQueue", {}).items()},
                generation_per_prompt=(None if raw.get("generationPerPrompt") is None
                                       else float(raw["generationPerPrompt"])),
                class_throughput={str(r): {str(k): float(c) for k, c in by_class.items()}
                                  for r, by_class in raw.get("classThroughput", {}).items()},
                class_samples={str(r): {str(k): tuple((float(t), int(n), bool(sat)) for t, n, sat in hist)
                                        for k, hist in by_class.items()}
                               for r, by_class in raw.get("classSamples", {}).items()},
                rate_history={str(r): tuple((float(t), float(v), int(n)) for t, v, n in hist)
                              for r, hist in raw.get("rateHistory", {}).items()},
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"invalid autoscaler state {text[:200]!r}: {exc}") from exc


Samples = tuple[tuple[float, int, bool], ...]  # (time, replicas reporting, saturated) per decision


@dataclass(frozen=True)
class TokenRate:
    """One role's token throughput at this decision: what the `token_rate` policy sizes it by.

    Per-replica throughput is learned per AcceleratorClass (`WHOLE_ROLE` when the source has no
    per-class breakdown); a class not learned yet is assumed to serve like the learned replicas.
    """

    served: float | None       # tokens/s served over the rate window (None: the engine does not export it)
    queued: float | None       # tokens waiting to be served (prefill's prompt tokens; None where unknown)
    per_class: Mapping[str, float]   # class -> tokens/s one replica serves when saturated (learned ones only)
    replicas: Mapping[str, int]      # class -> replicas reporting now
    samples: Mapping[str, Samples]   # class -> its samples over the rate window
    steady: bool = False       # no request waiting at this decision nor at the one before
    ahead: float | None = None  # tokens/s on their way (decode: what prefill's arrivals will generate)
    growth: float = 0.0        # tokens/s a surge of arrivals adds by when new replicas serve (`arrival_trend`)

    @property
    def per_replica(self) -> float | None:
        """Tokens/s one replica of an unlearned class is assumed to serve: the mean over the replicas
        reporting now whose class is learned, else over the learned classes (None: none learned)."""
        named = {k: v for k, v in self.per_class.items() if k != WHOLE_ROLE}
        if not named:
            return self.per_class.get(WHOLE_ROLE)
        weights = {k: self.replicas[k] for k in named if self.replicas.get(k)}
        if weights:
            return sum(named[k] * n for k, n in weights.items()) / sum(weights.values())
        return sum(named.values()) / len(named)

    def slots(self, order: Sequence[tuple[str, int]] | None) -> tuple[float, ...]:
        """Tokens/s of each replica the role would run, in the order placement adds them.

        `order` is (AcceleratorClass, most replicas placeable on it) in placement's order: a role at
        N replicas runs the first N of these slots. Without it (or without a learned class in it)
        every slot serves the mean of the replicas now, which, summed over them, is what they serve.
        """
        default = self.per_replica
        assert default is not None, "slots of a role with no learned throughput"
        if not order or not any(cls in self.per_class for cls, _ in order):
            return (default,)
        return tuple(self.per_class.get(cls, default) for cls, cap in order for _ in range(cap))


@dataclass
class _Draft:
    """A role's decision while the chain of policies works on it."""

    current: int
    desired: int
    reason: str
    message: str

    def set(self, desired: int, reason: str, message: str) -> None:
        self.desired, self.reason, self.message = desired, reason, message


def decide(spec: InferenceDeploymentSpec, state: ScalerState, snapshot: MetricsSnapshot, now: float,
           capacity: Mapping[str, int], current: Mapping[str, int] | None = None, policy: Policy = PDFLEET,
           order: Mapping[str, Sequence[tuple[str, int]]] | None = None,
           ) -> tuple[dict[str, ScalingDecision], ScalerState]:
    """Desired replicas per role for this interval, and the state to pass to the next call.

    `capacity` is the most replicas of each role placeable on free accelerators (placement's
    `FleetPlan.capacity(role)`; a role absent from it is unbounded). `current` overrides the sizes in
    `state` (what the Deployments ask for now). `order` is, per role, (AcceleratorClass, most replicas
    placeable on it) in the order placement fills them (`FleetPlan.class_capacity(role)`): the token
    rate sizes a role by the learned throughput of the classes its next replicas land on. The chain: queue recommendation with tolerance ->
    stabilization windows -> grace period after a scale-up -> step limits -> min/max -> capacity ->
    P:D ratio bounds; the reason is that of the last policy that changed the number.

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
        drafts = {role: _Draft(cur[role], rs.min_replicas, AUTOSCALING_DISABLED,
                               f"autoscaling is disabled: running minReplicas ({rs.min_replicas})")
                  for role, rs in roles.items()}
        return _finish(drafts, state, now, record=None, needs=None, rates=None)

    problem = metrics_problem(snapshot, roles, now, parse_duration(auto.metrics_max_age))
    if problem:
        drafts = {role: _Draft(cur[role], cur[role], METRICS_UNAVAILABLE, f"holding {cur[role]} replicas: {problem}")
                  for role in roles}
        return _finish(drafts, state, now, record=None, needs=None, rates=None)

    rates = ({role: observe_rate(role, snapshot.roles[role], state, now, max_num_seqs=spec.engine.max_num_seqs)
              for role in roles if role in SERVED_TOKENS}
             if policy.token_rate else {})
    rate_history = {role: _recent(state.rate_history.get(role, ()), now) + ((now, r.served, sum(r.replicas.values())),)
                    for role, r in rates.items() if r.served is not None}
    if policy.rate_trend:
        for role in rate_history:
            rates[role] = replace(rates[role], growth=surge_growth(rate_history[role], now, spec.interval_seconds()))
    ratio = state.generation_per_prompt
    if "prefill" in rates and "decode" in rates:
        ratio = generation_ratio(ratio, rates["prefill"], rates["decode"])
        p = rates["prefill"]
        if ratio is not None and p.served is not None:
            arriving = arrival_rate(p.served, p.queued, state.last_queue.get("prefill"), now, spec.interval_seconds())
            rates["decode"] = replace(rates["decode"], ahead=ratio * (arriving + p.growth))
    recommended: dict[str, int] = {}
    needs: dict[str, float] = {}
    drafts = {}
    for role in roles:
        rec, reason, message, needs[role] = _recommend(spec, role, snapshot.roles, cur, policy,
                                                        state.last_need.get(role), now, rates.get(role),
                                                        state.last_queue.get(role), (order or {}).get(role))
        recommended[role] = rec
        drafts[role] = _Draft(cur[role], rec, reason, message)

    history = _history(state, recommended, now, max(parse_duration(auto.scale_up_stabilization),
                                                    parse_duration(auto.scale_down_stabilization)))
    for role, draft in drafts.items():
        rs = roles[role]
        _stabilize(draft, history[role], now, parse_duration(auto.scale_up_stabilization),
                   parse_duration(auto.scale_down_stabilization), state.watching_since.get(role, now))
        _grace(draft, state.last_scale_up.get(role), now, parse_duration(auto.scale_down_delay_after_scale_up))
        _step(draft, auto.max_scale_up_step, auto.max_scale_down_step)
        _bounds(draft, rs.min_replicas, rs.max_replicas)
        _capacity(draft, capacity.get(role))
    if policy.ratio_bounds and "prefill" in drafts and "decode" in drafts:
        _ratio(drafts["prefill"], drafts["decode"], spec, capacity, auto.pd_ratio.min, auto.pd_ratio.max)
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


def _recommend(spec: InferenceDeploymentSpec, role: str, metrics: Mapping[str, RoleMetrics],
               cur: Mapping[str, int], policy: Policy, last: tuple[float, float] | None, now: float,
               rate: TokenRate | None = None, last_queue: tuple[float, float] | None = None,
               order: Sequence[tuple[str, int]] | None = None) -> tuple[int, str, str, float]:
    """Replicas the role's queue asks for, HPA-style: ceil(load / target), unchanged within tolerance.

    With a token rate (`policy.token_rate`), the larger of that and what the token arrival rate asks
    for (`tokens_needed` over the throughput of the replicas placement would run, `replicas_for`). Also returns the role's own need (replicas' worth of its queue) for the next
    interval's trend.
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
            lookahead = prefill_backlog(metrics["prefill"].waiting, cur.get("prefill", 0),
                                        spec.target_queue("prefill"), tolerance)
        need = load / target
        what = f"{load:g} running+waiting requests (target {target:g}/replica)"
        if lookahead:
            what += f" + {lookahead:g} requests queued at prefill beyond its target"
    own = need
    need += lookahead / target
    queue_need = need
    by_rate = False
    if rate is not None and rate.served is not None and rate.per_replica:
        arriving = arrival_rate(rate.served, rate.queued, last_queue, now, spec.interval_seconds())
        if rate.growth > 0:
            what += (f"; arrivals surging: {arriving:.0f} tokens/s + {rate.growth:.0f} expected by when new "
                     "replicas serve")
            arriving += rate.growth
        if rate.ahead is not None and rate.ahead > arriving:
            what += f"; {rate.ahead:.0f} tokens/s on their way from prefill's arrivals"
            arriving = rate.ahead
        utilization = policy.utilization if policy.utilization is not None else spec.autoscaling.target_utilization
        token_need = replicas_for(tokens_needed(arriving, rate.queued, utilization), rate.slots(order))
        by_rate = token_need > need
        classes = sorted((k, v) for k, v in rate.per_class.items() if k != WHOLE_ROLE)
        what += (f"; {arriving:.0f} tokens/s arriving" + (f" + {rate.queued:g} queued" if rate.queued else "")
                 + f" at {rate.per_replica:.0f} tokens/s per saturated replica"
                 + (f" ({', '.join(f'{k} {v:.0f}' for k, v in classes)})" if len(classes) > 1 else "")
                 + f": {token_need:.2f} replicas' worth")
        need = max(need, token_need)

    if n > 0 and abs(need / n - 1.0) <= tolerance:
        return n, WITHIN_TOLERANCE, f"{what}: {need:.2f} replicas' worth is within {tolerance:g} of {n}", own
    rec = max(0, math.ceil(need - _EPS))
    if rec > n:
        reason = (TOKEN_RATE_ABOVE_CAPACITY if by_rate else
                  PREFILL_BACKLOG if math.ceil(own - _EPS) <= n else QUEUE_ABOVE_TARGET)
        surging = policy.queue_trend and own >= SURGE * max(n, 1)
        growth = queue_growth(last, now, own, spec.interval_seconds()) if surging else 0.0
        ahead = max(0, math.ceil(queue_need + growth - _EPS))
        if ahead > rec:
            return ahead, QUEUE_GROWING, (f"{what}: needs {rec}, and the queue grew by {growth:.2f} replicas' "
                                          f"worth over the last interval: sized for the next, {ahead}"), own
        return rec, reason, f"{what}: needs {rec}", own
    if rec < n:
        return rec, TOKEN_RATE_BELOW_CAPACITY if by_rate else QUEUE_BELOW_TARGET, f"{what}: needs {rec}", own
    return n, WITHIN_TOLERANCE, f"{what}: needs {n}", own


def observe_rate(role: str, m: RoleMetrics, state: ScalerState, now: float, max_num_seqs: int | None = None) -> TokenRate:
    """The role's token rate, queue and learned per-replica throughput of each class, after this snapshot.

    A class is saturated while requests wait on its replicas (its engines run full token budgets or
    full batches). When it was saturated at every decision over the last rate window, the rate it
    served over that window, divided by the replicas that served it (time-weighted), is one replica's
    throughput: the learned value moves THROUGHPUT_WEIGHT of the way toward it. A window that ends
    saturated (this decision and the one before) but began with spare capacity served less than the
    replicas could: it is a lower bound, which raises the learned value when it is higher and otherwise
    says nothing. Windows with requests waiting at neither end say nothing (a replica with spare
    capacity serves what arrives), so the learned value lasts until the next saturation.

    NOTE: per class, not per role: in a pool spread over a slow and a fast class, requests wait on the
    slow replicas while the fast ones have room, and the role's rate divided by all its replicas is
    then what arrives, not what they can serve; learned as the role's throughput it shrinks to the
    demand and the rate asks for 1 / utilization times the replicas, again at every window.
    """
    served = getattr(m, SERVED_TOKENS[role])
    queued = m.prompt_tokens_waiting if role == "prefill" else None
    learned = known_throughput(state, role)
    history = known_samples(state, role)
    parts = class_parts(role, m, max_num_seqs)
    window: dict[str, Samples] = {}
    for cls, (replicas, saturated, rate) in parts.items():
        window[cls] = _window(history.get(cls, ()), now, (now, replicas, saturated))
        per_replica = _learn(learned.get(cls), rate, window[cls], now)
        if per_replica is not None:
            learned[cls] = per_replica
    before = [x for hist in window.values() for x in hist[:-1]]
    last = max((t for t, _, _ in before), default=None)
    steady = last is not None and m.waiting == 0 and not any(sat for t, _, sat in before if t == last)
    return TokenRate(served=served, queued=queued, per_class=learned,
                     replicas={cls: n for cls, (n, _, _) in parts.items()}, samples=window, steady=steady)


def class_parts(role: str, m: RoleMetrics, max_num_seqs: int | None = None) -> dict[str, tuple[int, bool, float | None]]:
    """class -> (replicas reporting, saturated, tokens/s served) of the role; the whole role as one
    class (`WHOLE_ROLE`) when the snapshot has no per-class breakdown or one without the served rate."""
    name = SERVED_TOKENS[role]
    whole = getattr(m, name)
    full = room_used_up(role, m, max_num_seqs)
    if m.classes and (whole is None or all(getattr(c, name) is not None for c in m.classes.values())):
        return {cls: (c.replicas_reporting, full and c.waiting >= SATURATED_WAITING * c.replicas_reporting,
                      getattr(c, name)) for cls, c in m.classes.items()}
    return {WHOLE_ROLE: (m.replicas_reporting, full and m.waiting >= SATURATED_WAITING * m.replicas_reporting, whole)}


def room_used_up(role: str, m: RoleMetrics, max_num_seqs: int | None) -> bool:
    """Whether the role's replicas have no room left that waiting requests could take (see SATURATED_KV).

    NOTE: from the role's mean KV usage and running sequences (the sources have no per-class KV usage):
    in a pool whose one class is full and another idle, the mean can hide the full one; it then learns
    nothing from that window, which keeps the value it had rather than teaching a wrong one.
    """
    if role != "decode" or m.kv_usage is None:
        return True
    if m.kv_usage >= SATURATED_KV:
        return True
    return max_num_seqs is not None and m.running >= SATURATED_SEATS * max_num_seqs * m.replicas_reporting


def known_throughput(state: ScalerState, role: str) -> dict[str, float]:
    """class -> learned tokens/s per replica of the role, the role as a whole under `WHOLE_ROLE`."""
    out = {WHOLE_ROLE: state.throughput[role]} if role in state.throughput else {}
    out.update(state.class_throughput.get(role, {}))
    return out


def known_samples(state: ScalerState, role: str) -> dict[str, Samples]:
    out = {WHOLE_ROLE: state.samples[role]} if role in state.samples else {}
    out.update(state.class_samples.get(role, {}))
    return out


def _window(history: Samples, now: float, latest: tuple[float, int, bool]) -> Samples:
    """The samples covering the rate window ending now, this decision's last."""
    start = now - RATE_WINDOW_S
    past = tuple(x for x in history if x[0] < now)
    # keep the last sample at or before the window's start: it says who served the window's first seconds
    older = [x for x in past if x[0] <= start]
    return tuple(older[-1:]) + tuple(x for x in past if x[0] > start) + (latest,)


def _learn(learned: float | None, served: float | None, samples: Samples, now: float) -> float | None:
    """The learned per-replica throughput after a window's samples (see `observe_rate`)."""
    start = now - RATE_WINDOW_S
    if served is None or len(samples) < 2 or samples[0][0] > start or not (samples[-2][2] and samples[-1][2]):
        return learned
    per_replica = served / served_by(samples, start, now)
    if all(saturated for _, _, saturated in samples):
        return per_replica if learned is None else learned + THROUGHPUT_WEIGHT * (per_replica - learned)
    if learned is None or per_replica > learned:
        return per_replica
    return learned


def served_by(samples: tuple[tuple[float, int, bool], ...], start: float, end: float) -> float:
    """Time-weighted replicas over [start, end], each sample's count holding until the next sample."""
    assert samples and samples[0][0] <= start < end, f"samples {samples[:1]} do not cover [{start}, {end}]"
    total = 0.0
    for (t, n, _), (t_next, _, _) in zip(samples, samples[1:] + ((end, 0, False),)):
        total += n * max(0.0, min(t_next, end) - max(t, start))
    return total / (end - start)


def generation_ratio(previous: float | None, prefill: TokenRate, decode: TokenRate) -> float | None:
    """Tokens decode generates per prompt token prefill serves, moved toward this window's ratio when both
    roles ran with nothing waiting at this decision and the one before (served = arrived on both sides)."""
    if not (prefill.steady and decode.steady) or not prefill.served or decode.served is None:
        return previous
    observed = decode.served / prefill.served
    return observed if previous is None else previous + THROUGHPUT_WEIGHT * (observed - previous)


def arrival_rate(served: float, queued: float | None, last: tuple[float, float] | None, now: float,
                 interval: float) -> float:
    """Tokens/s arriving: those served plus the queue's growth since the last decision (flow conservation).

    NOTE: a saturated role serves at its capacity whatever arrives, so its served rate alone never asks
    for more than it has; the queue's growth is the rest of the arrivals. Without a token queue (decode,
    vLLM prefill), or with a last reading older than three intervals, the served rate stands alone.
    """
    if queued is None or last is None or not 0 < now - last[0] <= 3 * interval:
        return served
    return max(0.0, served + (queued - last[1]) / (now - last[0]))


RateHistory = tuple[tuple[float, float, int], ...]  # (time, tokens/s served, replicas reporting) per decision


def _recent(history: RateHistory, now: float) -> RateHistory:
    return tuple(x for x in history if 0 < now - x[0] <= 2 * RATE_WINDOW_S)


def surge_growth(history: RateHistory, now: float, interval: float) -> float:
    """Tokens/s a role's arrivals will have added by when the replicas asked for now serve: the served
    rate's rise per second (`arrival_trend`) over TREND_HORIZON_S plus the half rate window it lags by;
    0 unless the history reaches back over the rate window of the trend's first reading and the same
    replicas reported at every decision in it (two rate windows).

    NOTE: only then is a rise of the served rate a rise of arrivals. A replica that joins serves the
    backlog of a saturated role (extrapolated, that took the bench's long-output decode to 16 replicas
    for 7 needed); one that leaves takes its counter's series with it, so the role's summed rate dips
    and climbs back over the next window, as Prometheus' `sum(rate(...))` does (with a saturation check
    instead of this one, the simulated fleet scaled 2.5x as often and cost 9% more). A fleet that just
    started, or an operator that lost its state, fills its rate windows from nothing: no surge either.
    With the replicas fixed, a saturated role's rate rises only toward what they can serve, and its
    arrivals rose at least as much.
    """
    if not history or history[0][0] > now - RATE_WINDOW_S - TREND_INTERVALS * interval + _EPS \
            or len({n for _, _, n in history}) > 1:
        return 0.0
    return arrival_trend(tuple((t, v) for t, v, _ in history), now, interval) * (RATE_WINDOW_S / 2 + TREND_HORIZON_S)


def arrival_trend(history: Sequence[tuple[float, float]], now: float, interval: float) -> float:
    """Tokens/s per second a rate grew over the last TREND_INTERVALS decisions (`history`: (time, tokens/s),
    the last at `now`), when it rose at each of them and by at least SURGE_RISE in all; else 0.

    NOTE: a 1-minute rate lags arrivals that ramp by half its window, and replicas asked for now serve
    a start-up later; sizing for the rate now leaves a surge's ramp short for both. Two rises in a row
    and the SURGE_RISE floor keep noise from being extrapolated: a false surge is held for the whole
    scale-down window.
    """
    pts = [x for x in history if now - x[0] <= TREND_INTERVALS * interval + _EPS]
    if len(pts) < TREND_INTERVALS + 1 or pts[-1][0] != now:
        return 0.0
    pts = pts[-(TREND_INTERVALS + 1):]
    (t0, first), (t1, last) = pts[0], pts[-1]
    if first <= 0 or any(b <= a for (_, a), (_, b) in zip(pts, pts[1:])) or last - first < SURGE_RISE * first:
        return 0.0
    return (last - first) / (t1 - t0)


def tokens_needed(arriving: float, queued: float | None, utilization: float,
                  drain_s: float = RATE_WINDOW_S) -> float:
    """Saturated tokens/s a role needs, by Little's law: the arrivals at the target utilization, plus what
    drains the queued tokens within `drain_s` (one rate window by default, so the next window measures
    arrivals rather than backlog)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"tokens_needed: utilization {utilization} must be in (0, 1]")
    return arriving / utilization + (queued or 0.0) / drain_s


def replicas_for(tokens_per_s: float, slots: Sequence[float]) -> float:
    """Replicas' worth that serve `tokens_per_s` at saturation, taking replicas in order from `slots` (the
    tokens/s of each; past the end, more like the last): whole replicas, then a fraction of the next."""
    if not slots or min(slots) <= 0:
        raise ValueError(f"replicas_for: per-replica throughputs {tuple(slots)[:8]} must be > 0")
    need, left = 0.0, max(0.0, tokens_per_s)
    for speed in slots[:-1]:
        if left <= speed:
            return need + left / speed
        need, left = need + 1.0, left - speed
    return need + left / slots[-1]


def rate_need(arriving: float, queued: float | None, per_replica: float, utilization: float,
              drain_s: float = RATE_WINDOW_S) -> float:
    """Replicas' worth of token work for replicas that all serve `per_replica` tokens/s when saturated."""
    if per_replica <= 0 or not 0 < utilization <= 1:
        raise ValueError(f"rate_need: per_replica {per_replica} must be > 0 and utilization {utilization} in (0, 1]")
    return replicas_for(tokens_needed(arriving, queued, utilization, drain_s), (per_replica,))


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


def _history(state: ScalerState, recommended: Mapping[str, int], now: float, keep: float
             ) -> dict[str, tuple[tuple[float, int], ...]]:
    """Each role's recommendations within the longest window, with this interval's appended."""
    out = {}
    for role, rec in recommended.items():
        past = tuple((t, n) for t, n in state.recommendations.get(role, ()) if now - t < keep and t < now)
        out[role] = past + ((now, rec),)
    return out


def _stabilize(d: _Draft, history: tuple[tuple[float, int], ...], now: float, up_window: float,
               down_window: float, since: float) -> None:
    """Scale up to the lowest recommendation of the up window, down to the highest of the down window.

    NOTE: a role watched for less than the down window (a fresh state, e.g. after an operator restart
    that lost it) counts its current size as recommended: nothing shrinks on a partial view.
    """
    if d.desired > d.current:
        floor = min(n for t, n in history if t == now or now - t < up_window)
        if floor <= d.current:
            d.set(d.current, SCALE_UP_STABILIZING,
                  f"{d.message}; holding {d.current}: a recommendation in the last {up_window:g}s was {floor}")
        elif floor < d.desired:
            d.set(floor, d.reason, f"{d.message}; stabilized to {floor} over {up_window:g}s")
    elif d.desired < d.current:
        ceiling = max(n for t, n in history if t == now or now - t < down_window)
        if now - since < down_window:
            d.set(d.current, SCALE_DOWN_STABILIZING,
                  f"{d.message}; holding {d.current}: watched for {now - since:.0f}s of the {down_window:g}s "
                  "down window")
        elif ceiling >= d.current:
            d.set(d.current, SCALE_DOWN_STABILIZING,
                  f"{d.message}; holding {d.current}: the highest recommendation in the last {down_window:g}s "
                  f"was {ceiling}")
        elif ceiling > d.desired:
            d.set(ceiling, d.reason, f"{d.message}; stabilized to {ceiling} over {down_window:g}s")


def _grace(d: _Draft, last_up: float | None, now: float, delay: float) -> None:
    if d.desired < d.current and last_up is not None and now - last_up < delay:
        d.set(d.current, SCALE_DOWN_DELAYED,
              f"{d.message}; holding {d.current}: scaled up {now - last_up:.0f}s ago, "
              f"scaleDownDelayAfterScaleUp is {delay:g}s")


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
        d.set(limit, SCALING_LIMITED,
              f"{d.message}; only {limit} placeable on free accelerators (asked {d.desired})")


def _ratio(p: _Draft, d: _Draft, spec: InferenceDeploymentSpec, capacity: Mapping[str, int],
           lo: float, hi: float) -> None:
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
            d.set(grown, RATIO_BOUND, f"prefill:decode {before} above pdRatio.max {hi:g}; decode raised to {grown} "
                                      f"(queue alone: {d.message})")
        if p.desired > hi * d.desired + _EPS:
            shrunk = max(math.floor(hi * d.desired + _EPS), roles["prefill"].min_replicas)
            p.set(shrunk, RATIO_BOUND, f"prefill:decode {before} above pdRatio.max {hi:g} and decode cannot grow "
                                       f"past {d.desired}; prefill lowered to {shrunk} (queue alone: {p.message})")
    elif p.desired < lo * d.desired - _EPS:
        need = math.ceil(lo * d.desired - _EPS)
        grown = min(need, ceiling("prefill", p))
        if grown > p.desired:
            p.set(grown, RATIO_BOUND, f"prefill:decode {before} below pdRatio.min {lo:g}; prefill raised to {grown} "
                                      f"(queue alone: {p.message})")
        if p.desired < lo * d.desired - _EPS:
            shrunk = max(math.floor(p.desired / lo + _EPS), roles["decode"].min_replicas)
            d.set(shrunk, RATIO_BOUND, f"prefill:decode {before} below pdRatio.min {lo:g} and prefill cannot grow "
                                       f"past {p.desired}; decode lowered to {shrunk} (queue alone: {d.message})")


def _finish(drafts: Mapping[str, _Draft], state: ScalerState, now: float,
            record: Mapping[str, tuple[tuple[float, int], ...]] | None, needs: Mapping[str, float] | None,
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
        throughput={**state.throughput, **{role: r.per_class[WHOLE_ROLE] for role, r in (rates or {}).items()
                                           if WHOLE_ROLE in r.per_class}},
        samples={**{role: hist for role, hist in state.samples.items() if role not in (rates or {})},
                 **{role: r.samples[WHOLE_ROLE] for role, r in (rates or {}).items() if WHOLE_ROLE in r.samples}},
        class_throughput={**state.class_throughput, **{
            role: {k: v for k, v in r.per_class.items() if k != WHOLE_ROLE} for role, r in (rates or {}).items()
            if len(r.per_class) > (WHOLE_ROLE in r.per_class)}},
        class_samples={**{role: by_class for role, by_class in state.class_samples.items() if role not in (rates or {})},
                       **{role: {k: v for k, v in r.samples.items() if k != WHOLE_ROLE}
                          for role, r in (rates or {}).items() if len(r.samples) > (WHOLE_ROLE in r.samples)}},
        last_queue={**state.last_queue, **{role: (now, r.queued) for role, r in (rates or {}).items()
                                           if r.queued is not None}},
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
    return ScalingDecisionStatus(time=dt.datetime.fromtimestamp(now, dt.timezone.utc), role=d.role,  # type: ignore[arg-type]
                                 from_replicas=d.current, to_replicas=d.desired, reason=d.reason,
                                 message=d.message[:4096])


def conditions(decisions: Mapping[str, ScalingDecision], now: float, generation: int | None = None
               ) -> list[Condition]:
    """MetricsAvailable and ScalingLimited for status.conditions (merge with `set_condition`)."""
    at = dt.datetime.fromtimestamp(now, dt.timezone.utc)
    unavailable = [d for d in decisions.values() if d.reason == METRICS_UNAVAILABLE]
    limited = [d for d in decisions.values() if d.reason == SCALING_LIMITED]
    if unavailable:
        metrics = Condition(type="MetricsAvailable", status="False", reason=METRICS_UNAVAILABLE,
                            message=unavailable[0].message, last_transition_time=at, observed_generation=generation)
    elif all(d.reason == AUTOSCALING_DISABLED for d in decisions.values()):
        metrics = Condition(type="MetricsAvailable", status="Unknown", reason=AUTOSCALING_DISABLED,
                            message="autoscaling is disabled; metrics are not read", last_transition_time=at,
                            observed_generation=generation)
    else:
        metrics = Condition(type="MetricsAvailable", status="True", reason="MetricsFresh",
                            message="queue metrics of every role are fresh", last_transition_time=at,
                            observed_generation=generation)
    scaling = (Condition(type="ScalingLimited", status="True", reason=SCALING_LIMITED,
                         message="; ".join(f"{d.role}: {d.message}" for d in limited), last_transition_time=at,
                         observed_generation=generation)
               if limited else
               Condition(type="ScalingLimited", status="False", reason="CapacityAvailable",
                         message="every role fits on free accelerators", last_transition_time=at,
                         observed_generation=generation))
    return [metrics, scaling]
