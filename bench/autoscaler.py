"""Bench: the P:D autoscaler vs a per-role HPA-style baseline on scripted traces through a queueing model.

Run: `.venv/bin/python bench/autoscaler.py` (about 35 CPU-seconds at the default 10 arrival seeds, in
`--jobs` processes, 2 by default). Prints a table, the constants and the traces they were tuned on, the
issue's targets, the held-out trace, pdfleet against the floor per trace, then one JSON line.

The queueing model (1 s steps, the same seeded arrivals for both policies):
- Requests arrive as a Poisson process at the trace's rate, with exponentially distributed prompt
  and output lengths around the trace's means at that moment.
- Prefill: a FIFO queue of prompt tokens; each ready replica prefills PREFILL_TOKENS_PER_S tokens per
  second (chunked, so a long prompt spreads over replicas). A request whose prompt is done moves to
  decode at once (KV transfer time is ignored).
- Decode: each ready replica runs up to DECODE_SLOTS sequences, each generating DECODE_TOKENS_PER_S
  tokens per second; a sequence holds its slot for output_len / DECODE_TOKENS_PER_S seconds. The
  rest wait, FIFO. A replica being removed finishes what it runs (graceful drain) but admits nothing.
- A replica asked for becomes ready STARTUP_S later (scheduling, image, weights); one removed stops
  counting at once.
- Every SCRAPE_S the workers' gauges are scraped (waiting, running, prompt tokens waiting) and the
  token counters' rate over the last RATE_WINDOW_S (prompt tokens prefilled, tokens generated), as
  `rate(...[1m])`; every autoscaling interval the policy decides from the last scrape, as the operator
  does from Prometheus.

Measures, per role and summed:
- needed(t) = replicas that just keep up with the offered load: ceil(rate x prompt / prefill speed)
  for prefill, ceil(rate x output / decode speed / slots) for decode (Little's law), from the
  trace's scripted rate and means, not from the queues either policy sees.
- under-provisioned replica-seconds: sum of max(0, needed - ready); over-provisioned: sum of
  max(0, desired - needed) (capacity paid for and not needed); replica-hours: sum of desired.
- reaction time: in each surge, from the first second a role has fewer ready replicas than needed
  until it has caught up (the surge's end if never), averaged over the roles that fell short.
- direction changes: scaling direction flips (up after down, down after up), summed over roles.

Two oracles (`Oracle`), told the offered load instead of reading metrics: `reactive-oracle` sets
desired = needed(now) each interval (still waits for the interval and the start-up: what a policy
that only sees the present would pay); `clairvoyant` knows the offered load one start-up ahead and
asks for the most it needs until the next decision's replicas serve (`clairvoyant`): it never
under-provisions (noisy-steady's 15 s steps aside), and pays for that. Both run at full utilization
(the rows of those names: what needed(t) means) and at the policy's target utilization (`@0.7`,
`--utilization`: each replica busy 70% of the time, the headroom the policy is asked to keep). The
floor of a trace is the cheaper oracle at the target utilization (issue 28: the clairvoyant at 100%
was the yardstick, though it cost more than the reactive oracle on four traces and sized with no
headroom, which alone is 1/0.7 = 1.43x); pdfleet's replica-hours are reported against it per trace,
with the spread over seeds. Four traces tune the constants (`TUNED`); a fifth, `diurnal` (the
`conversation` day compressed 12x), is held out and reported on its own.

Every policy is `autoscaler.decide` with the same spec (targets, tolerance, windows, steps, grace
period, min/max). The baseline is `policy=PER_ROLE`: each role scales on its own queue, like one HPA
per role. pdfleet (`PDFLEET`) adds seven mechanisms, also run one at a time (the rate trend on top of the
rate, drain sizing and the fast scale-down each on top of both):
- look-ahead: decode counts requests queued at prefill beyond its tolerance (`prefill_backlog`), so
  it grows while the wave is still at prefill, not after prefill drained it into decode;
- trend: in a surge (queue >= 1.5x target), a queue that grew since the last interval is sized for
  the next interval (`queue_growth`), since replicas asked for now serve a start-up time later;
- rate: each role is also sized for its token arrival rate (served + the token queue's growth) against
  the per-replica throughput it learned while saturated, at TARGET_UTILIZATION (0.7; `--utilization`
  sweeps it), and decode for what prefill's arrivals will generate (`rate_need`, `observe_rate`);
- rate trend: a served token rate that rose at each of the last two decisions, by >= 25% in all, with
  the same replicas reporting over the last two rate windows, is a surge: the role (and decode, through
  prefill's) is sized for the rate extrapolated over the 1-minute rate's 30 s lag plus 60 s (about a
  start-up and an interval) (`surge_growth`, `arrival_trend`);
- drain sizing (issue 20): once a throughput is measured it replaces the queue targets: a role is
  sized for the arrivals expected when new replicas serve, plus a headroom of (1/utilization - 1) x
  the lowest rate of the scale-down window (not of the burst itself), plus its queued prompt tokens
  drained within `autoscaling.drainTime` (60 s); decode for what prefill's arrivals and backlog will
  generate (`tokens_needed(floor=...)`);
- fast scale-down (issue 20): a role with nothing waiting whose rate has fallen to <= DRAINED_FALL
  (0.7) of its peak over the scale-down window scales down over `drainedScaleDownStabilization`
  (30 s) instead of the 300 s window;
- ratio: the spec's P:D bounds (default 1:8..8:1; they seldom bind on these traces).
No policy is told the replicas' speeds: the rate mechanism learns them from the scrapes (a first guess
from two saturated decisions in a row, then from full saturated rate windows).
"""

