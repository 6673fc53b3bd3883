"""Rollback analysis over scripted 5xx series: roll back once after `for`, ignore short bursts, hold on gaps."""

from __future__ import annotations

import math

import pytest

from pdfleet_operator.api.inference_deployment import InferenceDeploymentSpec, RollbackSpec
from pdfleet_operator.decide import rollback
from pdfleet_operator.decide.rollback import RatioSample, RevisionHealth

SPEC = RollbackSpec(error_ratio_threshold=0.01, window="1m", **{"for": "2m"}, min_requests=20, soak_time="10m")
STEP = 15.0


def run(series, health=None, stable=1, spec=SPEC):
    """Feed (requests, errors) per 15 s step; return the actions taken (kind, time) and the final health."""
    health = health or RevisionHealth(revision=2, started_at=0.0)
    actions = []
    for i, (requests, errors) in enumerate(series):
        sample = RatioSample(time=i * STEP, requests=requests, errors=errors)
        health, action = rollback.analyze(health, sample, spec, stable_revision=stable)
        if action.kind != "none":
            actions.append((action.kind, sample.time, action))
    return actions, health


def test_bad_revision_rolled_back_exactly_once_after_for():
    series = [(400, 0)] * 4 + [(400, 100)] * 40
    actions, health = run(series)
    assert [(k, t) for k, t, _ in actions] == [("rollback", 60.0 + 120.0)]
    _, _, action = actions[0]
    assert action.reason == "HighErrorRatio" and action.ratio == pytest.approx(0.25)
    assert "rolling back to stable revision 1" in action.message
    assert health.done


def test_spike_shorter_than_for_is_not_rolled_back():
    series = [(400, 0)] * 4 + [(400, 100)] * 7 + [(400, 0)] * 4 + [(400, 100)] * 7 + [(400, 0)] * 10
    actions, health = run(series)
    assert actions == []
    assert health.failing_since is None and not health.done


def test_low_traffic_is_inconclusive_not_healthy_and_not_failing():
    health = RevisionHealth(revision=2, started_at=0.0)
    health, action = rollback.analyze(health, RatioSample(0, 10, 10), SPEC, stable_revision=1)
    assert action.kind == "none" and action.reason == "Inconclusive"
    assert rollback.classify(RatioSample(0, 10, 10), SPEC) == "inconclusive"
    # An hour of low traffic neither rolls back nor makes the revision stable.
    actions, health = run([(10, 10)] * 240)
    assert actions == [] and not health.stable


def test_missing_metrics_hold_the_clocks():
    series = [(400, 100)] * 6 + [(None, None)] * 20
    actions, health = run(series)
    assert actions == []
    assert health.failing_since == 0.0, "a gap must not reset or advance the failure clock into a decision"
    for bad in (
        RatioSample(0, math.nan, 1),
        RatioSample(0, 100, math.inf),
        RatioSample(0, None, None, "connection refused"),
    ):
        assert rollback.classify(bad, SPEC) == "unknown"
    _, action = rollback.analyze(health, RatioSample(999, None, None, "connection refused"), SPEC, 1)
    assert action.reason == "MetricsUnavailable" and "connection refused" in action.message


def test_healthy_revision_becomes_stable_after_soak():
    actions, health = run([(400, 1)] * 45)  # 0.25% errors, 11 minutes
    assert [(k, t) for k, t, _ in actions] == [("mark_stable", 600.0)]
    assert health.stable


def test_inconclusive_breaks_the_soak():
    series = [(400, 0)] * 30 + [(5, 0)] + [(400, 0)] * 45
    actions, _ = run(series)
    assert [(k, t) for k, t, _ in actions] == [("mark_stable", 31 * STEP + 600.0)]


def test_rollback_that_goes_bad_pages_instead_of_looping():
    health = RevisionHealth(revision=1, started_at=0.0, rollback_target=True)
    actions, health = run([(400, 100)] * 40, health=health, stable=1)
    assert [k for k, _, _ in actions] == ["page"]
    assert actions[0][2].reason == "RollbackFailed" and "result of a rollback" in actions[0][2].message


def test_first_revision_without_stable_pages():
    actions, _ = run([(400, 100)] * 40, stable=None)
    assert [k for k, _, _ in actions] == ["page"] and "no earlier stable revision" in actions[0][2].message


def test_disabled_rollback_does_nothing():
    spec = SPEC.model_copy(update={"enabled": False})
    assert run([(400, 100)] * 40, spec=spec)[0] == []


def test_firing_alert_backdates_failure_so_next_failing_sample_rolls_back():
    health = RevisionHealth(revision=2, started_at=0.0)
    health = rollback.health_from_alert(health, starts_at=300.0, spec=SPEC)
    assert health.failing_since == 180.0
    health, action = rollback.analyze(health, RatioSample(301.0, 400, 100), SPEC, stable_revision=1)
    assert action.kind == "rollback"


def test_health_round_trips_json():
    health = RevisionHealth(revision=3, started_at=12.5, failing_since=20.0)
    assert RevisionHealth.from_json(health.to_json()) == health


def _spec(**changes):
    base = {
        "model": {"name": "m", "source": {"local": {"path": "/m"}}},
        "prefill": {"acceleratorClasses": ["h100-80gb"]},
        "decode": {"acceleratorClasses": ["h100-mig-3g-40gb"]},
    }
    for path, value in changes.items():
        node = base
        *head, leaf = path.split("__")
        for key in head:
            node = node.setdefault(key, {})
        node[leaf] = value
    return InferenceDeploymentSpec.model_validate(base)


@pytest.mark.parametrize(
    "change,new_revision",
    [
        ({"engine__image": "pdfleet/worker:0.2"}, True),
        ({"model__source": {"local": {"path": "/other"}}}, True),
        ({"engine__blockSize": 32}, True),
        ({"decode__acceleratorClasses": ["h100-80gb"]}, True),
        ({"prefill__maxReplicas": 9}, False),
        ({"decode__minReplicas": 0}, False),
        ({"autoscaling__interval": "30s"}, False),
        ({"rollback__errorRatioThreshold": 0.05}, False),
        ({"slo__ttft": "5s"}, False),
    ],
)
def test_only_changes_to_what_pods_run_make_a_new_revision(change, new_revision):
    base = rollback.fingerprint(rollback.template_spec(_spec()))
    changed = rollback.fingerprint(rollback.template_spec(_spec(**change)))
    assert (base != changed) is new_revision


def test_history_pruned_to_limit_keeping_current_and_stable():
    assert rollback.revisions_to_prune(list(range(1, 13)), limit=10, keep={12, 1}) == [2, 3]
    assert rollback.revisions_to_prune([1, 2, 3], limit=10, keep={3}) == []
    assert rollback.revisions_to_prune([1, 2, 3], limit=1, keep={3, 1}) == [2]
    with pytest.raises(ValueError, match="limit"):
        rollback.revisions_to_prune([1], limit=0, keep=set())
