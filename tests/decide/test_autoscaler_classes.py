"""Token-rate sizing of a role spread over AcceleratorClasses of different speed: throughput learned per class."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pdfleet_operator.decide import autoscaler
from pdfleet_operator.decide.autoscaler import ScalerState, decide
from pdfleet_operator.decide.metrics_snapshot import ClassMetrics, MetricsSnapshot, RoleMetrics
from tests.decide.autoscaler_sim import spec

T0 = 1_000_000.0
# Rate sizing only, at full utilization: the replicas asked for are exactly what serves the tokens.
EXACT = autoscaler.Policy(
    prefill_lookahead=False, queue_trend=False, token_rate=True, ratio_bounds=False, utilization=1.0
)
RATE_ONLY = autoscaler.Policy(prefill_lookahead=False, queue_trend=False, token_rate=True, ratio_bounds=False)
# Prefill's replicas: 2 on a fast class, then a slow class, as placement fills them.
ORDER = {"prefill": (("fast", 2), ("slow", 20)), "decode": (("fast", 16),)}


def mixed_spec():
    return spec(
        prefill={
            "acceleratorClasses": ["fast", "slow"],
            "minReplicas": 1,
            "maxReplicas": 22,
            "targetQueuePerReplica": 4,
        },
        autoscaling={
            "interval": "15s",
            "maxScaleUpStep": 100,
            "scaleDownStabilization": "0s",
            "scaleDownDelayAfterScaleUp": "0s",
        },
    )


def prefill_snapshot(t, fast, slow, *, tokens_waiting=0.0, classes=True):
    """2 fast + 2 slow prefill replicas; `fast`/`slow` are (waiting requests, prompt tokens/s served)."""
    by_class = {
        "fast": ClassMetrics(replicas_reporting=2, waiting=fast[0], prompt_tokens_rate=fast[1]),
        "slow": ClassMetrics(replicas_reporting=2, waiting=slow[0], prompt_tokens_rate=slow[1]),
    }
    return MetricsSnapshot(
        taken_at=t,
        source="script",
        roles={
            "prefill": RoleMetrics(
                waiting=fast[0] + slow[0],
                running=4.0,
                replicas_reporting=4,
                sample_time=t,
                prompt_tokens_waiting=tokens_waiting,
                prompt_tokens_rate=fast[1] + slow[1],
                classes=by_class if classes else {},
            ),
            "decode": RoleMetrics(waiting=0.0, running=16.0, replicas_reporting=1, sample_time=t),
        },
    )


def learned_state(s):
    """Both classes saturated for a minute: the fast replicas serve 4000 tokens/s each, the slow 1000."""
    state = replace(
        ScalerState.initial(s, {"prefill": 4, "decode": 1}), watching_since={"prefill": T0 - 600, "decode": T0 - 600}
    )
    for k in range(5):
        t = T0 + 15 * k
        _, state = decide(
            s,
            state,
            prefill_snapshot(t, (2.0, 8000.0), (2.0, 2000.0)),
            t,
            {},
            current={"prefill": 4, "decode": 1},
            policy=RATE_ONLY,
            order=ORDER,
        )
    return state, T0 + 60


def test_each_class_learns_its_own_throughput_when_both_saturate():
    state, _ = learned_state(mixed_spec())
    assert state.class_throughput["prefill"] == pytest.approx({"fast": 4000.0, "slow": 1000.0})
    assert "prefill" not in state.throughput  # the role as a whole is learned only without a breakdown
    assert set(state.class_samples["prefill"]) == {"fast", "slow"}


def test_a_mixed_pool_asks_for_the_replicas_its_classes_serve():
    s = mixed_spec()
    state, t = learned_state(s)
    state = replace(state, last_queue={"prefill": (t, 0.0)})
    now = t + 15
    # both classes saturated at 10000 tokens/s while 60000 tokens queued in 15 s: 14000 tokens/s arrive,
    # plus 1000 tokens/s to drain the queue within a minute: 15000 tokens/s to serve
    snap = prefill_snapshot(now, (2.0, 8000.0), (2.0, 2000.0), tokens_waiting=60000.0)
    decisions, _ = decide(s, state, snap, now, {}, current={"prefill": 4, "decode": 1}, policy=EXACT, order=ORDER)
    p = decisions["prefill"]
    # the 2 fast replicas serve 8000; the next replicas land on the slow class: 7 of them serve the rest
    assert (p.desired, p.reason) == (9, autoscaler.TOKEN_RATE_ABOVE_CAPACITY)
    assert 2 * 4000 + (p.desired - 2) * 1000 == 15000
    assert "fast 4000, slow 1000" in p.message
    # one throughput for the whole pool (the mean of what runs now) would ask for 15000 / 2500 = 6,
    # which serve 2 x 4000 + 4 x 1000 = 12000: what it does without placement's order
    blind, _ = decide(s, state, snap, now, {}, current={"prefill": 4, "decode": 1}, policy=EXACT)
    assert blind["prefill"].desired == 6


def test_a_slow_class_backlog_does_not_teach_the_fast_class_the_demand():
    s = mixed_spec()
    state, t = learned_state(s)
    # demand of 5000 tokens/s: the slow replicas are saturated (2 waiting each), the fast ones have room
    cur = {"prefill": 4, "decode": 1}
    for k in range(1, 6):
        now = t + 15 * k
        decisions, state = decide(
            s,
            state,
            prefill_snapshot(now, (0.0, 3000.0), (4.0, 2000.0)),
            now,
            {},
            current=cur,
            policy=RATE_ONLY,
            order=ORDER,
        )
    assert state.class_throughput["prefill"] == pytest.approx({"fast": 4000.0, "slow": 1000.0})
    # 5000 / 0.7 = 7143 tokens/s: 2 fast replicas (8000) are enough
    assert decisions["prefill"].desired <= 4
    # the same numbers without the breakdown: the role saturated at 5000 over 4 replicas teaches 1250
    # per replica, and the rate asks for 5000 / (1250 x 0.7) = 5.7 -> 6, more at every window
    whole = replace(ScalerState.initial(s, cur), watching_since={"prefill": T0 - 600, "decode": T0 - 600})
    for k in range(6):
        now = t + 15 * k
        grown, whole = decide(
            s,
            whole,
            prefill_snapshot(now, (0.0, 3000.0), (4.0, 2000.0), classes=False),
            now,
            {},
            current=cur,
            policy=RATE_ONLY,
            order=ORDER,
        )
    assert whole.throughput["prefill"] == pytest.approx(1250.0)
    assert grown["prefill"].desired == 6


def test_state_in_the_old_format_loads_and_sizes_unlearned_classes():
    s = mixed_spec()
    old = json.dumps(
        {
            "replicas": {"prefill": 4, "decode": 1},
            "recommendations": {},
            "lastScaleUp": {},
            "watchingSince": {"prefill": T0 - 600, "decode": T0 - 600},
            "lastNeed": {},
            "throughput": {"prefill": 2500.0},
            "samples": {"prefill": [[T0 - 15, 4, False]]},
            "lastQueue": {},
            "generationPerPrompt": None,
        }
    )
    state = ScalerState.from_json(old)
    assert state.throughput == {"prefill": 2500.0} and state.samples["prefill"] == ((T0 - 15, 4, False),)
    assert state.class_throughput == {} and state.class_samples == {}
    assert ScalerState.from_json(state.to_json()) == state
    # the old single number sizes classes not learned yet: 10000 tokens/s at 2500 each -> 4
    decisions, new = decide(
        s,
        state,
        prefill_snapshot(T0, (0.0, 6000.0), (0.0, 4000.0)),
        T0,
        {},
        current={"prefill": 4, "decode": 1},
        policy=EXACT,
        order=ORDER,
    )
    assert decisions["prefill"].desired == 4 and "2500 tokens/s per saturated replica" in decisions["prefill"].message
    assert new.throughput == {"prefill": 2500.0}
    assert set(new.class_samples["prefill"]) == {"fast", "slow"} and "prefill" not in new.samples
    assert ScalerState.from_json(new.to_json()) == new


def test_replicas_for_takes_replicas_in_placement_order():
    assert autoscaler.replicas_for(9000.0, (4000.0, 4000.0, 1000.0)) == pytest.approx(3.0)
    assert autoscaler.replicas_for(10000.0, (4000.0, 4000.0, 1000.0)) == pytest.approx(4.0)  # more of the last
    assert autoscaler.replicas_for(2000.0, (4000.0, 1000.0)) == pytest.approx(0.5)
    assert autoscaler.replicas_for(0.0, (4000.0,)) == 0.0
    with pytest.raises(ValueError, match="must be > 0"):
        autoscaler.replicas_for(1.0, (4000.0, 0.0))


def decode_snapshot(t, *, waiting, kv, running=40.0):
    """2 decode replicas of one class, requests waiting on them, serving 1000 generated tokens/s."""
    by_class = {"fast": ClassMetrics(replicas_reporting=2, waiting=waiting, generation_tokens_rate=1000.0)}
    return MetricsSnapshot(
        taken_at=t,
        source="script",
        roles={
            "prefill": RoleMetrics(
                waiting=0.0, running=1.0, replicas_reporting=1, sample_time=t, prompt_tokens_rate=500.0
            ),
            "decode": RoleMetrics(
                waiting=waiting,
                running=running,
                replicas_reporting=2,
                sample_time=t,
                kv_usage=kv,
                generation_tokens_rate=1000.0,
                classes=by_class,
            ),
        },
    )


def decode_learned(kv, running=40.0, max_num_seqs=256):
    s = spec(engine={"maxNumSeqs": max_num_seqs})
    state = replace(
        ScalerState.initial(s, {"prefill": 1, "decode": 2}), watching_since={"prefill": T0 - 600, "decode": T0 - 600}
    )
    for k in range(5):
        t = T0 + 15 * k
        _, state = decide(
            s,
            state,
            decode_snapshot(t, waiting=4.0, kv=kv, running=running),
            t,
            {},
            current={"prefill": 1, "decode": 2},
            policy=RATE_ONLY,
        )
    return state.class_throughput.get("decode", {}).get("fast")


def test_decode_waiting_with_free_kv_is_not_saturation():
    """In PD a request waits on decode while its KV is pulled: a backlog on replicas with room is not what
    they can serve (learned as such, the token rate over-provisioned the simulated mixed fleet 2-3x)."""
    assert decode_learned(kv=0.10) is None
    assert decode_learned(kv=0.85) == pytest.approx(500.0)  # KV used up: the backlog is real
    assert decode_learned(kv=0.10, running=2 * 240, max_num_seqs=256) == pytest.approx(500.0)  # seats used up
    assert decode_learned(kv=None) == pytest.approx(500.0)  # a source without KV usage: waiting decides