from __future__ import annotations

if not __package__:  # run as a script; imported as `bench.autoscaler` (tests) bench/ is not on sys.path
    import _sys_path  # noqa: F401,I001  -- first: keeps bench/operator.py from shadowing the stdlib (see it)

import argparse
import heapq
import json
import math
import multiprocessing
import os
import random
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from pdfleet_operator.api import InferenceDeploymentSpec  # noqa: E402
from pdfleet_operator.decide import autoscaler, token_rate  # noqa: E402
from pdfleet_operator.decide.autoscaler import PDFLEET, PER_ROLE, Policy  # noqa: E402
from pdfleet_operator.decide.metrics_snapshot import MetricsSnapshot, RoleMetrics  # noqa: E402

PREFILL_TOKENS_PER_S = 4000.0  # per prefill replica
DECODE_TOKENS_PER_S = 20.0  # per running sequence (50 ms inter-token latency)
DECODE_SLOTS = 32  # sequences per decode replica
STARTUP_S = 45.0
SCRAPE_S = 5.0
RATE_WINDOW_S = 60.0  # the PromQL rate window (`rate(...[1m])`)
ROLES = ("prefill", "decode")


def bench_spec() -> InferenceDeploymentSpec:
    """The deployment both policies scale: targets match the model's replica capacities."""
    return InferenceDeploymentSpec.model_validate(
        {
            "model": {"name": "bench", "source": {"local": {"path": "models/bench"}}},
            "prefill": {
                "acceleratorClasses": ["h100"],
                "minReplicas": 1,
                "maxReplicas": 16,
                "targetQueuePerReplica": 4,
                "targetPromptTokensPerReplica": 6000,
            },
            "decode": {
                "acceleratorClasses": ["h100"],
                "minReplicas": 1,
                "maxReplicas": 24,
                "targetQueuePerReplica": DECODE_SLOTS,
            },
            "autoscaling": {
                "interval": "15s",
                "tolerance": 0.1,
                "scaleUpStabilization": "0s",
                "scaleDownStabilization": "300s",
                "scaleDownDelayAfterScaleUp": "60s",
                "maxScaleUpStep": 4,
                "maxScaleDownStep": 1,
            },
        }
    )


# --- traces ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trace:
    """Offered load over time: request rate (req/s) and mean prompt/output lengths (tokens)."""

    name: str
    duration: float
    rate: Callable[[float], float]
    prompt: Callable[[float], float]
    output: Callable[[float], float]
    surges: tuple[tuple[float, float], ...] = ()

    def needed(self, t: float, utilization: float = 1.0) -> dict[str, int]:
        """Replicas that serve the offered load at `t` with each replica busy `utilization` of the time."""
        rate = self.rate(t)
        return {
            "prefill": max(1, math.ceil(rate * self.prompt(t) / PREFILL_TOKENS_PER_S / utilization - 1e-9)),
            "decode": max(
                1, math.ceil(rate * self.output(t) / DECODE_TOKENS_PER_S / DECODE_SLOTS / utilization - 1e-9)
            ),
        }


def _steps(levels: list[tuple[float, float]]) -> Callable[[float], float]:
    """A piecewise-constant function from (start, value) pairs."""

    def f(t: float) -> float:
        value = levels[0][1]
        for start, v in levels:
            if t >= start:
                value = v
        return value

    return f


