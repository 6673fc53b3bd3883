"""The router's picking policy in the simulator: the production `pdfleet_worker.router.picker`, fed simulated loads.

The real router scores workers from their last reported load plus its own in-flight count. Here
the load is read from the simulated engines at the moment of the pick (no scrape lag), so
`inflight` carries only what the engines cannot see yet: requests whose KV is still on its way to a
decode worker. Ties go round-robin by the simulator's own counter, so runs are reproducible.

A day of traffic is millions of picks over tens of workers, so scores are kept, not rebuilt on
every pick: each replica carries its last `picker.score` (the pool computes the tuple itself where
`inline_scores_ok` finds it equal to the picker's, else hands a `Load` with the fields of
`picker.Candidate` to `picker.score`), recomputed when the replica changed (`Replica.dirty`, set on every change of
what the load reads) or, for a replica decoding fluidly, when its kept score could be the best:
its KV grows with time between its events, and `picker.score` never falls as `kv_usage` rises, so a
kept score is a lower bound of the current one. The best-scored replicas share the pick as
`picker.pick` shares it: in url order, round-robin by the pool's own turn (the router keeps one per
pool); that rule is checked against `picker.pick` when a `Router` is made, and a picker that breaks
ties otherwise is called on the tied candidates instead. tests/sim/test_router_equivalence.py holds
every pick of whole runs equal to `picker.pick` over fresh candidates, and the score's monotonicity
in `kv_usage`.
"""

from __future__ import annotations

import functools
import itertools
import random
from bisect import insort
from collections import deque
from collections.abc import Iterator, Sequence
from operator import attrgetter
from typing import Any

from pdfleet_operator.sim.engine import FLUID, Replica, Requests
from pdfleet_operator.sim.perf_model import ReplicaPerf
from pdfleet_operator.sim.stats import Histogram
from pdfleet_worker.router import picker

try:
    from mypy_extensions import mypyc_attr
except ImportError:  # interpreted where mypy is not installed: mypyc's marker has nothing to mark

    def mypyc_attr(*_: object, **__: object):  # type: ignore[no-redef,misc]  # noqa: ANN201
        return lambda cls: cls


_URL = attrgetter("url")
ROLES = ("prefill", "decode", "colocated")


class Load:
    """What `picker.score` reads of one replica (the fields of `picker.Candidate`), refreshed in place."""

    __slots__ = ("url", "waiting", "running", "kv_usage", "prompt_tokens_waiting", "inflight")

    def __init__(self, url: str) -> None:
        self.url = url
        self.waiting = self.running = self.prompt_tokens_waiting = self.inflight = 0
        self.kv_usage = 0.0


def ties_round_robin_by_url() -> bool:
    """Whether `picker.pick` gives equal-scored candidates out in url order, one per turn (probed, every role)."""
    urls = ["sim://c", "sim://a", "sim://d", "sim://b"]
    for role in ROLES:
        cands = [picker.Candidate(url=u) for u in urls]
        order = sorted(urls)
        for turn in range(3 * len(urls)):
            if picker.pick(role, cands, turn=turn).url != order[turn % len(urls)]:  # type: ignore[union-attr]
                return False
    return True


def _candidate(r: Replica, now: float) -> picker.Candidate:
    """What the real router would know of the replica now."""
    return picker.Candidate(
        url=r.url,
        waiting=len(r.waiting),
        running=r.B + len(r.prefilling),
        kv_usage=r.kv_usage(now),
        prompt_tokens_waiting=r.need_waiting,
        inflight=r.inflight,
    )


def _ignore(*_: object) -> None:
    """The probe's replicas' event and hand-off callbacks: they never step."""


@functools.cache
def inline_scores_ok(trials: int = 3000) -> bool:
    """Whether `Pool.rescore`'s own scores equal `picker.score` over fresh candidates: replicas in every role with
    random queues, batches, KV (usage on both sides of each rounding step and past full, fluid or not). A picker
    that scores otherwise leaves the pools on the generic path (a `Load` handed to `picker.score`)."""
    rng = random.Random(20261203)
    # real objects (compiled, the simulator's classes take no stand-ins); only what the score reads matters
    perf = ReplicaPerf("probe", 0.0, 0.0, 0.0, 0.0, 1000, 0.0, 0.0, 512, 256, 16)
    reqs, seq, itl = Requests([], [], [], []), itertools.count(), Histogram()
    pool = Pool(inline=True)
    for i in range(trials):
        r = Replica(i, 0, ROLES[i % len(ROLES)], "probe", perf, reqs, _ignore, seq, itl, _ignore, 0, 0.0, 0.0, "probe")
        r.waiting = deque(range(rng.randint(0, 4)))
        r.prefilling = list(range(rng.randint(0, 3)))
        r.B, r.inflight, r.need_waiting = rng.randint(0, 12), rng.randint(0, 3), rng.randint(0, 5000)
        r.kv_fixed, r.S0, r.V = rng.randint(0, 400), rng.uniform(0, 400), rng.uniform(0, 60)
        r.mode, r.st, r.t_last = rng.choice((FLUID, 0)), rng.choice((0.0, 0.02)), 0.0
        # NOTE: route_score is left as made (()): assigned here, mypy would take it for an empty tuple below
        r.dirty, r.grouped, r.pool = True, False, pool
        now = rng.uniform(0, 2)
        pool.rescore(r, now)
        if r.route_score != picker.score(r.role, _candidate(r, now)):
            return False
        pool.groups.clear()
        pool.low = None
        r.grouped = False
    return True


