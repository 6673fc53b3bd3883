"""Issue 20's simulator: only what the runtimes can run, efficiencies per (engine, class kind) that say where
they come from, and cost at equal SLO attainment."""

from __future__ import annotations

import pytest

from pdfleet_operator.decide import runtimes
from pdfleet_operator.sim import efficiency, fleet, report
from pdfleet_operator.sim.perf_model import replica_perf
from tests.sim.support import EXAMPLE, ROOT, doc, small

X2 = {
    "metadata": {"name": "ascend-910b-x2"},
    "spec": {
        "vendor": "huawei",
        "model": "2 x Ascend 910B (TP2)",
        "resourceName": "huawei.com/Ascend910",
        "count": 2,
        "memoryGiB": 64,
        "peakTflops": 313,
        "memoryBandwidthGBps": 1600,
        "networkGBps": 25,
        "costPerHour": 1.2,
        "nodeSelector": {"accelerator": "huawei-Ascend910"},
    },
}


def test_a_count_2_class_is_refused_for_the_pdfleet_worker_and_served_by_vllm_as_one_tp_replica() -> None:
    decode_x2 = {"deployment": {"spec": {"decode": {"acceleratorClasses": ["ascend-910b-x2"]}}}}
    with pytest.raises(fleet.FleetError, match=r"spec.decode.acceleratorClasses\[0\].*no tensor parallelism"):
        fleet.parse(doc(acceleratorClasses=[X2], **decode_x2), source="x.yaml", base_dir=ROOT)
    # offered vLLM and run with it (prefill too: one engine), it simulates as one replica over both cards
    offered = {**X2, "spec": {**X2["spec"], "runtimes": {"default": "vllm", "vllm": {"image": "vllm-ascend:test"}}}}
    with pytest.raises(fleet.FleetError, match="prefill and decode must run one engine"):
        fleet.parse(doc(acceleratorClasses=[offered], **decode_x2), source="x.yaml", base_dir=ROOT)
    f = fleet.parse(
        doc(
            acceleratorClasses=[offered],
            deployment={
                "spec": {
                    "engine": {"runtime": "vllm", "blockSize": 128},
                    "prefill": {"acceleratorClasses": ["ascend-910b-x2"]},
                    "decode": {"acceleratorClasses": ["ascend-910b-x2"]},
                }
            },
            policies=[{"name": "dynamic", "description": "autoscaled"}],
            compare=["dynamic"],
        ),
        source="x.yaml",
        base_dir=ROOT,
    )
    spec = f.policy("dynamic").deployments[0].spec
    cls = f.classes["ascend-910b-x2"]
    assert runtimes.engine_of(spec, cls) == "vllm"
    eff = efficiency.for_pool("vllm", "ascend-910b-x2", cls)
    assert eff.tensor_parallel_scaling == efficiency.TENSOR_PARALLEL_SCALING < 1 and "TP2" in eff.source
    one = replica_perf(spec, "ascend-910b-x2", cls, efficiency.for_pool("vllm", "ascend-910b-x2", cls))
    ideal = replica_perf(
        spec, "ascend-910b-x2", cls, efficiency.for_pool("vllm", "ascend-910b", f.classes["ascend-910b"])
    )
    assert one.weights_read_s == pytest.approx(ideal.weights_read_s / efficiency.TENSOR_PARALLEL_SCALING)


def test_the_example_fleet_says_which_engine_each_class_runs() -> None:
    f = fleet.load(EXAMPLE)
    for policy in f.policies.values():
        for d in policy.deployments:
            assert runtimes.check(d.spec, f.classes) == []
            for rs in d.spec.roles().values():
                for c in rs.accelerator_classes:
                    cls = f.classes[c]
                    engine = runtimes.engine_of(d.spec, cls)
                    # TP2 decode needs vLLM; NVIDIA prefill with domestic decode needs one KV path: the pdfleet engine
                    assert engine == ("pdfleet" if policy.name == "dynamic-mixed" else "vllm")
                    assert cls.count == 1 or runtimes.TENSOR_PARALLEL[engine]


def test_efficiencies_say_measured_or_assumed() -> None:
    classes = small().classes
    cpu = efficiency.for_pool("pdfleet", "cpu", classes["cpu"])
    assert cpu.source.startswith("measured")
    h100 = efficiency.for_pool("vllm", "h100-80gb", classes["h100-80gb"])
    assert h100.source.startswith("assumption") and h100.tensor_parallel_scaling == 1.0
    with pytest.raises(ValueError, match="unknown engine"):
        efficiency.for_pool("tgi", "cpu", classes["cpu"])


def _entry(cost: float, att: float) -> dict:
    return {"cost_per_1m_tokens": cost, "slo_attainment": att}


def test_equal_slo_takes_each_policys_cheapest_run_that_reaches_the_target() -> None:
    entries = {"static": _entry(2.0, 0.99), "dynamic": _entry(1.2, 0.97), "colocated": _entry(1.0, 0.6)}
    variants = {
        "static": [{"variant": "smaller", **_entry(1.8, 0.985)}],
        "dynamic": [{"variant": "u0.6", **_entry(1.4, 0.99)}, {"variant": "u0.5", **_entry(1.6, 0.995)}],
    }
    eq = report.equal_slo(entries, variants, "static")
    assert eq["target_attainment"] == 0.99
    assert eq["policies"]["static"]["cost_per_1m_tokens"] == 2.0  # the smaller size misses 0.99
    assert (eq["policies"]["dynamic"]["cost_per_1m_tokens"], eq["policies"]["dynamic"]["variant"]) == (1.4, "u0.6")
    assert (
        eq["policies"]["colocated"]["cost_per_1m_tokens"] is None
        and eq["policies"]["colocated"]["best_attainment"] == 0.6
    )
    both = {
        k: {
            **v,
            "equal_slo_cost_per_1m_tokens": eq["policies"][k]["cost_per_1m_tokens"],
            "equal_slo_attainment": eq["policies"][k]["attainment"],
        }
        for k, v in entries.items()
    }
    cmp = report.compare(both, "static", "dynamic", goal=0.99)
    assert cmp["equal_slo_saving"] == pytest.approx(0.3) and cmp["equal_slo_attainment"] == 0.99
    assert "At equal SLO attainment (>= 99.00%): 30.0% cheaper" in report.comparison_text(cmp, "c")


def test_equal_slo_sweeps_are_validated_like_policies() -> None:
    sweep = {
        "target": "static",
        "sweep": {"dynamic": [{"name": "u0.6", "spec": {"autoscaling": {"targetUtilization": 0.6}}}]},
    }
    f = fleet.parse(doc(equalSlo=sweep), source="x.yaml", base_dir=ROOT)
    (v,) = f.equal_slo.variants["dynamic"]
    assert v.name == "dynamic" and v.variant == "u0.6" and v.deployments[0].spec.autoscaling.target_utilization == 0.6
    bad = {
        "target": "static",
        "sweep": {"dynamic": [{"name": "u2", "spec": {"autoscaling": {"targetUtilization": 2}}}]},
    }
    with pytest.raises(fleet.FleetError, match=r"equalSlo.sweep.dynamic\[0\].*targetUtilization"):
        fleet.parse(doc(equalSlo=bad), source="x.yaml", base_dir=ROOT)
    with pytest.raises(fleet.FleetError, match="equalSlo.target: 'nope'"):
        fleet.parse(doc(equalSlo={"target": "nope"}), source="x.yaml", base_dir=ROOT)
