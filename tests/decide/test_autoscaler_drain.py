"""Issue 20's decision: bursts sized by the token rate and the time to drain, headroom on the rate's floor, and
a drained role that follows its rate down after a burst (Policy.drain_sizing, Policy.drained_scale_down)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdfleet_operator.decide import autoscaler, token_rate
from pdfleet_operator.decide.autoscaler import PDFLEET, ScalerState, decide
from tests.decide.autoscaler_sim import spec
from tests.decide.test_autoscaler import RATE_ONLY, T0, rate_snapshot

WIDE = {"interval": "15s", "maxScaleUpStep": 100}


def prefill_spec(**autoscaling):
    return spec(
        prefill={
            "acceleratorClasses": ["h100"],
            "minReplicas": 1,
            "maxReplicas": 16,
            "targetQueuePerReplica": 4,
            "targetPromptTokensPerReplica": 6000,
        },
        decode={"acceleratorClasses": ["h100"], "minReplicas": 1, "maxReplicas": 24, "targetQueuePerReplica": 32},
        autoscaling={**WIDE, **autoscaling},
    )


def test_headroom_is_sized_on_the_lowest_rate_of_the_down_window():
    # 10000 tokens/s arriving, the lowest rate of the last 300 s 4000: headroom 4000 x (1/0.7 - 1)
    assert token_rate.tokens_needed(10000.0, 0.0, 0.7, floor=4000.0) == pytest.approx(10000.0 + 4000.0 * 3 / 7)
    assert token_rate.tokens_needed(10000.0, 0.0, 0.7) == pytest.approx(10000.0 / 0.7)  # no floor: issue 6's
    assert token_rate.tokens_needed(10000.0, 0.0, 0.7, floor=12000.0) == pytest.approx(10000.0 / 0.7)  # never more
    assert token_rate.tokens_needed(0.0, 90000.0, 0.7, drain_s=30.0, floor=0.0) == pytest.approx(3000.0)
    history = ((T0 - 400, 1.0, 2), (T0 - 240, 4000.0, 2), (T0 - 15, 9000.0, 3), (T0, 8000.0, 3))
    assert token_rate.rate_floor(history, T0, 300.0) == 4000.0  # the reading 400 s ago is outside the window
    assert token_rate.rate_peak(history, T0, 300.0) == 9000.0
    assert token_rate.rate_floor((), T0, 300.0) is None


def test_a_backlog_is_sized_by_its_rate_and_the_time_to_drain_not_by_the_queue_target():
    s = prefill_spec()
    state = replace(
        ScalerState.initial(s, {"prefill": 2, "decode": 2}),
        throughput={"prefill": 4000.0, "decode": 640.0},
        generation_per_prompt=0.2,
        last_queue={"prefill": (T0 - 15, 90000.0)},
    )
    # 2 saturated replicas serve 8000 tokens/s and the queue grew by 30000 in 15 s: 10000 tokens/s arrive;
    # 120000 tokens wait. The queue target asks for 120000 / 6000 = 20 replicas (16: maxReplicas).
    snap = rate_snapshot(T0, 40.0, 8000.0, 2, tokens_waiting=120000.0, decode_running=60.0, gen_rate=1200.0)
    ours, _ = decide(s, state, snap, T0, {}, policy=PDFLEET)
    p = ours["prefill"]
    # 10000 + 8000 x 3/7 (the floor is the one served rate seen) + 120000 / 60 = 15429 tokens/s: 3.86 -> 4
    assert (p.desired, p.reason) == (4, autoscaler.TOKEN_RATE_ABOVE_CAPACITY)
    assert "queue targets yield to the measured rate" in p.message
    before, _ = decide(s, state, snap, T0, {}, policy=RATE_ONLY)
    assert before["prefill"].desired == 16  # issue 6: the larger of queue target and rate wins
    # decode grows for what prefill's arrivals and its backlog will generate within drainTime:
    # 0.2 x (10000 + 2000) = 2400 tokens/s + 1200 (its floor) x 3/7 = 2914 / 640 = 4.55 -> 5
    assert ours["decode"].desired == 5
    # drainTime is the spec's: at 30 s the same backlog asks for 10000 + 3429 + 4000 = 17429 -> 5
    fast, _ = decide(prefill_spec(drainTime="30s"), state, snap, T0, {}, policy=PDFLEET)
    assert fast["prefill"].desired == 5


def test_queue_targets_still_size_a_role_whose_throughput_is_not_learned():
    s = prefill_spec()
    state = ScalerState.initial(s, {"prefill": 2, "decode": 2})
    snap = rate_snapshot(T0, 40.0, 8000.0, 2, tokens_waiting=120000.0)
    decisions, _ = decide(s, state, snap, T0, {}, policy=PDFLEET)
    assert decisions["prefill"].desired == 16 and decisions["prefill"].reason == autoscaler.MAX_REPLICAS


def _after_a_burst(policy, fall_to: float, steps: int = 44):
    """Prefill at 10 replicas through 5 minutes at 28000 tokens/s served with nothing waiting, then the
    rate falls to `fall_to`; the replicas follow the decisions at once. Returns the sizes per decision."""
    s = prefill_spec()
    state = replace(
        ScalerState.initial(s, {"prefill": 10, "decode": 2}),
        throughput={"prefill": 4000.0, "decode": 640.0},
        generation_per_prompt=0.2,
        watching_since={"prefill": T0 - 900, "decode": T0 - 900},
    )
    sizes = []
    for k in range(steps):
        t = T0 + 15 * k
        rate = 28000.0 if k < 20 else fall_to
        cur = state.replicas
        snap = rate_snapshot(t, 0.0, rate, cur["prefill"], decode_running=40.0, gen_rate=0.2 * rate)
        _, state = decide(s, state, snap, t, {}, policy=policy)
        state = ScalerState.from_json(state.to_json())
        sizes.append(state.replicas["prefill"])
    return sizes


def test_a_drained_role_follows_its_rate_down_after_a_burst():
    ours = _after_a_burst(PDFLEET, 8000.0)
    slow = _after_a_burst(replace(PDFLEET, drained_scale_down=False), 8000.0)
    assert ours[:20] == slow[:20] == [10] * 20  # 28000 + 28000 x 3/7 = 40000 tokens/s: 10 replicas
    # after the fall (8000 <= 0.7 x 28000) the 30 s window (the peak's 10, 15 s before the fall, holds
    # one more interval), then one step (maxScaleDownStep 1) per interval to 3
    assert ours[20:28] == [10, 9, 8, 7, 6, 5, 4, 3] and ours[-1] == 3
    # the 300 s window holds the peak's 10 until it has passed
    assert slow[20:39] == [10] * 19 and slow[-1] < 10


def test_a_fall_within_the_noise_keeps_the_long_window():
    # 28000 -> 21000 tokens/s is 0.75 of the peak, above DRAINED_FALL: the 300 s window holds
    assert autoscaler.DRAINED_FALL < 0.75
    sizes = _after_a_burst(PDFLEET, 21000.0)
    assert sizes[20:39] == [10] * 19
