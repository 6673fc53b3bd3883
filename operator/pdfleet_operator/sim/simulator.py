"""The simulated fleet: a discrete-event loop that runs the operator's own placement, autoscaler and rollback code.

Per deployment of a policy, every `autoscaling.interval` the loop does what the operator does:
`SimulatedMetricsSource.snapshot` -> `autoscaler.decide` (with `FleetPlan.capacity` of the last plan)
-> `placement.plan` against the node inventory minus the other deployments' pods -> pods created
(bound to a node by the scheduler's best fit, serving after the class's start-up delay) or drained
(no new requests; removed when empty). Every scrape interval the workers' gauges are scraped, and
`rollback.analyze` watches the router's 5xx ratio. Requests arrive from the trace, the router
(`sim.router`) picks workers, prefill hands KV to decode after `bytes / link bandwidth`, and each
replica is the aggregate engine model of `sim.engine`.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pdfleet_operator.api import AcceleratorClassSpec, InferenceDeploymentSpec, parse_duration
from pdfleet_operator.decide import autoscaler, pd_threshold, placement, rollback, runtimes, tick
from pdfleet_operator.decide.inventory import Inventory, NodeInventory
from pdfleet_operator.sim import efficiency, perf_model
from pdfleet_operator.sim import engine as eng
from pdfleet_operator.sim import routing as sim_routing
from pdfleet_operator.sim.fleet import DeploymentPlan, Fleet, Policy
from pdfleet_operator.sim.metrics_source import SimulatedMetricsSource
from pdfleet_operator.sim.perf_model import Efficiency, ReplicaPerf
from pdfleet_operator.sim.router import Pool, Router
from pdfleet_operator.sim.stats import Histogram
from pdfleet_operator.trace import Trace

try:
    from mypy_extensions import mypyc_attr
except ImportError:  # interpreted where mypy is not installed: mypyc's marker has nothing to mark

    def mypyc_attr(*_: object, **__: object):  # type: ignore[no-redef,misc]  # noqa: ANN201
        return lambda cls: cls


REPLICA, TRANSFER, READY, SCRAPE, DECIDE, SAMPLE, WARMUP, ENTER = range(8)
assert REPLICA == eng.EVENT, "a replica pushes its own events with the kind sim.engine.EVENT"
_NO_POOL = Pool(inline=True)  # empty: never scores


@dataclass
class ScaleEvent:
    t: float
    deployment: str
    role: str
    current: int
    desired: int
    reason: str
    message: str


@dataclass
class Sample:
    """The fleet at one moment, for the plots and the cost-over-time series."""

    t: float
    replicas: dict[str, int]  # "deployment/role/class" -> pods holding accelerators
    ready: dict[str, int]
    waiting: dict[str, float]  # "deployment/role" -> requests waiting
    running: dict[str, float]
    cost_per_hour: float
    generated_so_far: float


@dataclass(frozen=True)
class Stopped:
    """Where a run with `stop_below` stopped: the SLO misses counted by then exceed what the goal allows."""

    t: float  # simulated time of the stop
    goal: float  # the attainment it could no longer reach
    misses: int  # measured requests settled by then that missed their SLO (rejected ones included)
    allowed: float  # the most misses an attainment that rounds to the goal leaves room for
    counted: int  # requests that count for the attainment (measured, not refused as too long)
    at_most: float  # the most attainment the run could still have reached (rounded as the report rounds it)


class AttainmentWatch:
    """Counts SLO misses as requests settle, in arrival order, by `report.summarize`'s rule one request at a time:
    a measured request that is not refused as too long counts; it meets the SLO when it is done, its TTFT (the
    decode worker's first token after a PD hand-off) is within `slo.ttft` and its time per output token within
    `slo.itl`; rejected and unfinished ones miss. A cursor walks the requests in arrival order and stops at the
    first one still in flight, so the count is a lower bound of the misses at the end (exact once every request
    settled: tests/sim/test_equal_slo_search.py holds it to the report's)."""

    def __init__(self, sim: Simulator, goal: float) -> None:
        reqs = sim.reqs
        self.reqs = reqs
        self.goal = goal
        self.cursor = bisect.bisect_left(reqs.arrival, sim.warmup)
        self.misses = 0
        self.slo = [
            (bool(d.spec.disaggregation), parse_duration(d.spec.slo.ttft), parse_duration(d.spec.slo.itl))
            for d in sim.deps
        ]
        # the report's `valid`: what _arrive does not refuse as too long
        first, trace = self.cursor, sim.trace
        max_len = np.array([d.max_len for d in sim.deps])[np.asarray(reqs.deployment[first:], dtype=np.int64)]
        self.counted = int(np.count_nonzero(trace.prompt[first:] + trace.output[first:] <= max_len))
        # NOTE: reached when round(met / counted, 4) >= goal; met / counted < goal - 0.00005 rounds below it.
        # One request of slack for float error.
        self.allowed = self.counted * (1.0 - goal + 0.00005) + 1.0

    def met(self, i: int) -> bool:
        reqs = self.reqs
        if reqs.status[i] != eng.DONE:
            return False
        pd, slo_ttft, slo_itl = self.slo[reqs.deployment[i]]
        out = reqs.output[i]
        gap = reqs.second_gap[i]
        handoff = pd and out > 1 and math.isfinite(gap)
        first = reqs.t_first[i] + gap if handoff else reqs.t_first[i]
        if not first - reqs.arrival[i] <= slo_ttft:
            return False
        if out <= 1:
            return True
        return (reqs.t_done[i] - first) / max(out - 1 - handoff, 1) <= slo_itl

    def count(self) -> int:
        """Advance over the requests settled since the last call; the misses counted so far."""
        status, k, n = self.reqs.status, self.cursor, len(self.reqs)
        misses = self.misses
        while k < n and status[k] != eng.ACTIVE:
            if status[k] != eng.TOO_LONG and not self.met(k):
                misses += 1
            k += 1
        self.cursor, self.misses = k, misses
        return misses

    def unreachable(self) -> bool:
        return self.count() > self.allowed

    def stopped(self, t: float) -> Stopped:
        at_most = round((self.counted - self.misses) / self.counted, 4) if self.counted else 0.0
        return Stopped(t, self.goal, self.misses, self.allowed, self.counted, at_most)


@dataclass
class DeploymentState:
    """One InferenceDeployment while it is simulated."""

    idx: int
    plan: DeploymentPlan
    perfs: dict[str, ReplicaPerf]
    itl: Histogram
    scaler: autoscaler.ScalerState
    source: SimulatedMetricsSource
    health: rollback.RevisionHealth
    fleet_plan: placement.FleetPlan | None = None
    replicas: list[eng.Replica] = field(default_factory=list)  # live (not removed)
    routable: dict[str, Pool] = field(default_factory=dict)  # role -> its ready replicas
    pending: dict[tuple[str, str], int] = field(default_factory=dict)  # pods without a node
    used: dict[str, dict[str, int]] = field(default_factory=dict)  # node -> resource -> units
    max_len: int = 0
    requests: int = 0
    errors: int = 0
    window: deque = field(default_factory=deque)  # (t, requests, errors)
    last_others: int = -1
    rollback_actions: list[tuple[float, str, str]] = field(default_factory=list)
    interval_s: float = 0.0  # autoscaling.interval
    rollback_window_s: float = 0.0  # rollback.window
    pd_min_prompt_tokens: int = 0  # shorter PD prompts go straight to decode (the router's, decide/pd_threshold.py)
    short_prompts: int = 0  # requests that did

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def spec(self) -> InferenceDeploymentSpec:
        return self.plan.spec

    def by_role(self) -> dict[str, list[eng.Replica]]:
        out: dict[str, list[eng.Replica]] = {role: [] for role in self.spec.roles()}
        for r in self.replicas:
            out[r.role].append(r)
        return out


# tests subclass it to check every step (compiled, a class says so to be subclassed)
@mypyc_attr(allow_interpreted_subclasses=True)
class Simulator:
    """One policy on one trace; `run()` returns itself with results filled in (read by `sim.report`)."""

    def __init__(
        self,
        fleet: Fleet,
        policy: Policy,
        trace: Trace,
        *,
        efficiencies: Mapping[tuple[str, str], Efficiency] | None = None,
        seed: int = 0,
        warmup_s: float = 0.0,
        progress: Callable[[float], None] | None = None,
        stop_below: float | None = None,
    ) -> None:
        """`warmup_s`: the trace's first seconds bring the fleet to a steady state and are not measured
        (requests arriving then, cost, samples and scale events before it are left out of the report).
        `stop_below`: an SLO attainment (as report.json rounds it, 4 decimals); the run stops at the first
        sample at which the misses already counted make reaching it impossible (`stopped` says when; an
        equal-SLO variant needs no more than that). None: the whole trace."""
        if not 0 <= warmup_s < trace.duration:
            raise ValueError(f"warm-up {warmup_s} s must be within the trace's {trace.duration} s")
        self.fleet, self.policy, self.trace = fleet, policy, trace
        self.warmup = warmup_s
        self.gen_at_warmup = 0
        self.settings = fleet.settings
        self.classes: Mapping[str, AcceleratorClassSpec] = fleet.classes
        self.efficiencies = dict(efficiencies or {})
        self.progress = progress
        self.now = 0.0
        self.heap: list[tuple[float, int, int, Any, Any]] = []  # (time, seq, kind, a, b): a, b by kind
        self._seq = itertools.count()
        self._push_event = functools.partial(heapq.heappush, self.heap)  # what replicas push their events with
        base = fleet.inventory()
        self.base_nodes: tuple[NodeInventory, ...] = base.nodes
        self.used: dict[str, dict[str, int]] = {n.name: {} for n in base.nodes}
        self.changes = [0] * len(policy.deployments)
        rng = np.random.default_rng(seed + 7919)
        shares = np.array([d.share for d in policy.deployments])
        assign = (
            rng.choice(len(shares), size=len(trace), p=shares / shares.sum())
            if len(shares) > 1
            else np.zeros(len(trace), dtype=np.int64)
        )
        # query routing: what a deployment's router judges simple goes to its target (the router's own rules)
        self.routed = np.zeros(len(trace), dtype=bool)
        index = {d.name: i for i, d in enumerate(policy.deployments)}
        for i, d in enumerate(policy.deployments):
            if d.spec.routing is not None:
                small = sim_routing.simple(d.spec.routing, trace.prompt, trace.output) & (assign == i)
                assign[small] = index[d.spec.routing.target]
                self.routed |= small
        self.reqs = eng.Requests(trace.arrival.tolist(), trace.prompt.tolist(), trace.output.tolist(), assign.tolist())
        self.all_replicas: list[eng.Replica] = []
        self.samples: list[Sample] = []
        self.scale_events: list[ScaleEvent] = []
        self.decisions = 0
        self.end = trace.duration
        self.deps = [self._deployment(i, d) for i, d in enumerate(policy.deployments)]
        self._next_replica_id = itertools.count()
        self.router = Router()
        self.watch = AttainmentWatch(self, stop_below) if stop_below is not None else None
        self.stopped: Stopped | None = None

    # --- set-up -----------------------------------------------------------------------------------------
    def _deployment(self, idx: int, d: DeploymentPlan) -> DeploymentState:
        perfs = {}
        for role, rs in d.spec.roles().items():
            for cname in rs.accelerator_classes:
                if cname in perfs:
                    continue
                cls = self.classes[cname]
                # the engine the pool runs there (`decide.runtimes`; the fleet file refused what cannot run)
                engine = runtimes.engine_of(d.spec, cls)
                eff = efficiency.for_pool(engine, cname, cls, self.efficiencies)
                try:
                    perfs[cname] = replace(
                        perf_model.replica_perf(d.spec, cname, cls, eff),
                        defers_partial_prefill=engine == runtimes.PDFLEET,
                    )
                except ValueError:
                    continue  # placement skips a class the model does not fit, with the reason in its plan
        state = DeploymentState(
            idx=idx,
            plan=d,
            perfs=perfs,
            itl=Histogram(),
            scaler=autoscaler.ScalerState.initial(d.spec),
            source=None,  # type: ignore[arg-type]
            health=rollback.RevisionHealth(revision=1, started_at=0.0),
            interval_s=d.spec.interval_seconds(),
            rollback_window_s=parse_duration(d.spec.rollback.window),
            pd_min_prompt_tokens=pd_threshold.threshold(d.spec, self.classes),
        )
        state.source = SimulatedMetricsSource(d.name, state.by_role, lambda: self.now)
        caps = [p.kv_capacity_tokens for p in perfs.values()]
        state.max_len = min([d.spec.model.max_model_len] + caps)
        return state

    def _push(self, t: float, kind: int, a: object, b: object = None) -> None:
        heapq.heappush(self.heap, (t, next(self._seq), kind, a, b))

    # --- inventory and pods -------------------------------------------------------------------------------
    def _inventory(self, exclude: DeploymentState | None = None) -> Inventory:
        nodes = []
        for n in self.base_nodes:
            used = self.used[n.name]
            own = exclude.used.get(n.name, {}) if exclude is not None else {}
            free = {res: units - used.get(res, 0) + own.get(res, 0) for res, units in n.free.items()}
            nodes.append(NodeInventory(n.name, n.labels, n.taints, free))
        return Inventory(tuple(nodes))

    def _schedule(self, cls: AcceleratorClassSpec) -> str | None:
        """The node the scheduler binds one pod of `cls` to (the inventory's best fit), or None (Pending)."""
        inv = self._inventory()
        rest, got = inv.take(cls, 1)
        if not got:
            return None
        for before, after in zip(inv.nodes, rest.nodes):
            if before.free.get(cls.resource_name) != after.free.get(cls.resource_name):
                return before.name
        raise AssertionError(f"placed a {cls.resource_name} pod but no node's free units changed")

    def _bind(self, d: DeploymentState, role: str, cname: str, t: float, warm: bool = False) -> bool:
        cls = self.classes[cname]
        node = self._schedule(cls)
        if node is None:
            return False
        for table in (self.used[node], d.used.setdefault(node, {})):
            table[cls.resource_name] = table.get(cls.resource_name, 0) + cls.count
        self.changes[d.idx] += 1
        ready_at = t if warm else t + self.settings.startup(cname)
        rep = eng.Replica(
            next(self._next_replica_id),
            d.idx,
            role,
            cname,
            d.perfs[cname],
            self.reqs,
            self._push_event,
            self._seq,
            d.itl,
            self._prefilled,
            d.spec.engine.max_waiting_requests,
            t,
            ready_at,
            node,
        )
        d.replicas.append(rep)
        self.all_replicas.append(rep)
        if warm:
            self._route_table(d)
        else:
            self._push(ready_at, READY, rep)
        return True

    def _remove(self, rep: eng.Replica, t: float) -> None:
        d = self.deps[rep.deployment]
        assert rep.removed_at is None, f"replica {rep.id} removed twice"
        rep.removed_at = t
        rep.version += 1
        cls = self.classes[rep.accelerator_class]
        for table in (self.used[rep.node], d.used[rep.node]):
            table[cls.resource_name] -= cls.count
            assert table[cls.resource_name] >= 0, f"node {rep.node}: negative use of {cls.resource_name}"
        self.changes[d.idx] += 1
        d.replicas.remove(rep)
        self._route_table(d)

    def _route_table(self, d: DeploymentState) -> None:
        table: dict[str, list[eng.Replica]] = {role: [] for role in d.spec.roles()}
        for r in d.replicas:
            if r.ready(self.now):
                table[r.role].append(r)
        old = d.routable
        for pool in old.values():
            pool.detach()
        d.routable = {
            role: Pool(reps, inline=self.router.inline, turns=old[role].turns if role in old else None)
            for role, reps in table.items()
        }

    def _drain(self, rep: eng.Replica, t: float) -> None:
        rep.draining = True
        if t < rep.ready_at or rep.idle():
            self._remove(rep, t)
        else:
            self._route_table(self.deps[rep.deployment])

    # --- the operator's loop ---------------------------------------------------------------------------------
    def _reconcile(self, d: DeploymentState, plan: placement.FleetPlan, t: float, warm: bool = False) -> None:
        """Make the pods match the plan: bind what is missing, drop Pending/starting pods first, drain the rest."""
        d.fleet_plan = plan
        want = {(p.role, p.accelerator_class): p.replicas for p in plan.pools}
        keys = set(want) | set(d.pending) | {(r.role, r.accelerator_class) for r in d.replicas if not r.draining}
        for key in sorted(keys):
            role, cname = key
            live = [r for r in d.replicas if (r.role, r.accelerator_class) == key and not r.draining]
            pending = d.pending.get(key, 0)
            n = want.get(key, 0)
            while pending and len(live) < n:
                if not self._bind(d, role, cname, t, warm):
                    break
                pending -= 1
                live = [r for r in d.replicas if (r.role, r.accelerator_class) == key and not r.draining]
            have = len(live) + pending
            for _ in range(n - have):
                if not self._bind(d, role, cname, t, warm):
                    pending += 1
            surplus = have - n
            if surplus > 0:
                cut = min(pending, surplus)
                pending -= cut
                surplus -= cut
                # Starting pods first (nothing to lose), then the emptiest ready ones.
                victims = sorted(live, key=lambda r: (r.ready_at <= t, len(r.waiting) + r.num_running()))
                for rep in victims[:surplus]:
                    self._drain(rep, t)
            d.pending[key] = pending
        d.pending = {k: v for k, v in d.pending.items() if v}

    def _plan(self, d: DeploymentState, desired: Mapping[str, int] | None, t: float, warm: bool = False) -> None:
        plan = placement.plan(d.spec, self.classes, self._inventory(exclude=d), desired)
        d.last_others = sum(self.changes) - self.changes[d.idx]
        self._reconcile(d, plan, t, warm)

    def _decide(self, d: DeploymentState, t: float) -> None:
        assert d.fleet_plan is not None
        roles = d.spec.roles()
        snapshot = d.source.snapshot(d.name, d.plan.namespace, roles)
        # NOTE: pods still starting count as running: the plan holds only the placed ones.
        current = {
            role: d.fleet_plan.replicas(role) + sum(v for (r, _), v in d.pending.items() if r == role) for role in roles
        }
        step = tick.scale(
            d.spec, d.scaler, snapshot, t, d.fleet_plan, current=current, policy=self.policy.autoscaler_policy
        )
        d.scaler, desired = step.state, step.desired
        for dec in step.moved:
            self.scale_events.append(ScaleEvent(t, d.name, dec.role, dec.current, dec.desired, dec.reason, dec.message))
        others = sum(self.changes) - self.changes[d.idx]
        if desired != dict(d.fleet_plan.targets) or d.pending or others != d.last_others:
            self._plan(d, desired, t)

    def _analyze_rollback(self, d: DeploymentState, t: float) -> None:
        spec = d.spec.rollback
        window = d.rollback_window_s
        d.window.append((t, d.requests, d.errors))
        while len(d.window) > 1 and t - d.window[1][0] >= window:
            d.window.popleft()
        t0, r0, e0 = d.window[0]
        if t - t0 < window * 0.999:
            return
        sample = rollback.RatioSample(time=t, requests=float(d.requests - r0), errors=float(d.errors - e0))
        d.health, action = rollback.analyze(d.health, sample, spec, stable_revision=None)
        if action.kind != "none":
            d.rollback_actions.append((t, action.kind, action.message))

    # --- request flow ---------------------------------------------------------------------------------------
    def _arrive(self, rid: int, t: float) -> None:
        reqs = self.reqs
        d = self.deps[reqs.deployment[rid]]
        d.requests += 1
        prompt = reqs.prompt[rid]
        if prompt + reqs.output[rid] > d.max_len:
            reqs.status[rid] = eng.TOO_LONG  # 400: the engine refuses a request longer than the model/pool
            reqs.t_done[rid] = t
            return
        reqs.need[rid] = prompt
        reqs.ctx[rid] = prompt
        routable = d.routable
        entry = "prefill" if "prefill" in routable else "colocated"
        if entry == "prefill" and prompt < d.pd_min_prompt_tokens and routable["decode"].replicas:
            entry = "decode"  # the decode worker computes the prompt itself, as the real router sends it
            d.short_prompts += 1
        rep = self.router.pick(entry, routable[entry], t)
        if rep is None:
            self._reject(d, rid, t)
        elif rep.perf.http_hop_s > 0:
            # client -> router -> worker: two HTTP hops before the engine sees it; `inflight` tells the
            # router's next picks (and keeps a draining replica) that it is on its way
            rep.add_inflight(1)
            self._push(t + 2 * rep.perf.http_hop_s, ENTER, rid, rep)
        elif not rep.enqueue(rid, t):
            self._reject(d, rid, t)

    def _enter(self, rid: int, rep: eng.Replica, t: float) -> None:
        rep.add_inflight(-1)
        if not rep.enqueue(rid, t):
            self._reject(self.deps[rep.deployment], rid, t)

    def _reject(self, d: DeploymentState, rid: int, t: float) -> None:
        self.reqs.status[rid] = eng.REJECTED  # 503 (no worker, or its queue is full)
        self.reqs.t_done[rid] = t
        d.errors += 1

    def _prefilled(self, rep: eng.Replica, rid: int, t: float) -> None:
        """A prompt is done (first token out): finish a one-token request, else hand its KV to decode."""
        reqs = self.reqs
        if reqs.gen[rid] >= reqs.output[rid]:
            self._done(rid, t)
            return
        d = self.deps[rep.deployment]
        pool = d.routable.get("decode")
        dst = self.router.pick("decode", _NO_POOL if pool is None else pool, t)
        if dst is None:
            self._reject(d, rid, t)
            return
        prompt = reqs.prompt[rid]
        rep.hold(prompt)
        dst.add_inflight(1)
        # the router's call to the decode worker (one HTTP hop), then the pull
        delay = dst.perf.http_hop_s + perf_model.kv_transfer_s(
            prompt, rep.perf, dst.perf, self.settings.kv_transfer_latency_s
        )
        self._push(t + delay, TRANSFER, rid, (rep, dst))

    def _transferred(self, rid: int, src: eng.Replica, dst: eng.Replica, t: float) -> None:
        reqs = self.reqs
        prompt = reqs.prompt[rid]
        src.release(prompt, t)
        reqs.need[rid] = 0
        reqs.ctx[rid] = prompt + reqs.gen[rid]
        dst.receive(rid, t)
        if src.draining and src.removed_at is None and src.idle():
            self._remove(src, t)
        if dst.draining and dst.removed_at is None and dst.idle():
            self._remove(dst, t)

    def _done(self, rid: int, t: float) -> None:
        self.reqs.status[rid] = eng.DONE
        self.reqs.t_done[rid] = t

    # --- the loop ---------------------------------------------------------------------------------------------
    def run(self) -> "Simulator":
        horizon = self.trace.duration
        for d in self.deps:
            self._plan(d, None, 0.0, warm=True)
            self._push(d.interval_s, DECIDE, d)
        self._push(0.0, SCRAPE, None)
        self._push(self.warmup, WARMUP, None)
        arrivals = self.reqs.arrival + [math.inf]  # NOTE: a sentinel after the last arrival
        n, i = len(self.reqs), 0
        t_arr = arrivals[0]
        heap = self.heap
        pop = heapq.heappop
        arrive = self._arrive
        stop = horizon + self.settings.drain_timeout_s
        while True:
            if heap and heap[0][0] <= t_arr:
                t, _, kind, a, b = pop(heap)
                if t > stop:
                    break
                self.now = t
                if kind == REPLICA:
                    # else stale: the replica rescheduled since; a draining replica that went idle was removed then
                    if b == a.version:  # type: ignore[union-attr]
                        a.on_event(t)  # type: ignore[union-attr]
                        if a.draining and a.removed_at is None and a.idle():  # type: ignore[union-attr]
                            self._remove(a, t)  # type: ignore[arg-type]
                elif kind == TRANSFER:
                    src, dst = b  # type: ignore[misc]
                    self._transferred(a, src, dst, t)  # type: ignore[arg-type]
                elif kind == ENTER:
                    self._enter(a, b, t)  # type: ignore[arg-type]
                elif kind == READY:
                    if a.removed_at is None:  # type: ignore[union-attr]
                        self._route_table(self.deps[a.deployment])  # type: ignore[union-attr]
                elif kind == SCRAPE:
                    for d in self.deps:
                        d.source.scrape(t)
                        self._analyze_rollback(d, t)
                    if t + self.settings.scrape_interval_s <= horizon:
                        self._push(t + self.settings.scrape_interval_s, SCRAPE, None)
                elif kind == DECIDE:
                    self._decide(a, t)  # type: ignore[arg-type]
                    self.decisions += t >= self.warmup
                    nxt = t + a.interval_s  # type: ignore[union-attr]
                    if nxt <= horizon:
                        self._push(nxt, DECIDE, a)
                elif kind == WARMUP:
                    self._start_measuring(t)
                    self._push(t, SAMPLE, None)
                elif kind == SAMPLE:
                    self._sample(t)
                    if self.progress:
                        self.progress(min(t, horizon))
                    if self.watch is not None and self.watch.unreachable():
                        self.stopped = self.watch.stopped(t)
                        break
                    if t + self.settings.sample_interval_s <= horizon:
                        self._push(t + self.settings.sample_interval_s, SAMPLE, None)
                if i >= n and not self._in_flight():
                    break
            elif i < n:
                self.now = t_arr
                arrive(i, t_arr)
                i += 1
                t_arr = arrivals[i]
            else:
                break
        self.end = max(horizon, self.now)
        for rid, status in enumerate(self.reqs.status):
            if status == eng.ACTIVE:
                self.reqs.status[rid] = eng.UNFINISHED
        self._sample(self.end)
        return self

    def _start_measuring(self, t: float) -> None:
        self.gen_at_warmup = sum(r.gen_tokens for r in self.all_replicas)
        for d in self.deps:
            d.itl.counts = [0.0] * len(d.itl.counts)
            d.itl.total = 0.0
        for r in self.all_replicas:
            r.busy_s = 0.0
        self.scale_events = [e for e in self.scale_events if e.t >= t]
        self.decisions = 0
        for d in self.deps:
            d.rollback_actions = [a for a in d.rollback_actions if a[0] >= t]

    def _in_flight(self) -> bool:
        return any(r.waiting or r.prefilling or r.B or r.inflight for d in self.deps for r in d.replicas) or any(
            k == TRANSFER or k == ENTER for _, _, k, _, _ in self.heap
        )

    def _cost_rate(self) -> float:
        """$/h of every pod holding accelerators now (starting and draining pods are billed too)."""
        total = 0.0
        for d in self.deps:
            for r in d.replicas:
                cls = self.classes[r.accelerator_class]
                total += cls.count * cls.cost_per_hour
        return total

    def _sample(self, t: float) -> None:
        replicas: dict[str, int] = {}
        ready: dict[str, int] = {}
        waiting: dict[str, float] = {}
        running: dict[str, float] = {}
        for d in self.deps:
            for role in d.spec.roles():
                waiting[f"{d.name}/{role}"] = 0.0
                running[f"{d.name}/{role}"] = 0.0
            for r in d.replicas:
                key = f"{d.name}/{r.role}/{r.accelerator_class}"
                replicas[key] = replicas.get(key, 0) + 1
                if t >= r.ready_at and not r.draining:
                    ready[key] = ready.get(key, 0) + 1
                waiting[f"{d.name}/{r.role}"] += len(r.waiting)
                running[f"{d.name}/{r.role}"] += r.num_running()
        generated = sum(r.gen_tokens for r in self.all_replicas)
        self.samples.append(Sample(t, replicas, ready, waiting, running, self._cost_rate(), generated))