def _ramp(t0: float, t1: float, a: float, b: float) -> Callable[[float], float]:
    return lambda t: a if t <= t0 else b if t >= t1 else a + (b - a) * (t - t0) / (t1 - t0)


def _bursts(
    rng: random.Random, base: float, count: int, first: float
) -> tuple[Callable[[float], float], tuple[tuple[float, float], ...]]:
    """Bursts of 2.5-4x the base rate at irregular times: a 60 s ramp up, 2-4 min at the peak, a 60 s ramp down."""
    shapes, start = [], first
    for _ in range(count):
        peak, hold = base * rng.uniform(2.5, 4.0), rng.uniform(120.0, 240.0)
        shapes.append((start, start + 60.0, start + 60.0 + hold, start + 120.0 + hold, peak))
        start += 120.0 + hold + rng.uniform(300.0, 900.0)

    def rate(t: float) -> float:
        for up, top, down, end, peak in shapes:
            if up <= t < end:
                return base + (peak - base) * min(1.0, (t - up) / 60.0, (end - t) / 60.0)
        return base

    return rate, tuple((up, end) for up, _, _, end, _ in shapes)


DIURNAL_S = 7200.0  # the held-out trace: a day of the `conversation` preset compressed 12x


def diurnal() -> Trace:
    """The held-out family: `pdfleet simulate`'s `conversation` day (its diurnal shape, trace.PRESETS)
    compressed from 24 h into DIURNAL_S, starting at 06:00, with six of the preset's bursts (1.5-2.5x,
    8 minutes on average, 60 s ramps) at real-time length, and the seeds' mix: day-time decode-heavy
    chat (prompts 800, outputs 350 tokens), night-time prefill-heavy batch (prompts 2,500, outputs 100).
    Mean 6 req/s. Never used to tune a constant (`TUNED`); reported on its own.
    """
    import numpy as np

    from pdfleet_operator import trace as presets

    preset = presets.PRESETS["conversation"]
    compress = 86400.0 / DIURNAL_S
    seconds = np.arange(int(DIURNAL_S) + 1, dtype=float)
    hour = (6.0 + seconds * compress / 3600.0) % 24.0
    shape = preset.shape(hour * 3600.0)
    rng = random.Random(11)
    mult = np.ones_like(shape)
    surges = []
    for _ in range(6):
        start = rng.uniform(300.0, DIURNAL_S - 900.0)
        length = min(900.0, max(120.0, rng.expovariate(1 / (preset.burst_minutes * 60.0))))
        height = rng.uniform(*preset.burst_height)
        t = seconds[int(start) : int(start + length)] - start
        ramp = np.minimum(1.0, np.minimum(t + 1, length - t) / 60.0)
        mult[int(start) : int(start + length)] = np.maximum(
            mult[int(start) : int(start + length)], 1.0 + (height - 1.0) * ramp
        )
        surges.append((start, start + length))
    # day: 08:00-22:00, with an hour's (5 minutes compressed) logistic edge at each end
    day = 1 / (1 + np.exp(-(hour - 8.0) * 2.0)) * 1 / (1 + np.exp((hour - 22.0) * 2.0))
    rate = (6.0 * shape * mult).tolist()
    prompt = (2500.0 - 1700.0 * day).tolist()
    output = (100.0 + 250.0 * day).tolist()

    def at(values: list[float]) -> Callable[[float], float]:
        return lambda t: values[min(len(values) - 1, max(0, int(t)))]

    return Trace("diurnal", DIURNAL_S, at(rate), at(prompt), at(output), tuple(sorted(surges)))


def traces(held_out: bool = False) -> list[Trace]:
    """The tuning traces; with `held_out`, the held-out diurnal trace after them."""
    bursty_rate, surges = _bursts(random.Random(3), 4.0, 5, 300.0)
    noise = random.Random(7)
    levels = [(15.0 * k, 8.0 * noise.uniform(0.7, 1.3)) for k in range(0, 61)]
    return [
        Trace("bursty", surges[-1][1] + 300.0, bursty_rate, lambda t: 1500.0, lambda t: 300.0, surges),
        Trace("noisy-steady", 900.0, _steps(levels), lambda t: 1500.0, lambda t: 200.0),
        Trace("long-output", 1500.0, lambda t: 4.0, lambda t: 600.0, _ramp(300.0, 900.0, 200.0, 1000.0)),
        Trace("short-prompt", 1500.0, lambda t: 8.0, _ramp(300.0, 900.0, 2000.0, 200.0), lambda t: 200.0),
    ] + ([diurnal()] if held_out else [])