class Pool:
    """One role's routable replicas of one deployment, in url order, and their kept scores grouped by score: a pick
    reads the lowest group. Replicas that changed (`Replica.touch`) wait in `touched` and are rescored at the next
    pick."""

    __slots__ = ("replicas", "groups", "low", "touched", "inline", "turns")

    def __init__(self, replicas: Sequence[Replica] = (), *, inline: bool, turns: Iterator[int] | None = None) -> None:
        # the pool's own round-robin turns, kept across its rebuilds (`turns`), as the router keeps each pool's
        # (Upstreams.pick): one counter shared by a request's prefill and decode picks would hand the prefill pool
        # only even turns, and two tied prefill replicas would see every request go to the same one
        self.turns = itertools.count() if turns is None else turns
        # scores computed in rescore itself, where the Router found them equal to `picker.score`'s (`inline_scores_ok`)
        self.inline = inline
        self.replicas = sorted(replicas, key=_URL)
        self.groups: dict[tuple, list[Replica]] = {}  # kept score -> replicas with it, url order
        # the lowest key of `groups`, or None when it must be looked up again (its group emptied): kept as scores
        # come and go, so that a pick does not take min() over every group
        self.low: tuple | None = None
        self.touched: list[Replica] = []
        for r in self.replicas:
            r.pool = self
            r.grouped = False
            if r.dirty or not r.route_score:
                self.touched.append(r)
            else:
                self._insert(r)

    def __len__(self) -> int:
        return len(self.replicas)

    def __iter__(self) -> Iterator[Replica]:
        return iter(self.replicas)

    def detach(self) -> None:
        """No longer the routing table: its replicas report changes to no pool until the next one takes them."""
        for r in self.replicas:
            if r.pool is self:
                r.pool = None

    def rescore(self, r: Replica, now: float) -> None:
        """The replica's score now, from what `picker.score` reads (exact now; a lower bound later while it is
        fluid), and its place among the groups."""
        # NOTE: what it reads of the replica, read here (Replica.kv_usage inlined): four rescores per request
        role = r.role
        if self.inline:
            # `picker.score` of the Load below, spelt out (a day is millions of rescores; the picker's
            # KV usage only matters to decode and colocated); `inline_scores_ok` holds the two equal
            queued = len(r.waiting) + r.inflight
            running = r.B + len(r.prefilling)
            if role == "prefill":
                score: tuple[Any, ...] = (queued, r.need_waiting, running)
            else:
                v = r.V
                if r.mode == FLUID and r.st > 0:
                    v += (now - r.t_last) / r.st
                usage = (r.kv_fixed + r.S0 + r.B * v) / r.perf.kv_capacity_tokens
                usage = round(usage if usage < 1.0 else 1.0, 2)
                score = (usage, running + queued) if role == "decode" else (queued + running, usage)
        else:
            load = r.load
            if load is None:
                load = r.load = Load(r.url)
            load.waiting = len(r.waiting)
            load.running = r.B + len(r.prefilling)
            v = r.V
            if r.mode == FLUID and r.st > 0:
                v += (now - r.t_last) / r.st
            usage = (r.kv_fixed + r.S0 + r.B * v) / r.perf.kv_capacity_tokens
            load.kv_usage = usage if usage < 1.0 else 1.0
            load.prompt_tokens_waiting = r.need_waiting
            load.inflight = r.inflight
            score = picker.score(role, load)  # type: ignore[arg-type]
        r.route_at = now
        r.dirty = False
        groups = self.groups
        if r.grouped:
            old = r.route_score
            if score == old:
                return
            group = groups[old]
            if len(group) == 1:
                del groups[old]
                if old == self.low:
                    self.low = None
            else:
                group.remove(r)
        r.route_score = score
        into = groups.get(score)  # NOTE: _insert inlined
        if into is None:
            groups[score] = [r]
            low = self.low
            if low is not None and score < low:
                self.low = score
        else:
            insort(into, r, key=_URL)
        r.grouped = True

    def lowest(self) -> list[Replica]:
        """The group of the lowest kept score."""
        low = self.low
        if low is None:
            low = self.low = min(self.groups)
        return self.groups[low]

    def _insert(self, r: Replica) -> None:
        group = self.groups.get(r.route_score)
        if group is None:
            self.groups[r.route_score] = [r]
            if self.low is not None and r.route_score < self.low:
                self.low = r.route_score
        else:
            insort(group, r, key=_URL)
        r.grouped = True


# tests subclass it to check every step (compiled, a class says so to be subclassed)
@mypyc_attr(allow_interpreted_subclasses=True)
class Router:
    """Picks workers for one simulation with `picker.score` and `picker.pick`'s tie rule (deterministic turns)."""

    def __init__(self, inline: bool | None = None) -> None:
        self.round_robin = ties_round_robin_by_url()
        # whether the pools compute scores themselves (`Pool.inline`; None: where they match the picker's)
        self.inline = inline_scores_ok() if inline is None else inline

    def pick(self, role: str, pool: Pool, now: float) -> Replica | None:
        turn = next(pool.turns)
        replicas = pool.replicas
        if len(replicas) < 2:
            return replicas[0] if replicas else None
        touched = pool.touched
        if touched:
            rescore = pool.rescore
            for r in touched:
                rescore(r, now)
            touched.clear()
        while True:
            group = pool.lowest()
            for r in group:
                if r.mode == FLUID and r.route_at < now:
                    break
            else:
                break
            # their KV grew since they were scored: the score may have risen
            for r in [r for r in group if r.mode == FLUID and r.route_at < now]:
                pool.rescore(r, now)
        if len(group) == 1:
            return group[0]
        if self.round_robin:
            return group[turn % len(group)]
        chosen = picker.pick(role, [_candidate(r, now) for r in group], turn=turn)
        return next(r for r in group if r.url == chosen.url)  # type: ignore[union-attr]
