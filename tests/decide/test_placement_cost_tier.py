"""Cost-tier ranking compares replicas, not units: a two-card class is not twice as cheap per FLOP."""

from __future__ import annotations

from pdfleet_operator.api import AcceleratorClassSpec
from pdfleet_operator.decide import placement
from tests.kube.cluster import classes, example_deployments, spec_of


def _variant(base: AcceleratorClassSpec, **changes) -> AcceleratorClassSpec:
    return base.model_copy(update=changes)


def test_multi_unit_class_ranks_by_replica_price():
    catalog = classes()
    ascend = catalog["ascend-910b"]
    h100 = catalog["h100-80gb"]
    doc = example_deployments()["chat-cost"]
    doc["spec"]["prefill"]["acceleratorClasses"] = ["ascend-910b-x2", "h100-80gb"]
    spec = spec_of(doc)
    pair = _variant(ascend, count=2)
    # Per unit: Ascend 313 TFLOP/s for $1.20 (261/$), H100 989 for $2.99 (331/$): H100 wins per $.
    ranked = placement.rank("prefill", spec, {"ascend-910b-x2": pair, "h100-80gb": h100}, [])
    assert [c.name for c in ranked] == ["h100-80gb", "ascend-910b-x2"]
    assert ranked[1].score == ascend.peak_tflops / ascend.cost_per_hour
