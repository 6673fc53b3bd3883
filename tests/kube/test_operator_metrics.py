"""The operator's decision series: what `record` exports and what `forget` drops."""

from __future__ import annotations

from pdfleet_operator.decide import autoscaler
from pdfleet_operator.decide import metric_names as names
from pdfleet_operator.kube.operator_metrics import OperatorMetrics


def _decision(role, current, desired, reason):
    direction = "up" if desired > current else "down" if desired < current else "hold"
    return autoscaler.ScalingDecision(role, current, desired, direction, reason, "m")


def sample(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, labels)


def test_record_counts_decisions_and_sets_desired_and_ratio():
    m = OperatorMetrics()
    decisions = {
        "prefill": _decision("prefill", 1, 2, autoscaler.QUEUE_ABOVE_TARGET),
        "decode": _decision("decode", 4, 4, autoscaler.WITHIN_TOLERANCE),
    }
    m.record("ns", "demo", decisions)
    m.record("ns", "demo", decisions)
    assert (
        sample(m, names.SCALING_DECISIONS_TOTAL, role="prefill", direction="up", reason=autoscaler.QUEUE_ABOVE_TARGET)
        == 2
    )
    assert sample(m, names.DESIRED_REPLICAS, namespace="ns", deployment="demo", role="decode") == 4
    assert sample(m, names.PD_RATIO, namespace="ns", deployment="demo") == 0.5
    m.forget("ns", "demo")
    assert sample(m, names.DESIRED_REPLICAS, namespace="ns", deployment="demo", role="decode") is None
    assert sample(m, names.PD_RATIO, namespace="ns", deployment="demo") is None


def test_colocated_deployment_has_no_ratio_series():
    m = OperatorMetrics()
    m.record("ns", "one", {"colocated": _decision("colocated", 2, 3, autoscaler.QUEUE_ABOVE_TARGET)})
    assert sample(m, names.DESIRED_REPLICAS, namespace="ns", deployment="one", role="colocated") == 3
    assert sample(m, names.PD_RATIO, namespace="ns", deployment="one") is None
    assert b"pdfleet_pd_ratio" in m.exposition()  # HELP/TYPE only
