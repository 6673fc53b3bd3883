"""The autoscaler's pure decision over scripted metric series on a simulated clock."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from pdfleet_operator.decide import autoscaler, token_rate
from pdfleet_operator.decide.autoscaler import ScalerState, decide
from pdfleet_operator.decide.metrics_snapshot import MetricsSnapshot, RoleMetrics
from tests.decide.autoscaler_sim import direction_changes, first, simulate, snapshot, spec

T0 = 1_000_000.0


def steady(prefill: float = 4.0, decode: float = 16.0, **extra):
    """A script whose total queues are constant (prefill waiting, decode running)."""
    return lambda t, cur: {"prefill": {"waiting": prefill, **extra}, "decode": {"running": decode}}


def one(s, roles, replicas, now=T0, state=None, capacity=None):
    state = state or ScalerState.initial(s, replicas)
    return decide(s, state, snapshot(now, roles, replicas), now, capacity or {})


# --- the must-haves --------------------------------------------------------------------


def test_prefill_queue_surge_scales_prefill_within_one_interval():
    s = spec()
    surge_at = 60.5

    def script(t, cur):
        waiting = 40.0 if t >= surge_at else 4.0 * cur["prefill"]
        return {"prefill": {"waiting": waiting}, "decode": {"running": 16.0 * cur["decode"]}}

    steps = simulate(s, script, 300, replicas={"prefill": 1, "decode": 1})
    before = [st for st in steps if st.t < surge_at]
    assert all(st.decisions["prefill"].direction == "hold" for st in before)
    up = first(steps, "prefill", lambda d: d.direction == "up")
    assert up is not None and up.t - surge_at <= s.interval_seconds()
    assert up.decisions["prefill"].reason == autoscaler.QUEUE_GROWING  # 1 -> 10 replicas' worth in one interval
    assert up.replicas["prefill"] == 5  # 1 + maxScaleUpStep 4 toward the 19 the growing queue asks for
    assert "+4 this interval" in up.decisions["prefill"].message
    # the next interval goes on toward ceil(40 / 4) = 10
    assert max(st.replicas["prefill"] for st in steps) == 8  # maxReplicas


def test_surge_at_prefill_grows_decode_in_the_same_interval():
    s = spec()
    # prefill has 2 replicas carrying 8 waiting (its target); 40 more arrive at once
    steps = simulate(
        s,
        lambda t, cur: {"prefill": {"waiting": 8.0 if t < 30 else 48.0}, "decode": {"running": 32.0}},
        120,
        replicas={"prefill": 2, "decode": 2},
    )
    at = next(st for st in steps if st.t >= 30)
    assert at.decisions["prefill"].direction == "up"
    d = at.decisions["decode"]
    # decode counts the 48 - 1.1 * 8 = 39.2 requests queued at prefill beyond its tolerance: ceil(71.2 / 16) = 5
    assert (d.direction, d.desired, d.reason) == ("up", 5, autoscaler.PREFILL_BACKLOG)
    assert "queued at prefill" in d.message
    # before the surge (prefill at target) the look-ahead adds nothing
    assert all(st.decisions["decode"].direction == "hold" for st in steps if st.t < 30)


def test_long_output_workload_grows_decode_not_prefill():
    # ratio bounds wide enough that only the queues speak (1:12 is below the default 1:8)
    s = spec(autoscaling={"interval": "15s", "pdRatio": {"min": 0.05, "max": 8}})

    def script(t, cur):
        # sequences live long: decode's running set climbs 48 -> 200 over 3 minutes; prompts stay light
        running = min(200.0, 48.0 + t * (152.0 / 180.0))
        return {"prefill": {"waiting": 3.0 * cur["prefill"]}, "decode": {"running": running, "waiting": 4.0}}

    steps = simulate(s, script, 600, replicas={"prefill": 1, "decode": 3})
    assert steps[-1].replicas["decode"] == 12  # 204 / 16 = 12.75 replicas' worth is within tolerance of 12
    assert all(st.decisions["decode"].direction in ("up", "hold") for st in steps)
    assert all(st.decisions["prefill"].direction != "up" for st in steps)
    assert steps[-1].replicas["prefill"] == 1


def test_short_prompt_workload_shrinks_prefill_toward_min():
    s = spec()
    steps = simulate(s, steady(prefill=0.5, decode=64.0), 900, replicas={"prefill": 6, "decode": 4})
    sizes = [st.replicas["prefill"] for st in steps]
    assert steps[0].decisions["prefill"].reason == autoscaler.SCALE_DOWN_STABILIZING
    assert sizes == sorted(sizes, reverse=True), "prefill must only shrink"
    assert sizes[-1] == 1 == s.prefill.min_replicas
    # the 300 s down window holds the first five minutes
    assert all(n == 6 for st, n in zip(steps, sizes) if st.t < 300)
    last = steps[-1].decisions["prefill"]
    assert last.reason in (autoscaler.MIN_REPLICAS, autoscaler.WITHIN_TOLERANCE, autoscaler.QUEUE_BELOW_TARGET)
    assert all(st.decisions["decode"].direction == "hold" for st in steps)


@pytest.mark.parametrize("seed", range(8))
def test_noisy_steady_load_changes_direction_at_most_once_in_ten_minutes(seed):
    s = spec()
    rng = random.Random(seed)

    def script(t, cur):
        # totals that 3 replicas of each role carry at target, +-30%
        return {
            "prefill": {"waiting": 12.0 * rng.uniform(0.7, 1.3)},
            "decode": {"running": 48.0 * rng.uniform(0.7, 1.3)},
        }

    steps = simulate(s, script, 600, replicas={"prefill": 3, "decode": 3})
    assert len(steps) == 40
    for role in ("prefill", "decode"):
        assert direction_changes(steps, role) <= 1, [st.decisions[role].direction for st in steps]
        assert sum(st.decisions[role].direction != "hold" for st in steps) <= 2


def test_noise_would_flap_without_the_down_window():
    """The guard above is not vacuous: with no down window the same noise flaps."""
    s = spec(autoscaling={"interval": "15s", "scaleDownStabilization": "0s", "scaleDownDelayAfterScaleUp": "0s"})
    rng = random.Random(1)
    steps = simulate(
        s,
        lambda t, cur: {
            "prefill": {"waiting": 12.0 * rng.uniform(0.7, 1.3)},
            "decode": {"running": 48.0 * rng.uniform(0.7, 1.3)},
        },
        600,
        replicas={"prefill": 3, "decode": 3},
    )
    assert direction_changes(steps, "decode") > 1


def test_metric_gap_holds_and_never_reads_the_gap_as_zero():
    s = spec()

    def script(t, cur):
        if 120 <= t < 240:
            return MetricsSnapshot.unavailable(T0 + t, "connection refused", source="prometheus")
        return {"prefill": {"waiting": 4.0 * cur["prefill"]}, "decode": {"running": 16.0 * cur["decode"]}}

    steps = simulate(s, script, 600, replicas={"prefill": 3, "decode": 5})
    gap = [st for st in steps if 120 <= st.t < 240]
    assert gap and all(
        d.direction == "hold" and d.reason == autoscaler.METRICS_UNAVAILABLE and "connection refused" in d.message
        for st in gap
        for d in st.decisions.values()
    )
    assert all(st.replicas == {"prefill": 3, "decode": 5} for st in steps)
    conds = {c.type: c for c in autoscaler.conditions(gap[0].decisions, T0)}
    assert conds["MetricsAvailable"].status == "False"
    assert conds["MetricsAvailable"].reason == autoscaler.METRICS_UNAVAILABLE


@pytest.mark.parametrize("case", ["stale", "missing-role", "empty"])
def test_stale_missing_or_empty_metrics_hold(case):
    s = spec()
    replicas = {"prefill": 2, "decode": 3}
    state = ScalerState.initial(s, replicas)
    huge = {"prefill": {"waiting": 400.0}, "decode": {"running": 900.0}}
    if case == "stale":
        snap = snapshot(T0, huge, replicas, sample_time=T0 - 61)  # metricsMaxAge 60s
    elif case == "missing-role":
        snap = snapshot(T0, {"prefill": huge["prefill"]}, replicas)
    else:
        snap = MetricsSnapshot(taken_at=T0, roles={}, source="script")
    decisions, new_state = decide(s, state, snap, T0, {})
    assert {d.reason for d in decisions.values()} == {autoscaler.METRICS_UNAVAILABLE}
    assert {r: d.desired for r, d in decisions.items()} == replicas
    assert new_state.replicas == replicas and new_state.recommendations == state.recommendations


def test_nan_samples_cannot_enter_a_snapshot():
    with pytest.raises(ValueError, match="non-finite"):
        RoleMetrics(waiting=float("nan"), running=0.0, replicas_reporting=1, sample_time=T0)
    with pytest.raises(ValueError, match="must not carry numbers"):
        MetricsSnapshot(
            taken_at=T0,
            ok=False,
            error="x",
            roles={"prefill": RoleMetrics(waiting=0, running=0, replicas_reporting=1, sample_time=T0)},
        )


def test_ratio_above_max_raises_decode_and_says_so():
    s = spec(autoscaling={"interval": "15s", "pdRatio": {"min": 0.125, "max": 2}})
    decisions, _ = one(s, {"prefill": {"waiting": 32.0}, "decode": {"running": 16.0}}, {"prefill": 4, "decode": 1})
    p, d = decisions["prefill"], decisions["decode"]
    assert (p.desired, p.reason) == (8, autoscaler.QUEUE_ABOVE_TARGET)
    assert (d.desired, d.direction, d.reason) == (4, "up", autoscaler.RATIO_BOUND)
    assert "above pdRatio.max 2" in d.message and "queue alone" in d.message
    assert autoscaler.ratio_text(decisions) == "2:1" and autoscaler.pd_ratio(decisions) == 2.0


def test_ratio_below_min_raises_prefill_and_says_so():
    s = spec(autoscaling={"interval": "15s", "pdRatio": {"min": 0.25, "max": 8}})
    decisions, _ = one(s, {"prefill": {"waiting": 0.0}, "decode": {"running": 256.0}}, {"prefill": 1, "decode": 12})
    assert decisions["decode"].desired == 16
    p = decisions["prefill"]
    assert (p.desired, p.direction, p.reason) == (4, "up", autoscaler.RATIO_BOUND)
    assert "below pdRatio.min 0.25" in p.message


def test_ratio_bound_shrinks_the_other_side_when_one_cannot_grow():
    s = spec(
        decode={"acceleratorClasses": ["h100"], "minReplicas": 1, "maxReplicas": 2},
        autoscaling={"interval": "15s", "pdRatio": {"min": 0.125, "max": 2}},
    )
    decisions, _ = one(s, {"prefill": {"waiting": 32.0}, "decode": {"running": 16.0}}, {"prefill": 4, "decode": 1})
    d, p = decisions["decode"], decisions["prefill"]
    assert d.desired == 2
    assert (p.desired, p.direction, p.reason) == (4, "hold", autoscaler.RATIO_BOUND)
    assert "decode cannot grow past 2" in p.message


def test_capacity_caps_with_scaling_limited():
    s = spec()
    decisions, state = one(
        s,
        {"prefill": {"waiting": 40.0}, "decode": {"running": 16.0}},
        {"prefill": 1, "decode": 1},
        capacity={"prefill": 3, "decode": 10},
    )
    p = decisions["prefill"]
    assert (p.desired, p.direction, p.reason) == (3, "up", autoscaler.SCALING_LIMITED)
    assert "only 3 placeable" in p.message and "asked 5" in p.message
    assert state.replicas["prefill"] == 3
    conds = {c.type: c for c in autoscaler.conditions(decisions, T0)}
    assert conds["ScalingLimited"].status == "True" and "prefill" in conds["ScalingLimited"].message
    assert conds["MetricsAvailable"].status == "True"


def test_capacity_shortage_never_shrinks_what_runs():
    s = spec()
    decisions, _ = one(
        s,
        {"prefill": {"waiting": 40.0}, "decode": {"running": 16.0}},
        {"prefill": 4, "decode": 1},
        capacity={"prefill": 2},
    )
    assert (decisions["prefill"].desired, decisions["prefill"].reason) == (4, autoscaler.SCALING_LIMITED)


def test_grace_period_after_scale_up_blocks_scale_down_of_that_role():
    s = spec(autoscaling={"interval": "15s", "scaleDownStabilization": "0s", "scaleDownDelayAfterScaleUp": "60s"})

    def script(t, cur):
        waiting = 40.0 if 15 <= t < 30 else 4.0
        return {"prefill": {"waiting": waiting}, "decode": {"running": 16.0}}

    steps = simulate(s, script, 240, replicas={"prefill": 1, "decode": 1})
    up = first(steps, "prefill", lambda d: d.direction == "up")
    assert up is not None and up.t == 15
    delayed = [st for st in steps if 15 < st.t < 75]
    assert delayed and all(st.decisions["prefill"].reason == autoscaler.SCALE_DOWN_DELAYED for st in delayed)
    assert all(st.replicas["prefill"] == 5 for st in delayed)
    down = first(steps, "prefill", lambda d: d.direction == "down")
    assert down is not None and down.t == 75


def test_grace_period_concerns_only_the_role_that_grew():
    s = spec(autoscaling={"interval": "15s", "scaleDownStabilization": "0s", "scaleDownDelayAfterScaleUp": "60s"})
    # decode grows on its own queue at t=0 while prefill's queue is empty
    steps = simulate(
        s,
        lambda t, cur: {"prefill": {"waiting": 0.0}, "decode": {"running": 64.0 if t < 15 else 0.0}},
        60,
        replicas={"prefill": 3, "decode": 1},
    )
    assert steps[0].decisions["decode"].direction == "up"
    assert steps[1].decisions["decode"].reason == autoscaler.SCALE_DOWN_DELAYED
    assert [st.decisions["prefill"].direction for st in steps[:2]] == ["down", "down"]


def test_scale_down_window_keeps_the_highest_recommendation():
    s = spec(autoscaling={"interval": "15s", "scaleDownStabilization": "120s"})
    # decode asks for 6, then 3 for good at t=60
    steps = simulate(
        s,
        lambda t, cur: {"prefill": {"waiting": 4.0}, "decode": {"running": 96.0 if t < 60 else 48.0}},
        400,
        replicas={"prefill": 1, "decode": 6},
    )
    held = [st for st in steps if 60 <= st.t < 165]
    assert held and all(st.decisions["decode"].reason == autoscaler.SCALE_DOWN_STABILIZING for st in held)
    assert "highest recommendation in the last 120s was 6" in held[-1].decisions["decode"].message
    down = first(steps, "decode", lambda d: d.direction == "down")
    assert down is not None and down.t == 165  # the last 6, recommended at t=45, leaves the 120 s window
    assert steps[-1].replicas["decode"] == 3  # then one step per interval


def test_scale_up_window_ignores_a_one_interval_spike():
    s = spec(autoscaling={"interval": "15s", "scaleUpStabilization": "30s"})
    spike = simulate(
        s,
        lambda t, cur: {"prefill": {"waiting": 40.0 if t == 60 else 4.0}, "decode": {"running": 16.0}},
        150,
        replicas={"prefill": 1, "decode": 1},
    )
    assert all(st.replicas["prefill"] == 1 for st in spike)
    assert spike[4].decisions["prefill"].reason == autoscaler.SCALE_UP_STABILIZING
    sustained = simulate(
        s,
        lambda t, cur: {"prefill": {"waiting": 40.0 if t >= 60 else 4.0}, "decode": {"running": 16.0}},
        150,
        replicas={"prefill": 1, "decode": 1},
    )
    up = first(sustained, "prefill", lambda d: d.direction == "up")
    assert up is not None and up.t == 75  # every recommendation of the last 30 s (60, 75) asked for more


# --- the rest of the chain ---------------------------------------------------------------------


def test_within_tolerance_holds():
    s = spec()
    decisions, _ = one(s, {"prefill": {"waiting": 8.7}, "decode": {"running": 17.5}}, {"prefill": 2, "decode": 1})
    assert {d.reason for d in decisions.values()} == {autoscaler.WITHIN_TOLERANCE}
    decisions, _ = one(s, {"prefill": {"waiting": 8.9}, "decode": {"running": 16.0}}, {"prefill": 2, "decode": 1})
    assert decisions["prefill"].direction == "up"


def test_scale_down_step_and_min_max():
    s = spec(autoscaling={"interval": "15s", "scaleDownStabilization": "0s", "maxScaleDownStep": 2})
    decisions, _ = one(s, {"prefill": {"waiting": 0.0}, "decode": {"running": 1000.0}}, {"prefill": 6, "decode": 14})
    assert decisions["prefill"].desired == 4 and "-2 this interval" in decisions["prefill"].message
    assert (decisions["decode"].desired, decisions["decode"].reason) == (16, autoscaler.MAX_REPLICAS)
    decisions, _ = one(s, {"prefill": {"waiting": 0.0}, "decode": {"running": 0.0}}, {"prefill": 1, "decode": 2})
    assert (decisions["decode"].desired, decisions["decode"].reason) == (1, autoscaler.MIN_REPLICAS)


def test_prompt_tokens_target_wins_when_it_needs_more():
    s = spec(
        prefill={
            "acceleratorClasses": ["h100"],
            "minReplicas": 1,
            "maxReplicas": 8,
            "targetPromptTokensPerReplica": 16384,
        }
    )
    decisions, _ = one(
        s,
        {"prefill": {"waiting": 2.0, "prompt_tokens_waiting": 100_000.0}, "decode": {"running": 16.0}},
        {"prefill": 1, "decode": 1},
    )
    p = decisions["prefill"]
    assert p.desired == 5 and "waiting prompt tokens" in p.message  # 1 + step 4 toward ceil(100000/16384) = 7
    # an engine without the gauge (vLLM) scales on requests and says so
    decisions, _ = one(s, {"prefill": {"waiting": 2.0}, "decode": {"running": 16.0}}, {"prefill": 1, "decode": 1})
    assert decisions["prefill"].desired == 1 and "not reported" in decisions["prefill"].message


def test_colocated_role_scales_on_running_plus_waiting_without_a_ratio():
    s = spec(
        disaggregation=False,
        prefill=None,
        decode=None,
        colocated={"acceleratorClasses": ["h100"], "minReplicas": 1, "maxReplicas": 8},
    )
    decisions, _ = one(s, {"colocated": {"running": 40.0, "waiting": 24.0}}, {"colocated": 2})
    assert (decisions["colocated"].desired, decisions["colocated"].direction) == (4, "up")
    assert autoscaler.ratio_text(decisions) == "-" and autoscaler.pd_ratio(decisions) is None


def test_disabled_runs_min_replicas():
    s = spec(autoscaling={"enabled": False})
    decisions, _ = decide(
        s, ScalerState.initial(s, {"prefill": 3, "decode": 3}), MetricsSnapshot.unavailable(T0, "not asked"), T0, {}
    )
    assert {(d.desired, d.reason) for d in decisions.values()} == {(1, autoscaler.AUTOSCALING_DISABLED)}
    assert {c.type: c.status for c in autoscaler.conditions(decisions, T0)}["MetricsAvailable"] == "Unknown"


def test_state_round_trips_through_json_and_rejects_garbage():
    s = spec()
    steps_state = ScalerState.initial(s, {"prefill": 2})
    _, state = decide(s, steps_state, snapshot(T0, {"prefill": {"waiting": 40.0}, "decode": {"running": 16.0}}), T0, {})
    text = state.to_json()
    assert ScalerState.from_json(text) == state
    assert state.last_scale_up == {"prefill": T0, "decode": T0} and state.recommendations["prefill"] == ((T0, 10),)
    with pytest.raises(ValueError, match="invalid autoscaler state"):
        ScalerState.from_json('{"replicas": 3}')


def test_headline_and_status_report_the_change():
    s = spec()
    decisions, _ = one(s, {"prefill": {"waiting": 4.0}, "decode": {"running": 64.0}}, {"prefill": 1, "decode": 2})
    assert autoscaler.headline(decisions).role == "decode"
    st = autoscaler.status_decision(decisions, T0)
    assert (st.role, st.from_replicas, st.to_replicas, st.reason) == ("decode", 2, 4, autoscaler.QUEUE_ABOVE_TARGET)
    assert st.wire()["fromReplicas"] == 2


# --- the mechanisms beyond one HPA per role --------------------------------------------------------


def test_per_role_baseline_neither_looks_ahead_nor_bounds_the_ratio():
    s = spec(autoscaling={"interval": "15s", "pdRatio": {"min": 0.125, "max": 2}})
    roles = {"prefill": {"waiting": 48.0}, "decode": {"running": 32.0}}
    ours, _ = one(s, roles, {"prefill": 2, "decode": 2})
    assert ours["decode"].desired > 2
    state = ScalerState.initial(s, {"prefill": 2, "decode": 2})
    base, _ = decide(s, state, snapshot(T0, roles), T0, {}, policy=autoscaler.PER_ROLE)
    assert (base["decode"].desired, base["decode"].reason) == (2, autoscaler.WITHIN_TOLERANCE)
    assert base["prefill"].desired == 6  # 3:1 stands: no ratio bound in the baseline


def test_queue_trend_sizes_a_surge_for_the_next_interval_only():
    s = spec(
        prefill={"acceleratorClasses": ["h100"], "minReplicas": 1, "maxReplicas": 16},
        autoscaling={"interval": "15s", "maxScaleUpStep": 100},
    )
    state = ScalerState.initial(s, {"prefill": 4, "decode": 4})
    state = replace(state, last_need={"prefill": (T0 - 15, 4.0), "decode": (T0 - 15, 4.0)})
    # prefill: 8 replicas' worth, grown by 4 in one interval -> sized for 12; decode 1.3x, growing: no trend
    decisions, new = decide(s, state, snapshot(T0, {"prefill": {"waiting": 32.0}, "decode": {"running": 83.2}}), T0, {})
    p, d = decisions["prefill"], decisions["decode"]
    assert (p.desired, p.reason) == (12, autoscaler.QUEUE_GROWING) and "grew by 4.00" in p.message
    # decode: (83.2 + the 14.4 queued at prefill beyond 1.1 x 16) / 16 = 6.1; growing, but 5.2 < 1.5 x 4: no trend
    assert (d.desired, d.reason) == (7, autoscaler.QUEUE_ABOVE_TARGET)
    assert new.last_need["prefill"] == (T0, 8.0)
    # a last reading older than three intervals says nothing about the trend
    stale = replace(state, last_need={"prefill": (T0 - 60, 4.0)})
    decisions, _ = decide(s, stale, snapshot(T0, {"prefill": {"waiting": 32.0}, "decode": {"running": 64.0}}), T0, {})
    assert (decisions["prefill"].desired, decisions["prefill"].reason) == (8, autoscaler.QUEUE_ABOVE_TARGET)


# --- the token rate (Policy.token_rate) ---------------------------------------------------------------

# the token rate as issue 6 left it (with its trend); the drain sizing and the drained scale-down are tested below
RATE_ONLY = autoscaler.Policy(
    prefill_lookahead=False,
    queue_trend=False,
    token_rate=True,
    ratio_bounds=False,
    drain_sizing=False,
    drained_scale_down=False,
)


def rate_snapshot(
    t,
    prefill_waiting,
    prompt_rate,
    prefill_replicas,
    *,
    tokens_waiting=0.0,
    decode_waiting=0.0,
    decode_running=16.0,
    gen_rate=None,
    decode_replicas=2,
):
    return MetricsSnapshot(
        taken_at=t,
        source="script",
        roles={
            "prefill": RoleMetrics(
                waiting=prefill_waiting,
                running=float(prefill_replicas),
                sample_time=t,
                replicas_reporting=prefill_replicas,
                prompt_tokens_waiting=tokens_waiting,
                prompt_tokens_rate=prompt_rate,
            ),
            "decode": RoleMetrics(
                waiting=decode_waiting,
                running=decode_running,
                sample_time=t,
                replicas_reporting=decode_replicas,
                generation_tokens_rate=gen_rate,
            ),
        },
    )


def test_throughput_is_learned_only_from_a_saturated_rate_window():
    s = spec()
    state = ScalerState.initial(s, {"prefill": 2, "decode": 2})
    # 2 prefill replicas with requests waiting for a whole minute serve 8000 tokens/s: 4000 each
    for k in range(5):
        _, state = decide(
            s,
            state,
            rate_snapshot(T0 + 15 * k, 6.0, 8000.0, 2, tokens_waiting=9000.0),
            T0 + 15 * k,
            {},
            current={"prefill": 2, "decode": 2},
            policy=RATE_ONLY,
        )
        # a first guess once two decisions in a row saw it saturated (nothing learned yet, less than a
        # window watched: the most replicas seen served the rate), then the full window's value
        assert ("prefill" in state.throughput) == (k >= 1), k
    assert state.throughput["prefill"] == pytest.approx(4000.0)
    guess = ScalerState.initial(s, {"prefill": 2, "decode": 2})
    for k, replicas in enumerate((2, 3)):  # the pool grew: the guess divides by the most replicas seen
        _, guess = decide(
            s,
            guess,
            rate_snapshot(T0 + 15 * k, 6.0, 9000.0, replicas),
            T0 + 15 * k,
            {},
            current={"prefill": replicas, "decode": 2},
            policy=RATE_ONLY,
        )
    assert guess.throughput["prefill"] == pytest.approx(3000.0)
    # a saturated window whose replicas changed divides by the replicas that served it (time-weighted)
    samples = ((0.0, 2, True), (30.0, 4, True), (60.0, 4, True))
    assert token_rate.served_by(samples, 0.0, 60.0) == pytest.approx(3.0)
    # a minute with nothing waiting says nothing: 2 replicas serving 2000 tokens/s are not at 1000 each
    fresh = ScalerState.initial(s, {"prefill": 2, "decode": 2})
    for k in range(6):
        _, fresh = decide(s, fresh, rate_snapshot(T0 + 15 * k, 0.0, 2000.0, 2), T0 + 15 * k, {}, policy=RATE_ONLY)
    assert "prefill" not in fresh.throughput
    # the baseline learns nothing and keeps no token-rate state
    base = ScalerState.initial(s, {"prefill": 2, "decode": 2})
    for k in range(6):
        _, base = decide(
            s, base, rate_snapshot(T0 + 15 * k, 6.0, 8000.0, 2), T0 + 15 * k, {}, policy=autoscaler.PER_ROLE
        )
    assert base.throughput == {} and base.samples == {} and base.last_queue == {}


def test_a_window_that_ends_saturated_only_raises_the_learned_throughput():
    s = spec()
    state = replace(
        ScalerState.initial(s, {"prefill": 2, "decode": 2}),
        throughput={"prefill": 3000.0},
        samples={"prefill": ((T0 - 60, 2, False), (T0 - 45, 2, False), (T0 - 30, 2, False), (T0 - 15, 2, True))},
    )
    rate = autoscaler.observe_rate("prefill", rate_snapshot(T0, 3.0, 7000.0, 2).roles["prefill"], state, T0)
    assert rate.per_replica == pytest.approx(3500.0)  # a lower bound above 3000 raises it
    rate = autoscaler.observe_rate("prefill", rate_snapshot(T0, 3.0, 5000.0, 2).roles["prefill"], state, T0)
    assert rate.per_replica == pytest.approx(3000.0)  # a lower bound below it says nothing


def test_token_rate_keeps_prefill_at_its_demand_where_the_empty_queue_would_shrink_it():
    s = spec(autoscaling={"interval": "15s", "scaleDownStabilization": "0s", "scaleDownDelayAfterScaleUp": "0s"})
    state = replace(
        ScalerState.initial(s, {"prefill": 4, "decode": 2}),
        throughput={"prefill": 4000.0},
        watching_since={"prefill": T0 - 600, "decode": T0 - 600},
    )
    # 9800 tokens/s arrive and are served with nothing waiting: 9800 / (4000 x 0.7) = 3.5 -> 4
    snap = rate_snapshot(T0, 0.0, 9800.0, 4)
    ours, _ = decide(s, state, snap, T0, {}, policy=RATE_ONLY)
    assert (ours["prefill"].desired, ours["prefill"].reason) == (4, autoscaler.WITHIN_TOLERANCE)
    assert "tokens/s per saturated replica" in ours["prefill"].message
    base, _ = decide(s, state, snap, T0, {}, policy=autoscaler.PER_ROLE)
    assert (base["prefill"].desired, base["prefill"].reason) == (3, autoscaler.QUEUE_BELOW_TARGET)
    # at a third of that demand the rate lets it shrink, and says why
    low, _ = decide(s, state, rate_snapshot(T0, 0.0, 3000.0, 4), T0, {}, policy=RATE_ONLY)
    assert (low["prefill"].desired, low["prefill"].reason) == (3, autoscaler.TOKEN_RATE_BELOW_CAPACITY)


def test_token_rate_counts_the_queue_growth_as_arrivals():
    s = spec(autoscaling={"interval": "15s", "maxScaleUpStep": 100})
    state = replace(
        ScalerState.initial(s, {"prefill": 2, "decode": 2}),
        throughput={"prefill": 4000.0},
        last_queue={"prefill": (T0 - 15, 0.0)},
    )
    # saturated at 8000 tokens/s, and 30000 tokens queued in 15 s: 10000 tokens/s arrive
    assert autoscaler.arrival_rate(8000.0, 30000.0, (T0 - 15, 0.0), T0, 15.0) == pytest.approx(10000.0)
    assert autoscaler.arrival_rate(8000.0, 30000.0, (T0 - 60, 0.0), T0, 15.0) == 8000.0  # too old to tell
    assert autoscaler.arrival_rate(8000.0, None, (T0 - 15, 0.0), T0, 15.0) == 8000.0  # no token queue
    # 10000 / 2800 + 30000 / (4000 x 60) = 3.70 replicas' worth; the queue alone (1 waiting) asks for 1
    decisions, new = decide(
        s, state, rate_snapshot(T0, 1.0, 8000.0, 2, tokens_waiting=30000.0), T0, {}, policy=RATE_ONLY
    )
    p = decisions["prefill"]
    assert (p.desired, p.direction, p.reason) == (4, "up", autoscaler.TOKEN_RATE_ABOVE_CAPACITY)
    assert "10000 tokens/s arriving" in p.message
    assert new.last_queue["prefill"] == (T0, 30000.0)
    assert token_rate.rate_need(10000.0, 30000.0, 4000.0, 0.7) == pytest.approx(10000 / 2800 + 0.125)
    with pytest.raises(ValueError, match="utilization"):
        token_rate.rate_need(1.0, None, 4000.0, 0.0)


def test_decode_grows_for_what_prefill_arrivals_will_generate():
    s = spec(
        decode={"acceleratorClasses": ["h100"], "minReplicas": 1, "maxReplicas": 16, "targetQueuePerReplica": 32},
        autoscaling={"interval": "15s", "maxScaleUpStep": 100},
    )
    steady = ((T0 - 30, 2, False), (T0 - 15, 2, False))
    state = replace(
        ScalerState.initial(s, {"prefill": 2, "decode": 2}),
        throughput={"prefill": 4000.0, "decode": 640.0},
        samples={"prefill": steady, "decode": steady},
    )
    # steady: 6000 prompt tokens/s in, 1200 generated: decode learns 0.2 generated per prompt token
    _, state = decide(
        s, state, rate_snapshot(T0, 0.0, 6000.0, 2, decode_running=60.0, gen_rate=1200.0), T0, {}, policy=RATE_ONLY
    )
    assert state.generation_per_prompt == pytest.approx(0.2)
    # prefill's arrivals triple (its queue grows by 12000 tokens/s): decode, not yet reached, grows ahead
    t = T0 + 15
    decisions, _ = decide(
        s,
        state,
        rate_snapshot(t, 40.0, 6000.0, 2, tokens_waiting=180000.0, decode_running=60.0, gen_rate=1200.0),
        t,
        {},
        policy=RATE_ONLY,
    )
    d = decisions["decode"]
    # 0.2 x 18000 = 3600 tokens/s on their way / (640 x 0.7) = 8.04 -> 9
    assert (d.desired, d.reason) == (9, autoscaler.TOKEN_RATE_ABOVE_CAPACITY)
    assert "on their way from prefill" in d.message
    assert d.current == 3  # 1200 / (640 x 0.7) = 2.68 at the steady decision
    # the baseline's decode sees only its own 60 running (2 replicas' worth): it does not grow
    base, _ = decide(
        s,
        state,
        rate_snapshot(t, 40.0, 6000.0, 2, tokens_waiting=180000.0, decode_running=60.0, gen_rate=1200.0),
        t,
        {},
        policy=autoscaler.PER_ROLE,
    )
    assert base["decode"].direction == "hold" and base["decode"].desired == 3


@pytest.mark.parametrize("seed", range(8))
def test_noisy_steady_token_rate_changes_direction_at_most_once_in_ten_minutes(seed):
    """The +-30% noise carried by the token rate as well as the queues (a learned throughput in play)."""
    s = spec()
    rng = random.Random(seed)
    state = replace(ScalerState.initial(s, {"prefill": 3, "decode": 3}), throughput={"prefill": 4000.0})
    moves: list[str] = []
    for k in range(40):
        t = T0 + 15 * k
        cur = state.replicas
        # 8400 tokens/s (3 replicas at 0.7 of 4000) +-30%, queues at target +-30%
        snap = rate_snapshot(
            t,
            12.0 * rng.uniform(0.7, 1.3),
            8400.0 * rng.uniform(0.7, 1.3),
            cur["prefill"],
            decode_running=48.0 * rng.uniform(0.7, 1.3),
            decode_replicas=cur["decode"],
        )
        decisions, state = decide(s, state, snap, t, {})
        state = ScalerState.from_json(state.to_json())
        moves += [f"{r}:{d.direction}" for r, d in decisions.items() if d.direction != "hold"]
    for role in ("prefill", "decode"):
        mine = [m for m in moves if m.startswith(role)]
        assert sum(1 for a, b in zip(mine, mine[1:]) if a != b) <= 1, mine


def test_token_rate_state_round_trips_and_an_older_state_still_parses():
    s = spec()
    state = replace(
        ScalerState.initial(s, {"prefill": 2, "decode": 2}),
        throughput={"prefill": 4000.0},
        samples={"prefill": ((T0, 2, True),)},
        last_queue={"prefill": (T0, 10.0)},
        generation_per_prompt=0.2,
        rate_history={"prefill": ((T0 - 15, 7000.0, 2), (T0, 8000.0, 2))},
    )
    assert ScalerState.from_json(state.to_json()) == state
    old = '{"lastNeed":{},"lastScaleUp":{},"recommendations":{},"replicas":{"decode":2,"prefill":2},"watchingSince":{}}'
    parsed = ScalerState.from_json(old)
    assert parsed.throughput == {} and parsed.generation_per_prompt is None and parsed.replicas["prefill"] == 2
    assert parsed.rate_history == {}


def test_target_utilization_comes_from_the_spec_unless_a_policy_overrides_it():
    assert autoscaler.TARGET_UTILIZATION == spec().autoscaling.target_utilization
    state = replace(
        ScalerState.initial(spec(), {"prefill": 4, "decode": 2}),
        throughput={"prefill": 4000.0},
        watching_since={"prefill": T0 - 600, "decode": T0 - 600},
    )
    snap = rate_snapshot(T0, 0.0, 9800.0, 4)
    fast = {"interval": "15s", "scaleDownStabilization": "0s", "scaleDownDelayAfterScaleUp": "0s"}
    # 9800 tokens/s at 4000 per replica: 3.5 replicas at 0.7, 2.72 (-> 3) at 0.9, 4.9 (-> 5) at 0.5
    hot = spec(autoscaling={**fast, "targetUtilization": 0.9, "maxScaleUpStep": 10})
    cool = spec(autoscaling={**fast, "targetUtilization": 0.5, "maxScaleUpStep": 10})
    assert decide(hot, state, snap, T0, {}, policy=RATE_ONLY)[0]["prefill"].desired == 3
    assert decide(cool, state, snap, T0, {}, policy=RATE_ONLY)[0]["prefill"].desired == 5
    override = replace(RATE_ONLY, utilization=0.9)
    assert decide(cool, state, snap, T0, {}, policy=override)[0]["prefill"].desired == 3


# --- the rate trend (Policy.rate_trend) ----------------------------------------------------------------


def test_arrival_trend_needs_two_rises_that_add_up_to_a_surge():
    rising = ((T0 - 30, 6000.0), (T0 - 15, 7000.0), (T0, 8000.0))
    assert token_rate.arrival_trend(rising, T0, 15.0) == pytest.approx(2000.0 / 30)
    assert token_rate.arrival_trend(((T0 - 60, 1.0),) + rising, T0, 15.0) == pytest.approx(2000.0 / 30)  # last two only
    assert token_rate.arrival_trend(rising[1:], T0, 15.0) == 0.0  # one interval says nothing
    assert token_rate.arrival_trend(((T0 - 30, 6000.0), (T0 - 15, 8500.0), (T0, 8000.0)), T0, 15.0) == 0.0  # a dip
    assert token_rate.arrival_trend(((T0 - 30, 6000.0), (T0 - 15, 6600.0), (T0, 7400.0)), T0, 15.0) == 0.0  # +23%
    assert token_rate.arrival_trend(((T0 - 45, 6000.0), (T0 - 30, 7000.0), (T0, 8000.0)), T0, 15.0) == 0.0  # a gap
    assert token_rate.arrival_trend(((T0 - 30, 0.0), (T0 - 15, 500.0), (T0, 900.0)), T0, 15.0) == 0.0  # from nothing


def test_surge_growth_trusts_a_rise_only_with_the_same_replicas_over_its_windows():
    # two minutes at 6000 tokens/s on 3 replicas, then +1000 and +1500: 2500 / 30 s over 30 + 60 s
    history = tuple((T0 - 15 * k, 6000.0, 3) for k in range(8, 1, -1)) + ((T0 - 15, 7000.0, 3), (T0, 8500.0, 3))
    assert autoscaler.surge_growth(history, T0, 15.0) == pytest.approx(2500.0 / 30 * 90)
    # a replica left 100 s ago: its series vanished from the sum, whose recovery looks like a rise
    left = tuple((t, v, 4 if t < T0 - 90 else 3) for t, v, _ in history)
    assert autoscaler.surge_growth(left, T0, 15.0) == 0.0
    # one joined: it may be serving a backlog, not new arrivals
    joined = tuple((t, v, 3 if t < T0 - 20 else 4) for t, v, _ in history)
    assert autoscaler.surge_growth(joined, T0, 15.0) == 0.0
    # a history shorter than the first reading's rate window (a fresh start fills its windows from 0)
    assert autoscaler.surge_growth(history[-6:], T0, 15.0) == 0.0


def _trend_series(s, policy, prompt_rates, waiting=0.0, gen_rates=None):
    """Decisions at 15 s steps over a prefill whose served rate follows `prompt_rates` (3 replicas held
    apart from what the decisions ask: the replicas reporting are those of the state at the start)."""
    state = replace(
        ScalerState.initial(s, {"prefill": 3, "decode": 3}),
        throughput={"prefill": 4000.0, "decode": 640.0},
        generation_per_prompt=0.2,
    )
    out = []
    for k, rate in enumerate(prompt_rates):
        t = T0 + 15 * k
        gen = 0.2 * rate if gen_rates is None else gen_rates[k]
        snap = rate_snapshot(
            t, waiting, rate, 3, tokens_waiting=0.0, decode_running=40.0, gen_rate=gen, decode_replicas=3
        )
        decisions, state = decide(s, state, snap, t, {}, current={"prefill": 3, "decode": 3}, policy=policy)
        state = ScalerState.from_json(state.to_json())
        out.append(decisions)
    return out, state


def test_a_surge_of_arrivals_is_sized_for_when_new_replicas_serve():
    s = spec(
        decode={"acceleratorClasses": ["h100"], "minReplicas": 1, "maxReplicas": 16, "targetQueuePerReplica": 32},
        autoscaling={"interval": "15s", "maxScaleUpStep": 100},
    )
    ramp = [8400.0] * 8 + [9800.0, 11900.0]
    ours, state = _trend_series(s, RATE_ONLY, ramp)
    assert all(d["prefill"].desired == 3 and "surging" not in d["prefill"].message for d in ours[:8])
    p, d = ours[-1]["prefill"], ours[-1]["decode"]
    # +3500 tokens/s in 30 s, over the 1-minute rate's 30 s lag + a 60 s horizon: 11900 + 10500 = 22400
    # tokens/s by when new replicas serve; 22400 / (4000 x 0.7) = 8
    assert (p.desired, p.reason) == (8, autoscaler.TOKEN_RATE_ABOVE_CAPACITY)
    assert "arrivals surging: 11900 tokens/s + 10500" in p.message
    # decode, its generation rising alike: 2380 + 2100 tokens/s = 4480 / (640 x 0.7) = 10
    assert d.desired == 10 and "arrivals surging: 2380 tokens/s + 2100" in d.message
    # decode not reached yet (1680 tokens/s all along): it grows for what prefill's surge will generate
    ahead, state = _trend_series(s, RATE_ONLY, ramp, gen_rates=[1680.0] * len(ramp))
    ratio = state.generation_per_prompt  # drifts toward 1680 / 11900 while both roles run with nothing waiting
    d = ahead[-1]["decode"]
    assert "surging" not in d.message and "on their way from prefill" in d.message
    assert d.desired == math.ceil(ratio * 22400.0 / (640 * 0.7)) > 3
    # the history covers the scale-down window (300 s: the rate's floor and peak), so all 10 decisions;
    # the trend reads only its last two rate windows
    assert len(state.rate_history["prefill"]) == len(ramp) == 10
    # without the trend, the rates now: prefill 11900 / 2800 = 4.25 -> 5
    flat, _ = _trend_series(s, replace(RATE_ONLY, rate_trend=False), ramp)
    assert flat[-1]["prefill"].desired == 5 and flat[-1]["decode"].desired == 6  # 2380 / 448 = 5.3
    # the baseline keeps no rate history
    _, base = _trend_series(s, autoscaler.PER_ROLE, ramp)
    assert base.rate_history == {}


@pytest.mark.parametrize("seed", range(8))
def test_noisy_unsaturated_token_rate_changes_direction_at_most_once_in_ten_minutes(seed):
    """Arrivals +-30% around 8400 tokens/s in each 15 s, read as a 1-minute rate (four of them) with nothing
    waiting, so the rate trend is in play: it must not read the noise as surges."""
    s = spec()
    rng = random.Random(seed)
    arrived = [8400.0 * rng.uniform(0.7, 1.3) for _ in range(43)]
    rates = [sum(arrived[k : k + 4]) / 4 for k in range(40)]
    state = replace(
        ScalerState.initial(s, {"prefill": 3, "decode": 3}),
        throughput={"prefill": 4000.0, "decode": 640.0},
        generation_per_prompt=0.2,
    )
    moves: dict[str, list[str]] = {"prefill": [], "decode": []}
    for k, rate in enumerate(rates):
        t = T0 + 15 * k
        cur = state.replicas
        snap = rate_snapshot(
            t, 0.0, rate, cur["prefill"], decode_running=40.0, gen_rate=0.2 * rate, decode_replicas=cur["decode"]
        )
        decisions, state = decide(s, state, snap, t, {})
        for role in moves:
            if decisions[role].direction != "hold":
                moves[role].append(decisions[role].direction)
    for role, mine in moves.items():
        assert sum(1 for a, b in zip(mine, mine[1:]) if a != b) <= 1, (role, mine)
