"""Issue 24, rule 10: no scale-down while requests wait, and no decision reversed within its windows (the demo's
prefill went 2 -> 1 with 37 requests waiting on a token rate learned too high, and back to 2 one interval later)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdfleet_operator.decide import autoscaler
from pdfleet_operator.decide.autoscaler import PDFLEET, ScalerState, decide
from pdfleet_operator.decide.metrics_snapshot import MetricsSnapshot, RoleMetrics
from tests.decide.autoscaler_sim import spec

T0 = 1_000_000.0
PROMPT = 64  # tokens per request (the demo's median prompt)


def demo_spec():
    """examples/local-tiny.yaml's roles and windows."""
    return spec(
        prefill={"acceleratorClasses": ["h100"], "minReplicas": 1, "maxReplicas": 2, "targetQueuePerReplica": 2},
        decode={"acceleratorClasses": ["h100"], "minReplicas": 1, "maxReplicas": 3, "targetQueuePerReplica": 4},
        autoscaling={"interval": "2s", "scaleDownStabilization": "10s", "scaleDownDelayAfterScaleUp": "5s"},
    )


def snap(
    t: float, prefill_waiting: float, prompt_rate: float, prefill: int, decode: int = 1, decode_running: float = 4.0
) -> MetricsSnapshot:
    return MetricsSnapshot(
        taken_at=t,
        source="script",
        roles={
            "prefill": RoleMetrics(
                waiting=prefill_waiting,
                running=float(prefill),
                sample_time=t,
                replicas_reporting=prefill,
                prompt_tokens_waiting=prefill_waiting * PROMPT,
                prompt_tokens_rate=prompt_rate,
            ),
            "decode": RoleMetrics(
                waiting=0.0,
                running=decode_running,
                sample_time=t,
                replicas_reporting=decode,
                generation_tokens_rate=100.0,
            ),
        },
    )


def learned_too_high(s, prefill: int = 2) -> ScalerState:
    """A prefill throughput learned while a replica had the cores to itself (an older README run measured 1,846 tokens/s
    per replica), watched for long, every recent recommendation 1: the windows let prefill shrink."""
    state = ScalerState.initial(s, {"prefill": prefill, "decode": 1})
    return replace(
        state,
        throughput={"prefill": 1846.0},
        watching_since={"prefill": T0 - 600, "decode": T0 - 600},
        recommendations={
            "prefill": tuple((T0 - k, 1) for k in (10, 8, 6, 4, 2)),
            "decode": tuple((T0 - k, 1) for k in (10, 8, 6, 4, 2)),
        },
    )


def test_the_demo_moment_37_waiting_holds_the_prefill_pool():
    s = demo_spec()
    # 37 requests wait on 2 replicas serving 300 prompt tokens/s: the learned rate says 1 replica drains them
    decisions, _ = decide(s, learned_too_high(s), snap(T0, 37.0, 300.0, 2), T0, {}, policy=PDFLEET)
    p = decisions["prefill"]
    assert (p.direction, p.desired, p.reason) == ("hold", 2, autoscaler.REQUESTS_WAITING), p
    assert "needs 1" in p.message and "37 requests waiting on 2 replicas" in p.message
    # the same moment with the queue empty: the rate's scale-down goes ahead, as before
    quiet, _ = decide(s, learned_too_high(s), snap(T0, 0.0, 300.0, 2), T0, {}, policy=PDFLEET)
    assert (quiet["prefill"].desired, quiet["prefill"].reason) == (1, autoscaler.TOKEN_RATE_BELOW_CAPACITY)


