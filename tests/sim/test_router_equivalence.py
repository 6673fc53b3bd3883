"""The simulator's router keeps scores between picks (sim/router.py); every pick must still be what `picker.pick`
chooses over every candidate built fresh."""

from __future__ import annotations

import itertools
import random

import pytest

from pdfleet_operator.sim import router as sim_router
from pdfleet_operator.sim import simulator
from pdfleet_worker.router import picker
from tests.sim.support import small
from tests.sim.test_simulator import surge


def exhaustive(role: str, replicas, now: float, turn: int):  # noqa: ANN001, ANN201
    """The pick as the router makes it: a fresh `picker.Candidate` per replica, `picker.pick` over all of them;
    with the number of candidates tied for the best score."""
    by_url = {r.url: r for r in replicas}
    cands = [
        picker.Candidate(
            url=r.url,
            waiting=len(r.waiting),
            running=r.num_running(),
            kv_usage=r.kv_usage(now),
            prompt_tokens_waiting=r.need_waiting,
            inflight=r.inflight,
        )
        for r in replicas
    ]
    scores = [picker.score(role, c) for c in cands]
    return by_url[picker.pick(role, cands, turn=turn).url], scores.count(min(scores))


class CheckedRouter(sim_router.Router):
    """Asserts that each pick with two or more replicas equals the exhaustive one at the same turn."""

    def __init__(self) -> None:
        super().__init__()
        self.checked = 0
        self.ties = 0
        self._mirror: dict = {}  # each pool's turns (kept across its rebuilds) -> a count of our own

    def pick(self, role, pool, now):  # noqa: ANN001, ANN201
        turn = next(self._mirror.setdefault(pool.turns, itertools.count()))
        got = super().pick(role, pool, now)
        replicas = pool.replicas
        if len(replicas) > 1:
            want, tied = exhaustive(role, replicas, now, turn)
            assert got is want, f"{role} pick at {now}: kept scores chose {got.url}, picker.pick {want.url}"
            self.checked += 1
            self.ties += tied > 1
        return got


class Checked(simulator.Simulator):
    def __init__(self, *a, **kw) -> None:  # noqa: ANN002, ANN003
        super().__init__(*a, **kw)
        self.router = CheckedRouter()


@pytest.mark.parametrize("inline", [True, False])
@pytest.mark.parametrize("policy", ["dynamic", "static", "colocated"])
def test_every_pick_is_picker_pick_over_fresh_candidates(policy: str, inline: bool) -> None:
    # both scoring paths: the pool's own scores (what runs when they match the picker's) and the picker's
    f = small()
    sim = Checked(f, f.policy(policy), surge(duration=600.0, low=2.0, high=30.0))
    sim.router.inline = inline
    sim.run()
    assert all(p.inline is inline for d in sim.deps for p in d.routable.values())
    assert sim.router.checked > 1000
    assert sim.router.ties > 10  # ties went through picker.pick's round-robin too


def test_the_pools_own_scores_are_used_only_while_they_match_the_pickers(monkeypatch) -> None:  # noqa: ANN001
    assert sim_router.inline_scores_ok.__wrapped__()
    real = picker.score

    def other(role: str, c: picker.Candidate) -> tuple:  # a picker that weighs in-flight requests twice
        got = real(role, c)
        return (got[0] + c.inflight, *got[1:]) if role == "prefill" else got

    monkeypatch.setattr(picker, "score", other)
    assert not sim_router.inline_scores_ok.__wrapped__()


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_a_score_never_falls_as_kv_usage_rises(role: str) -> None:
    """What lets the router keep a fluid replica's score as a lower bound (its KV only grows between events)."""
    rng = random.Random(7)
    for _ in range(2000):
        base = dict(
            url="u",
            waiting=rng.randint(0, 5),
            running=rng.randint(0, 9),
            prompt_tokens_waiting=rng.randint(0, 9999),
            inflight=rng.randint(0, 3),
        )
        lo, hi = sorted(rng.random() for _ in range(2))
        assert picker.score(role, picker.Candidate(kv_usage=lo, **base)) <= picker.score(
            role, picker.Candidate(kv_usage=hi, **base)
        )


def test_a_picker_that_breaks_ties_otherwise_is_asked_for_every_tie(monkeypatch) -> None:  # noqa: ANN001
    """The kept order (url, round-robin by turn) is checked against `picker.pick` when a Router is made; a picker
    that shares ties another way is called on the tied candidates, and every pick still equals it."""
    original = picker.pick
    calls = []

    def reversed_ties(role, candidates, turn=None):  # noqa: ANN001, ANN202
        calls.append(len(candidates))
        best = min(picker.score(role, c) for c in candidates)
        tied = sorted((c for c in candidates if picker.score(role, c) == best), key=lambda c: c.url, reverse=True)
        return tied[(turn or 0) % len(tied)]

    assert sim_router.Router().round_robin
    monkeypatch.setattr(picker, "pick", reversed_ties)
    assert not sim_router.Router().round_robin
    f = small()
    sim = Checked(f, f.policy("static"), surge(duration=300.0, low=2.0, high=20.0))
    calls.clear()
    sim.run()
    assert sim.router.ties > 10
    # every check called it once, and the router once per tie
    assert original is not picker.pick and len(calls) == sim.router.checked + sim.router.ties
