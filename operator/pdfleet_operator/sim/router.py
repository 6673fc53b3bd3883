"""The router's picking policy in the simulator: the production `pdfleet_worker.router.picker.pick`, fed simulated loads.

The real router scores workers from their last reported load plus its own in-flight count. Here
the load is read from the simulated engines at the moment of the pick (no scrape lag), so
`inflight` carries only what the engines cannot see yet: requests whose KV is still on its way to a
decode worker. Ties go round-robin by the simulator's own counter, so runs are reproducible.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pdfleet_operator.sim.engine import Replica
from pdfleet_worker.router import picker


class Router:
    """Picks workers for one simulation with `picker.pick` (deterministic tie-breaking)."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, role: str, replicas: Sequence[Replica], now: float) -> Replica | None:
        if not replicas:
            return None
        if len(replicas) == 1:
            return replicas[0]
        by_url = {}
        candidates = []
        for r in replicas:
            by_url[r.url] = r
            candidates.append(picker.Candidate(
                url=r.url, waiting=len(r.waiting), running=r.num_running(), kv_usage=r.kv_usage(now),
                prompt_tokens_waiting=r.need_waiting, inflight=r.inflight))
        chosen = picker.pick(role, candidates, turn=next(self._turn))
        return None if chosen is None else by_url[chosen.url]