# --- the fleet -------------------------------------------------------------------------------------


@dataclass
class Pool:
    desired: int
    starting: list[float] = field(default_factory=list)  # ready-at times of replicas on their way
    ready: int = 0

    def resize(self, desired: int, now: float) -> None:
        if desired > self.desired:
            self.starting += [now + STARTUP_S] * (desired - self.desired)
        else:
            drop = self.desired - desired
            cancel = min(drop, len(self.starting))  # the newest unstarted replicas go first
            self.starting = sorted(self.starting)[: len(self.starting) - cancel]
            self.ready -= drop - cancel
        self.desired = desired

    def tick(self, now: float) -> None:
        done = [t for t in self.starting if t <= now]
        self.ready += len(done)
        self.starting = [t for t in self.starting if t > now]


@dataclass
class Fleet:
    """The queueing model: a prefill token queue and decode slots, fed by one trace."""

    prefill: Pool
    decode: Pool
    prefill_queue: deque = field(default_factory=deque)  # [remaining prompt tokens, output tokens]
    decode_waiting: deque = field(default_factory=deque)  # output tokens of sequences waiting for a slot
    decode_running: list = field(default_factory=list)  # heap of finish times
    prompt_total: float = 0.0  # counters: vllm:prompt_tokens_total summed over replicas
    generation_total: float = 0.0  # vllm:generation_tokens_total
    scrapes: deque = field(default_factory=deque)  # (time, prompt_total, generation_total) of recent scrapes

    def step(self, now: float, arrivals: list[tuple[float, float]]) -> None:
        self.prefill.tick(now)
        self.decode.tick(now)
        self.prefill_queue.extend([p, o] for p, o in arrivals)
        budget = self.prefill.ready * PREFILL_TOKENS_PER_S
        while self.prefill_queue and budget > 0:
            head = self.prefill_queue[0]
            used = min(budget, head[0])
            head[0] -= used
            budget -= used
            self.prompt_total += used
            if head[0] <= 0:
                self.prefill_queue.popleft()
                self.decode_waiting.append(head[1])
        while self.decode_running and self.decode_running[0] <= now:
            heapq.heappop(self.decode_running)
        slots = self.decode.ready * DECODE_SLOTS
        while self.decode_waiting and len(self.decode_running) < slots:
            heapq.heappush(self.decode_running, now + self.decode_waiting.popleft() / DECODE_TOKENS_PER_S)
        self.generation_total += len(self.decode_running) * DECODE_TOKENS_PER_S

    def scrape(self, now: float) -> MetricsSnapshot:
        """What Prometheus would answer now: the gauges (the running prefill chunk counts as running) and
        the counters' rate over the last RATE_WINDOW_S of scrapes, as `rate(...[1m])`."""
        self.scrapes.append((now, self.prompt_total, self.generation_total))
        while len(self.scrapes) > 1 and now - self.scrapes[1][0] >= RATE_WINDOW_S:
            self.scrapes.popleft()
        t0, prompt0, gen0 = self.scrapes[0]
        span = now - t0
        prompt_rate = (self.prompt_total - prompt0) / span if span > 0 else None
        gen_rate = (self.generation_total - gen0) / span if span > 0 else None
        in_prefill = len(self.prefill_queue)
        prefill_running = min(in_prefill, self.prefill.ready)
        return MetricsSnapshot(
            taken_at=now,
            source="bench",
            roles={
                "prefill": RoleMetrics(
                    waiting=float(in_prefill - prefill_running),
                    running=float(prefill_running),
                    prompt_tokens_waiting=float(sum(p for p, _ in self.prefill_queue)),
                    prompt_tokens_rate=prompt_rate,
                    replicas_reporting=max(1, self.prefill.ready),
                    sample_time=now,
                ),
                "decode": RoleMetrics(
                    waiting=float(len(self.decode_waiting)),
                    running=float(len(self.decode_running)),
                    generation_tokens_rate=gen_rate,
                    replicas_reporting=max(1, self.decode.ready),
                    sample_time=now,
                ),
            },
        )


def arrivals(trace: Trace, seed: int) -> list[list[tuple[float, float]]]:
    """Per second: (prompt tokens, output tokens) of each arriving request."""
    rng = random.Random(seed)
    out = []
    for t in range(int(trace.duration)):
        count = _poisson(rng, trace.rate(t))
        out.append(
            [
                (max(16.0, rng.expovariate(1 / trace.prompt(t))), max(1.0, rng.expovariate(1 / trace.output(t))))
                for _ in range(count)
            ]
        )
    return out


