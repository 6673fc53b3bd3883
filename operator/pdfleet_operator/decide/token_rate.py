"""The autoscaler's token-rate side (pure): per-replica throughput learned per (role, AcceleratorClass) while
saturated, arrival rates and their trend, and the replicas a rate needs; `autoscaler.decide` calls it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pdfleet_operator.decide.metric_names import RATE_WINDOW_S
from pdfleet_operator.decide.metrics_snapshot import RoleMetrics
from pdfleet_operator.decide.scaler_state import Samples, ScalerState

_EPS = 1e-9

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
class TokenRate:
    """One role's token throughput at this decision: what the `token_rate` policy sizes it by.

    Per-replica throughput is learned per AcceleratorClass (`WHOLE_ROLE` when the source has no
    per-class breakdown); a class not learned yet is assumed to serve like the learned replicas.
    """

    served: float | None  # tokens/s served over the rate window (None: the engine does not export it)
    queued: float | None  # tokens waiting to be served (prefill's prompt tokens; None where unknown)
    per_class: Mapping[str, float]  # class -> tokens/s one replica serves when saturated (learned ones only)
    replicas: Mapping[str, int]  # class -> replicas reporting now
    samples: Mapping[str, Samples]  # class -> its samples over the rate window
    steady: bool = False  # no request waiting at this decision nor at the one before
    ahead: float | None = None  # tokens/s on their way (decode: what prefill's arrivals will generate)
    growth: float = 0.0  # tokens/s a surge of arrivals adds by when new replicas serve (`arrival_trend`)
    floor: float | None = None  # the lowest served rate over the scale-down window (`rate_floor`)
    peak: float | None = None  # the highest served rate over the scale-down window (`rate_peak`)

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


def observe_rate(
    role: str, m: RoleMetrics, state: ScalerState, now: float, max_num_seqs: int | None = None
) -> TokenRate:
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
    return TokenRate(
        served=served,
        queued=queued,
        per_class=learned,
        replicas={cls: n for cls, (n, _, _) in parts.items()},
        samples=window,
        steady=steady,
    )


def class_parts(
    role: str, m: RoleMetrics, max_num_seqs: int | None = None
) -> dict[str, tuple[int, bool, float | None]]:
    """class -> (replicas reporting, saturated, tokens/s served) of the role; the whole role as one
    class (`WHOLE_ROLE`) when the snapshot has no per-class breakdown or one without the served rate."""
    name = SERVED_TOKENS[role]
    whole = getattr(m, name)
    full = room_used_up(role, m, max_num_seqs)
    if m.classes and (whole is None or all(getattr(c, name) is not None for c in m.classes.values())):
        return {
            cls: (
                c.replicas_reporting,
                full and c.waiting >= SATURATED_WAITING * c.replicas_reporting,
                getattr(c, name),
            )
            for cls, c in m.classes.items()
        }
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
    if served is None or len(samples) < 2 or not (samples[-2][2] and samples[-1][2]):
        return learned
    if samples[0][0] > start:
        # NOTE: a first guess. Nothing learned yet and saturated at the last two decisions, but watched
        # for less than a rate window (a new deployment, a restarted operator): what the most replicas
        # seen served is a lower bound as long as none left just before; a full window corrects it. Until
        # a first value, the queue targets size the role, and a cold start's backlog took the bench's
        # noisy-steady prefill to 7-11 replicas for 3-4 needed, then down again: a direction change.
        return served / max(n for _, n, _ in samples) if learned is None else learned
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


def arrival_rate(
    served: float, queued: float | None, last: tuple[float, float] | None, now: float, interval: float
) -> float:
    """Tokens/s arriving: those served plus the queue's growth since the last decision (flow conservation).

    NOTE: a saturated role serves at its capacity whatever arrives, so its served rate alone never asks
    for more than it has; the queue's growth is the rest of the arrivals. Without a token queue (decode,
    vLLM prefill), or with a last reading older than three intervals, the served rate stands alone.
    """
    if queued is None or last is None or not 0 < now - last[0] <= 3 * interval:
        return served
    return max(0.0, served + (queued - last[1]) / (now - last[0]))


RateHistory = tuple[tuple[float, float, int], ...]  # (time, tokens/s served, replicas reporting) per decision


def recent(history: RateHistory, now: float, keep: float = 2 * RATE_WINDOW_S) -> RateHistory:
    """The entries of the last `keep` seconds before now."""
    return tuple(x for x in history if 0 < now - x[0] <= keep)


def rate_floor(history: RateHistory, now: float, window: float) -> float | None:
    """The lowest tokens/s served at the decisions of the last `window` seconds (None: no history)."""
    values = [v for t, v, _ in history if now - t <= window]
    return min(values) if values else None


def rate_peak(history: RateHistory, now: float, window: float) -> float | None:
    """The highest tokens/s served at the decisions of the last `window` seconds (None: no history)."""
    values = [v for t, v, _ in history if now - t <= window]
    return max(values) if values else None


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
    history = tuple(x for x in history if now - x[0] <= 2 * RATE_WINDOW_S)
    if (
        not history
        or history[0][0] > now - RATE_WINDOW_S - TREND_INTERVALS * interval + _EPS
        or len({n for _, _, n in history}) > 1
    ):
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
    pts = pts[-(TREND_INTERVALS + 1) :]
    (t0, first), (t1, last) = pts[0], pts[-1]
    if first <= 0 or any(b <= a for (_, a), (_, b) in zip(pts, pts[1:])) or last - first < SURGE_RISE * first:
        return 0.0
    return (last - first) / (t1 - t0)


def tokens_needed(
    arriving: float,
    queued: float | None,
    utilization: float,
    drain_s: float = RATE_WINDOW_S,
    floor: float | None = None,
) -> float:
    """Saturated tokens/s a role needs, by Little's law: the arrivals, a headroom of (1 / utilization - 1)
    times the arrivals (or times `floor`, when given and lower), plus what drains the queued tokens
    within `drain_s` (one rate window by default, so the next window measures arrivals rather than
    backlog). Without a floor that is arrivals / utilization.

    NOTE: the floor is the lowest rate served over the scale-down window (`rate_floor`): the headroom is
    for a burst that starts from the load the role had, not a margin on a burst that is already here
    and measured. Sized on the arrivals instead, a burst at 2.5-4x its base paid 43% over its peak while
    it lasted (the bench's bursty trace, 10 seeds: 13.8 replica-hours against 11.5, for 1,150 against
    1,375 under-provisioned replica-seconds; per-role 1,645).
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"tokens_needed: utilization {utilization} must be in (0, 1]")
    base = arriving if floor is None else min(floor, arriving)
    return arriving + base * (1 / utilization - 1) + (queued or 0.0) / drain_s


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


def rate_need(
    arriving: float, queued: float | None, per_replica: float, utilization: float, drain_s: float = RATE_WINDOW_S
) -> float:
    """Replicas' worth of token work for replicas that all serve `per_replica` tokens/s when saturated."""
    if per_replica <= 0 or not 0 < utilization <= 1:
        raise ValueError(f"rate_need: per_replica {per_replica} must be > 0 and utilization {utilization} in (0, 1]")
    return replicas_for(tokens_needed(arriving, queued, utilization, drain_s), (per_replica,))
