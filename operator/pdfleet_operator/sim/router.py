"""The router's picking policy for the simulator: shortest prefill queue, lowest decode KV usage.

NOTE: a mirror. Issue 4's router (`pdfleet_worker.router`) documents this policy but exposes no
torch-free pure function to import yet; when it does, call it from here instead of these lines, so
that the simulator keeps running the production policy.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdfleet_operator.sim.engine import Replica


def pick_prefill(candidates: Sequence[Replica], now: float) -> Replica | None:
    """The entry worker (prefill or colocated) with the shortest queue; KV usage breaks ties."""
    best, best_key = None, None
    for r in candidates:
        key = (len(r.waiting) + len(r.prefilling), r.kv_usage(now))
        if best_key is None or key < best_key:
            best, best_key = r, key
    return best


def pick_decode(candidates: Sequence[Replica], now: float) -> Replica | None:
    """The decode worker with the lowest KV usage, counting KV already on its way to it."""
    best, best_use = None, 0.0
    for r in candidates:
        use = (r.kv_used(now) + r.inflight) / r.perf.kv_capacity_tokens
        if best is None or use < best_use:
            best, best_use = r, use
    return best