def _poisson(rng: random.Random, lam: float) -> int:
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


# --- a run -----------------------------------------------------------------------------------------


@dataclass
class Result:
    under: dict[str, float]
    over: dict[str, float]
    replica_seconds: float
    reactions: list[float]
    direction_changes: int
    max_replicas: dict[str, int]
    final_replicas: dict[str, int]

    @property
    def reaction(self) -> float:
        return sum(self.reactions) / len(self.reactions) if self.reactions else 0.0

    @property
    def under_total(self) -> float:
        return sum(self.under.values())

    @property
    def over_total(self) -> float:
        return sum(self.over.values())


_ISSUE6 = Policy(
    prefill_lookahead=False,
    queue_trend=False,
    token_rate=False,
    ratio_bounds=False,
    rate_trend=False,
    drain_sizing=False,
    drained_scale_down=False,
)
POLICIES: dict[str, Policy | None] = {  # None: an oracle, run by name
    "per-role": PER_ROLE,
    "+lookahead": replace(_ISSUE6, prefill_lookahead=True),
    "+trend": replace(_ISSUE6, queue_trend=True),
    "+rate": replace(_ISSUE6, token_rate=True),
    "+rate+trend": replace(_ISSUE6, token_rate=True, rate_trend=True),
    "+drain": replace(_ISSUE6, token_rate=True, rate_trend=True, drain_sizing=True),
    "+fast-down": replace(_ISSUE6, token_rate=True, rate_trend=True, drained_scale_down=True),
    "pdfleet": PDFLEET,
    "reactive-oracle": None,  # knows the offered load now; still waits for the interval and the start-up
    "clairvoyant": None,  # knows it one start-up ahead: never under-provisioned
}


@dataclass(frozen=True)
class Oracle:
    """A policy told the offered load instead of reading metrics, sizing every replica busy `utilization`
    of the time: `reactive` asks for what the load needs now, `clairvoyant` for the most it will need
    until the next decision's replicas serve (`clairvoyant`)."""

    kind: str
    utilization: float = 1.0

    def desired(self, trace: Trace, now: float, interval: float) -> dict[str, int]:
        if self.kind == "clairvoyant":
            return clairvoyant(trace, now, interval, self.utilization)
        return trace.needed(now, self.utilization)


# the oracles at full utilization, by the names the table has always had (and `run` takes)
ORACLES = {"reactive-oracle": Oracle("reactive"), "clairvoyant": Oracle("clairvoyant")}


def at_target(utilization: float) -> dict[str, Oracle]:
    """The same two oracles sized at the policy's target utilization: the floor is the cheaper of them."""
    return {
        f"reactive-oracle@{utilization:g}": Oracle("reactive", utilization),
        f"clairvoyant@{utilization:g}": Oracle("clairvoyant", utilization),
    }


def clairvoyant(trace: Trace, now: float, interval: float, utilization: float = 1.0) -> dict[str, int]:
    """What the offered load will need by when replicas asked for now serve: the most `needed` over
    [now, now + STARTUP_S + interval] (one start-up ahead, until the next decision's replicas serve).

    NOTE: the most over the whole span, not `needed(now + STARTUP_S)`: replicas that are ready now keep
    serving until the next decision, and a scale-down takes effect at once.
    """
    horizon = [trace.needed(now + s, utilization) for s in range(0, int(STARTUP_S + interval) + 1)]
    return {role: max(n[role] for n in horizon) for role in ROLES}


# Every constant the decision uses, where it lives, and the traces it was tuned on ("-": chosen, not
# swept). `diurnal` is held out: no value was chosen by looking at it. Values are read where they live.
_AUTO = bench_spec().autoscaling
TUNED: tuple[tuple[str, object, str], ...] = (
    ("autoscaling.targetUtilization", _AUTO.target_utilization, "bursty (0.65-0.8; issue 6: 0.65-0.91)"),
    ("autoscaling.drainTime", _AUTO.drain_time, "bursty (30/45/60/90 s)"),
    (
        "autoscaling.drainedScaleDownStabilization",
        _AUTO.drained_scale_down_stabilization,
        "bursty, noisy-steady (15/30/45/60 s)",
    ),
    ("autoscaler.DRAINED_FALL", autoscaler.DRAINED_FALL, "bursty, noisy-steady (0.6-0.8)"),
    ("token_rate.SURGE_RISE", token_rate.SURGE_RISE, "long-output, noisy-steady (issue 6)"),
    ("token_rate.TREND_HORIZON_S", token_rate.TREND_HORIZON_S, "bursty (issue 6)"),
    ("token_rate.TREND_INTERVALS", token_rate.TREND_INTERVALS, "-"),
    ("token_rate.THROUGHPUT_WEIGHT", token_rate.THROUGHPUT_WEIGHT, "-"),
    (
        "token_rate.SATURATED_WAITING/KV/SEATS",
        f"{token_rate.SATURATED_WAITING:g}, {token_rate.SATURATED_KV:g}, {token_rate.SATURATED_SEATS:g}",
        "the simulated fleet (issue 10)",
    ),
    ("autoscaler.SURGE (queue trend)", autoscaler.SURGE, "-"),
    ("the bench spec's targets, tolerance, windows, steps", "bench_spec()", "- (the same for every policy)"),
)


