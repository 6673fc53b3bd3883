"""Which worker gets a request (pure): prefill by shortest queue, decode by lowest KV usage, colocated by least load;
the router calls pick()."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Candidate:
    """What the router knows about one healthy worker: its last reported load and its own in-flight count."""

    url: str
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    prompt_tokens_waiting: int = 0
    inflight: int = 0  # requests this router sent and not finished (the report lags behind them)


def score(role: str, c: Candidate) -> tuple:
    queued = c.waiting + c.inflight
    if role == "prefill":
        return (queued, c.prompt_tokens_waiting, c.running)
    if role == "decode":
        # NOTE: usage rounded to 1% so that near-equal pools fall through to the request count
        # (and round-robin), instead of piling onto the one that was 0.1% emptier a second ago.
        return (round(c.kv_usage, 2), c.running + queued)
    return (queued + c.running, round(c.kv_usage, 2))


_turn = itertools.count()


def pick(role: str, candidates: Sequence[Candidate], turn: int | None = None) -> Candidate | None:
    """The best candidate for the role; ties go round-robin (by `turn`, else a global counter).

    NOTE: a caller that picks for several pools passes each pool its own turns (Upstreams.pick does). One counter
    shared by a PD request's prefill pick and decode pick hands the prefill pool only even turns: with two tied
    prefill workers, every request would land on the same one."""
    if not candidates:
        return None
    scored = sorted(candidates, key=lambda c: (score(role, c), c.url))
    best = score(role, scored[0])
    tied = [c for c in scored if score(role, c) == best]
    return tied[(next(_turn) if turn is None else turn) % len(tied)]