def test_below_saturation_a_scale_down_keeps_the_replicas_the_queue_needs_at_target():
    s = spec(
        prefill={"acceleratorClasses": ["h100"], "minReplicas": 1, "maxReplicas": 8, "targetQueuePerReplica": 4},
        autoscaling={"interval": "2s", "scaleDownStabilization": "10s", "maxScaleDownStep": 8},
    )
    state = replace(learned_too_high(s, prefill=6), recommendations={})
    state = replace(state, watching_since={"prefill": T0 - 600, "decode": T0 - 600})
    # 5 waiting on 6 replicas (not saturated), the rate says 1: at most down to ceil(5 / 4) = 2, and it says why
    decisions, _ = decide(s, state, snap(T0, 5.0, 300.0, 6), T0, {}, policy=PDFLEET)
    p = decisions["prefill"]
    assert (p.direction, p.desired, p.reason) == ("down", 2, autoscaler.TOKEN_RATE_BELOW_CAPACITY), p
    assert "held at 2: 5 waiting requests need 2 replicas at the target (4/replica)" in p.message
    # decode at 60 running on 4 replicas (target 16 each: 4 needed) is not shrunk by the ratio bound either
    tight = spec(autoscaling={"interval": "2s", "scaleDownStabilization": "0s", "pdRatio": {"min": 0.5, "max": 1}})
    st = replace(
        ScalerState.initial(tight, {"prefill": 1, "decode": 4}),
        watching_since={"prefill": T0 - 600, "decode": T0 - 600},
    )
    d, _ = decide(tight, st, snap(T0, 0.0, 300.0, 1, decode=4, decode_running=60.0), T0, {"prefill": 1}, policy=PDFLEET)
    assert (d["decode"].desired, d["decode"].reason) == (4, autoscaler.REQUESTS_WAITING), d["decode"]
    assert "below pdRatio.min" in d["decode"].message  # what asked for the shrink stays in the message


class Prefill:
    """A closed loop: each replica serves `per_replica` prompt tokens/s, requests of PROMPT tokens arrive at
    `arrivals(t)` per second."""

    def __init__(self, per_replica: float, arrivals):
        self.per_replica, self.arrivals, self.waiting = per_replica, arrivals, 0.0

    def advance(self, t: float, dt: float, replicas: int) -> float:
        """The prompt tokens/s served over the last dt seconds."""
        self.waiting += self.arrivals(t) * dt
        served = min(self.waiting, replicas * self.per_replica * dt / PROMPT)
        self.waiting -= served
        return served * PROMPT / dt


def replay(arrivals, learned: float, seconds: float = 240.0) -> list[tuple[float, autoscaler.ScalingDecision, float]]:
    """(seconds, prefill's decision, requests waiting) every interval, the decided sizes taking effect at once."""
    s = demo_spec()
    state = replace(learned_too_high(s), throughput={"prefill": learned})
    pool = Prefill(per_replica=120.0, arrivals=arrivals)  # the slow run measured 106-121 tokens/s per replica
    moves, t = [], T0
    while t < T0 + seconds:
        cur = dict(state.replicas)
        rate = pool.advance(t - T0, 2.0, cur["prefill"])
        decisions, state = decide(
            s, state, snap(t, round(pool.waiting), rate, cur["prefill"]), t, {}, current=cur, policy=PDFLEET
        )
        moves.append((t - T0, decisions["prefill"], pool.waiting))
        t += 2.0
    return moves


def burst_then_trickle(t: float) -> float:
    return 6.0 if t < 30 else 1.0  # 30 s at 3x what 2 replicas serve, then half of what 1 serves


@pytest.mark.parametrize("learned", [120.0, 1846.0], ids=["learned-right", "learned-alone"])
def test_a_backlog_is_drained_before_the_pool_shrinks_and_no_decision_is_reversed(learned):
    moves = replay(burst_then_trickle, learned)
    for at, d, waiting in moves:
        if d.direction == "down":
            assert round(waiting) < d.current, f"+{at:.0f}s: scaled down with {waiting:.0f} waiting: {d.message}"
    changes = [(at, d.direction) for at, d, _ in moves if d.direction != "hold"]
    print(changes)
    down_window = 10.0
    for (t1, a), (t2, b) in zip(changes, changes[1:]):
        assert not (a != b and t2 - t1 < down_window), f"a decision reversed within the window: {changes}"
    # and the trickle is left to one replica once the backlog is gone
    assert moves[-1][1].desired == 1 and moves[-1][2] < 1