def run(trace: Trace, policy: Policy | Oracle | str | None, seed: int = 1) -> Result:
    """One trace through the fleet model. `policy` an `Oracle`, or by name "reactive-oracle" (or None):
    desired = needed(now) each interval; "clairvoyant": desired = what the load will need when new
    replicas serve (`clairvoyant`), both at full utilization."""
    if policy is None or isinstance(policy, str):
        policy = ORACLES[policy or "reactive-oracle"]
    spec = bench_spec()
    start = trace.needed(0.0)
    fleet = Fleet(Pool(start["prefill"], ready=start["prefill"]), Pool(start["decode"], ready=start["decode"]))
    state = autoscaler.ScalerState.initial(spec, start)
    interval = spec.interval_seconds()
    under = {r: 0.0 for r in ROLES}
    over = {r: 0.0 for r in ROLES}
    replica_seconds = 0.0
    moves: dict[str, list[str]] = {r: [] for r in ROLES}
    peak = dict(start)
    short_since: dict[tuple[float, str], float] = {}  # (surge, role) -> when it first fell short
    lags: dict[tuple[float, str], float] = {}
    t0 = 1_000_000.0  # wall-clock origin for the decision's timestamps
    # NOTE: at t0, not 0: a first scrape at 0 made every rate of the first minute span 10^6 s, ~0 tokens/s
    snapshot = fleet.scrape(t0)
    for second, batch in enumerate(arrivals(trace, seed)):
        now = float(second)
        fleet.step(now, batch)
        if now % SCRAPE_S == 0:
            snapshot = fleet.scrape(t0 + now)
        if now % interval == 0 and now > 0:
            pools = {"prefill": fleet.prefill, "decode": fleet.decode}
            if isinstance(policy, Oracle):
                desired = policy.desired(trace, now, interval)
            else:
                decisions, state = autoscaler.decide(
                    spec, state, snapshot, t0 + now, {}, current={r: p.desired for r, p in pools.items()}, policy=policy
                )
                desired = {role: d.desired for role, d in decisions.items()}
            for role, n in desired.items():
                if n != pools[role].desired:
                    moves[role].append("up" if n > pools[role].desired else "down")
                pools[role].resize(n, now)
                peak[role] = max(peak[role], n)
        needed = trace.needed(now)
        for role, pool in (("prefill", fleet.prefill), ("decode", fleet.decode)):
            under[role] += max(0, needed[role] - pool.ready)
            over[role] += max(0, pool.desired - needed[role])
            replica_seconds += pool.desired
        for s, e in trace.surges:
            for role, pool in (("prefill", fleet.prefill), ("decode", fleet.decode)):
                key = (s, role)
                if not s <= now < e or key in lags:
                    continue
                if pool.ready < needed[role]:
                    short_since.setdefault(key, now)
                elif key in short_since:
                    lags[key] = now - short_since[key]
    reactions = [
        lags.get(key, e - start) for (s, e) in trace.surges for key, start in short_since.items() if key[0] == s
    ]
    changes = sum(1 for r in ROLES for a, b in zip(moves[r], moves[r][1:]) if a != b)
    return Result(
        under,
        over,
        replica_seconds,
        reactions,
        changes,
        peak,
        {"prefill": fleet.prefill.desired, "decode": fleet.decode.desired},
    )


def _policies(utilization: float) -> dict[str, Policy | Oracle]:
    """The policies to run, token-rate ones at `utilization`, and the oracles at full and at that utilization."""
    out: dict[str, Policy | Oracle] = {
        name: ORACLES[name] if p is None else p if not p.token_rate else replace(p, utilization=utilization)
        for name, p in POLICIES.items()
    }
    return {**out, **at_target(utilization)}


