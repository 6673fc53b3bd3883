"""The router's picking policy in the simulator: the production `pdfleet_worker.router.picker`, fed simulated loads.

The real router scores workers from their last reported load plus its own in-flight count. Here
the load is read from the simulated engines at the moment of the pick (no scrape lag), so
`inflight` carries only what the engines cannot see yet: requests whose KV is still on its way to a
decode worker. Ties go round-robin by the simulator's own counter, so runs are reproducible.

A day of traffic is millions of picks over tens of workers, so scores are kept, not rebuilt on
every pick: each replica carries its last `picker.score` (of a `Load` with the fields of
`picker.Candidate`), recomputed when the replica changed (`Replica.dirty`, set on every change of
what the load reads) or, for a replica decoding fluidly, when its kept score could be the best:
its KV grows with time between its events, and `picker.score` never falls as `kv_usage` rises, so a
kept score is a lower bound of the current one. The best-scored replicas share the pick as
`picker.pick` shares it: in url order, round-robin by the turn; that rule is checked against
`picker.pick` when a `Router` is made, and a picker that breaks ties otherwise is called on the
tied candidates instead. tests/sim/test_router_equivalence.py holds every pick of whole runs equal
to `picker.pick` over fresh candidates, and the score's monotonicity in `kv_usage`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from operator import attrgetter

from pdfleet_operator.sim.engine import FLUID, Replica
from pdfleet_worker.router import picker

_SCORE = attrgetter("route_score")
_DIRTY = attrgetter("dirty")
_MODE = attrgetter("mode")
ROLES = ("prefill", "decode", "colocated")


class Load:
    """What `picker.score` reads of one replica (the fields of `picker.Candidate`), refreshed in place."""

    __slots__ = ("url", "waiting", "running", "kv_usage", "prompt_tokens_waiting", "inflight")

    def __init__(self, url: str) -> None:
        self.url = url
        self.waiting = self.running = self.prompt_tokens_waiting = self.inflight = 0
        self.kv_usage = 0.0

    def candidate(self) -> picker.Candidate:
        return picker.Candidate(url=self.url, waiting=self.waiting, running=self.running, kv_usage=self.kv_usage,
                                prompt_tokens_waiting=self.prompt_tokens_waiting, inflight=self.inflight)


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


class Router:
    """Picks workers for one simulation with `picker.score` and `picker.pick`'s tie rule (deterministic turns).

    The replicas handed to `pick` are in url order (`Simulator._route_table` keeps them so).
    """

    def __init__(self) -> None:
        self._turn = itertools.count()
        self.round_robin = ties_round_robin_by_url()

    def pick(self, role: str, replicas: Sequence[Replica], now: float) -> Replica | None:
        if not replicas:
            return None
        if len(replicas) == 1:
            return replicas[0]
        turn = next(self._turn)
        for r in filter(_DIRTY, replicas):
            _rescore(r, now)
        scores = list(map(_SCORE, replicas))
        best = min(scores)
        i = scores.index(best)
        first = replicas[i]
        while first.mode == FLUID and first.route_at < now:
            _rescore(first, now)  # its KV grew since it was scored: the score may have risen
            scores[i] = first.route_score
            best = min(scores)
            i = scores.index(best)
            first = replicas[i]
        if scores.count(best) == 1:
            return first
        tied = [r for r, s in zip(replicas, scores) if s == best]
        if FLUID in map(_MODE, tied):
            for r in tied:
                if r.mode == FLUID and r.route_at < now:
                    _rescore(r, now)
            tied = [r for r in tied if r.route_score == best]
            if len(tied) == 1:
                return tied[0]
        if self.round_robin:
            return tied[turn % len(tied)]
        chosen = picker.pick(role, [r.load.candidate() for r in tied], turn=turn)
        return next(r for r in tied if r.url == chosen.url)  # type: ignore[union-attr]


def _rescore(r: Replica, now: float) -> None:
    """The replica's score now, from what `picker.score` reads (exact now; a lower bound later while it is fluid)."""
    load = r.load
    if load is None:
        load = r.load = Load(r.url)
    load.waiting = len(r.waiting)
    load.running = r.B + len(r.prefilling)
    load.kv_usage = r.kv_usage(now)
    load.prompt_tokens_waiting = r.need_waiting
    load.inflight = r.inflight
    r.route_score = picker.score(r.role, load)  # type: ignore[arg-type]
    r.route_at = now
    r.dirty = False