_WORKER: dict[str, object] = {}


def _start_worker(utilization: float) -> None:
    _WORKER["traces"] = {t.name: t for t in traces(held_out=True)}
    _WORKER["policies"] = _policies(utilization)


def _job(job: tuple[str, str, int]) -> Result:
    trace, policy, seed = job
    return run(_WORKER["traces"][trace], _WORKER["policies"][policy], seed)  # type: ignore[index]


def floor(results: dict[tuple[str, str], list[Result]], trace: str, oracles: list[str]) -> dict[str, object]:
    """The floor of one trace: the oracle (of `oracles`, all at one utilization) with the fewest replica-hours,
    pdfleet's replica-hours against it (ratio of the means over seeds, and each seed's own), and the best of
    the full-utilization oracles for comparison."""

    def hours(name: str) -> list[float]:
        return [r.replica_seconds / 3600 for r in results[(trace, name)]]

    best = min(oracles, key=lambda name: sum(hours(name)))
    base, ours = hours(best), hours("pdfleet")
    per_seed = [o / b for o, b in zip(ours, base)]
    return {
        "oracle": best,
        "hours": sum(base) / len(base),
        "policy_hours": sum(ours) / len(ours),
        "ratio": sum(ours) / sum(base),
        "min": min(per_seed),
        "max": max(per_seed),
        "full_hours": min(sum(hours(name)) / len(hours(name)) for name in ORACLES),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # NOTE: 10, not 3: the bursty trace's 5 surges make one seed's shortfall swing by a third; the
    # reduction over 3 seeds read 0.32 where 6 read 0.27 (before the rate trend).
    parser.add_argument("--seeds", type=int, default=10, help="arrival seeds averaged per trace")
    parser.add_argument(
        "--utilization",
        type=float,
        default=autoscaler.TARGET_UTILIZATION,
        help="the token rate's target utilization for +rate and pdfleet (a sweep knob)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="processes running (trace, policy, seed) in parallel",
    )
    args = parser.parse_args(argv)
    if not 0 < args.utilization <= 1:
        parser.error(f"--utilization must be in (0, 1], got {args.utilization}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    policies = _policies(args.utilization)

    rows = []
    every = traces(held_out=True)
    # NOTE: an oracle runs once per trace: it reads the trace's scripted load, never the arrivals, so every
    # seed gives it the same result (its row is that one run, counted once per seed).
    jobs = [
        (trace.name, policy, seed)
        for trace in every
        for policy, p in policies.items()
        for seed in (range(1, args.seeds + 1) if not isinstance(p, Oracle) else (1,))
    ]
    with multiprocessing.get_context("fork").Pool(
        args.jobs, initializer=_start_worker, initargs=(args.utilization,)
    ) as pool:
        done = pool.map(_job, jobs, chunksize=1)
    results: dict[tuple[str, str], list[Result]] = {}
    for (trace_name, policy, _), result in zip(jobs, done):
        copies = args.seeds if isinstance(policies[policy], Oracle) else 1
        results.setdefault((trace_name, policy), []).extend([result] * copies)
    for trace in every:
        for policy in policies:
            rs = results[(trace.name, policy)]
            n = len(rs)
            rows.append(
                (
                    trace.name,
                    policy,
                    sum(r.under["prefill"] for r in rs) / n,
                    sum(r.under["decode"] for r in rs) / n,
                    sum(r.over_total for r in rs) / n,
                    sum(r.replica_seconds for r in rs) / n / 3600,
                    (
                        sum(sum(r.reactions) for r in rs) / max(1, sum(len(r.reactions) for r in rs))
                        if trace.surges
                        else float("nan")
                    ),
                    sum(r.direction_changes for r in rs) / n,
                )
            )

    header = ("trace", "policy", "under P r·s", "under D r·s", "over r·s", "replica-h", "reaction s", "dir changes")
    print(f"{header[0]:<13} {header[1]:<16}" + "".join(f"{h:>13}" for h in header[2:]))
    for row in rows:
        print(
            f"{row[0]:<13} {row[1]:<16}"
            + "".join(f"{v:>13.1f}" if not math.isnan(v) else f"{'-':>13}" for v in row[2:])
        )

    def mean(trace: str, policy: str, f: Callable[[Result], float]) -> float:
        rs = results[(trace, policy)]
        return sum(f(r) for r in rs) / len(rs)

    def under_ratio(trace: str) -> float:
        base = mean(trace, "per-role", lambda r: r.under_total)
        ours = mean(trace, "pdfleet", lambda r: r.under_total)
        return ours / base if base else (0.0 if not ours else math.inf)

    def hours_ratio(trace: str) -> float:
        return mean(trace, "pdfleet", lambda r: r.replica_seconds) / mean(
            trace, "clairvoyant", lambda r: r.replica_seconds
        )

    target = list(at_target(args.utilization))
    floors = {t.name: floor(results, t.name, target) for t in every}

    tuning = [t.name for t in traces()]
    print("\nconstants, and the traces they were tuned on (held out of all tuning: diurnal)")
    for name, value, where in TUNED:
        print(f"  {name:<52} {value!s:<14} {where}")
    print("\ntargets (tuning traces)")
    print(f"  replica-hours / clairvoyant on bursty: {hours_ratio('bursty'):.2f} (target <= 1.5)")
    for name in tuning:
        print(f"  under-provisioned r·s / per-role on {name}: {under_ratio(name):.2f} (target <= 1)")
    noisy = next(t for t in traces() if t.name == "noisy-steady")
    per_10min = mean("noisy-steady", "pdfleet", lambda r: r.direction_changes) / (noisy.duration / 600)
    print(f"  direction changes per 10 minutes on noisy-steady: {per_10min:.2f} (target <= 1)")
    print("held out: diurnal (the conversation day compressed 12x, day decode-heavy, night prefill-heavy)")
    per_role_hours = mean("diurnal", "pdfleet", lambda r: r.replica_seconds) / mean(
        "diurnal", "per-role", lambda r: r.replica_seconds
    )
    print(
        f"  replica-hours / clairvoyant: {hours_ratio('diurnal'):.2f}; under-provisioned r·s / per-role: "
        f"{under_ratio('diurnal'):.2f}; replica-hours / per-role: {per_role_hours:.2f}"
    )
    print(
        f"\nreplica-hours against the floor: the cheaper oracle sized at the policy's target utilization "
        f"({args.utilization:g}), per trace (pdfleet's mean over {args.seeds} seeds; the spread is per seed)"
    )
    for name, f in floors.items():
        print(
            f"  {name:<13} pdfleet {f['policy_hours']:6.2f} h / floor {f['hours']:6.2f} h ({f['oracle']}) = "
            f"{f['ratio']:.2f}x (seeds {f['min']:.2f}-{f['max']:.2f}); at full utilization the oracles' best was "
            f"{f['full_hours']:.2f} h"
        )

    under_base = mean("bursty", "per-role", lambda r: r.under_total)
    under_ours = mean("bursty", "pdfleet", lambda r: r.under_total)
    summary = {
        "underprovisioned_reduction": round(1 - under_ours / under_base, 4) if under_base else 0.0,
        "replica_hours_ratio": round(
            mean("bursty", "pdfleet", lambda r: r.replica_seconds)
            / mean("bursty", "per-role", lambda r: r.replica_seconds),
            4,
        ),
        "direction_changes_noisy": round(mean("noisy-steady", "pdfleet", lambda r: r.direction_changes), 2),
        "direction_changes_noisy_baseline": round(mean("noisy-steady", "per-role", lambda r: r.direction_changes), 2),
        "reaction_s_bursty": round(mean("bursty", "pdfleet", lambda r: r.reaction), 1),
        "reaction_s_bursty_baseline": round(mean("bursty", "per-role", lambda r: r.reaction), 1),
        "utilization": args.utilization,
        "seeds": args.seeds,
        "replica_hours_vs_clairvoyant": round(hours_ratio("bursty"), 4),
        "underprovisioned_vs_per_role_max": round(max(under_ratio(t) for t in tuning), 4),
        "direction_changes_noisy_per_10min": round(per_10min, 2),
        "heldout_trace": "diurnal",
        "heldout_replica_hours_vs_clairvoyant": round(hours_ratio("diurnal"), 4),
        "heldout_underprovisioned_vs_per_role": round(under_ratio("diurnal"), 4),
        "floor_utilization": args.utilization,
        "floor_oracle": {name: f["oracle"] for name, f in floors.items()},
        "floor_replica_hours": {name: round(f["hours"], 3) for name, f in floors.items()},
        "replica_hours_vs_floor": {name: round(f["ratio"], 4) for name, f in floors.items()},
        "replica_hours_vs_floor_min": {name: round(f["min"], 4) for name, f in floors.items()},
        "replica_hours_vs_floor_max": {name: round(f["max"], 4) for name, f in floors.items()},
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
