"""The SimulatedFleet file: the shipped example and the errors a broken file gets."""

from __future__ import annotations

import pytest
import yaml

from pdfleet_operator.decide import inventory
from pdfleet_operator.sim import fleet
from tests.sim.support import EXAMPLE, ROOT, doc


def test_the_example_is_a_100_accelerator_mixed_fleet() -> None:
    f = fleet.load(EXAMPLE)
    assert f.devices == 100
    vendors = {
        f.classes[c].vendor
        for n in f.nodes
        for c in f.classes
        if f.classes[c].resource_name in n["status"]["allocatable"]
    }
    assert {"nvidia", "huawei", "hygon", "cambricon", "kunlunxin"} <= vendors
    resources = {r for n in f.nodes for r in n["status"]["allocatable"]}
    assert {"nvidia.com/mig-3g.40gb", "nvidia.com/mig-1g.10gb", "huawei.com/Ascend910"} <= resources
    inv = f.inventory()
    assert (
        inv.free_units(f.classes["h100-80gb"]) == 24
    )  # the MIG node's product label matches, but it has no whole GPUs
    assert inv.slots(f.classes["ascend-910b-x2"]) == 12
    assert set(f.compare) == set(f.policies) and f.headline == ("static-nvidia", "dynamic-mixed")
    static = f.policy("static-nvidia").deployments[0].spec
    assert not static.autoscaling.enabled and static.prefill.min_replicas == static.prefill.max_replicas
    colocated = f.policy("colocated-mixed").deployments[0].spec
    assert not colocated.disaggregation and colocated.prefill is None


def test_nodes_become_node_objects_the_operator_inventory_reads() -> None:
    f = fleet.parse(doc(), source="x", base_dir=ROOT)
    names = [n["metadata"]["name"] for n in f.nodes]
    assert names == ["h100-0", "mig-0", "ascend-0"]
    mig = f.nodes[1]
    assert mig["metadata"]["labels"]["nvidia.com/mig.strategy"] == "mixed"
    assert mig["status"]["allocatable"] == {"nvidia.com/mig-3g.40gb": "4"}
    assert f.devices == 8 + 2 + 4
    assert inventory.build(f.nodes, []).slots(f.classes["h100-mig-3g-40gb"]) == 4


def test_the_example_is_kept_out_of_kubectl_apply() -> None:
    raw = yaml.safe_load(EXAMPLE.read_text())
    assert raw["apiVersion"] == fleet.API_VERSION and raw["kind"] == fleet.KIND
    assert EXAMPLE.parent.name == "sim"  # `kubectl apply -f examples/` is not recursive
    assert fleet.validate_document(raw, str(EXAMPLE), EXAMPLE.parent) == []


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"kind": "Fleet"}, "expected apiVersion sim.pdfleet.io/v1alpha1 and kind SimulatedFleet"),
        ({"nodez": []}, "unknown field(s) nodez"),
        ({"nodes": []}, "nodes must be a non-empty list"),
        ({"nodes": [{"name": "a", "accelerators": {"b200": 8}}]}, "unknown AcceleratorClass 'b200'"),
        ({"nodes": [{"name": "a", "count": 0, "accelerators": {"h100-80gb": 8}}]}, "nodes[0].count"),
        ({"simulation": {"startup": "soon"}}, "simulation.startup: invalid duration 'soon'"),
        ({"trace": {"preset": "chat"}}, "trace.preset 'chat' is not one of conversation, code"),
        ({"deployment": {"spec": {"decode": {"maxReplicas": 0}}}}, "spec.decode.maxReplicas"),
        ({"deployment": {"spec": {"prefill": {"acceleratorClasses": ["b200"]}}}}, "unknown class 'b200'"),
        ({"deployment": {"spec": {"model": {"architecture": None}}}}, "architecture is required"),
        ({"compare": ["dynamic", "nope"]}, "compare lists 'nope'"),
        (
            {"policies": [{"name": "t", "deployments": [{"name": "a", "share": 0.5}, {"name": "b", "share": 0.4}]}]},
            "shares sum to 0.9, not 1",
        ),
        ({"policies": [{"name": "p", "autoscalerPolicy": "hpa"}]}, "autoscalerPolicy: 'hpa' is not one of"),
        ({"headline": {"baseline": "static", "candidate": "x"}}, "headline.candidate 'x'"),
    ],
)
def test_a_broken_fleet_file_names_the_field(patch, message) -> None:
    d = doc(**patch)
    if "policies" in patch:
        d.pop("compare", None)
    with pytest.raises(
        fleet.FleetError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")
    ):
        fleet.parse(d, source="bad.yaml", base_dir=ROOT)


def test_load_errors(tmp_path) -> None:
    with pytest.raises(fleet.FleetError, match="no such fleet file"):
        fleet.load(tmp_path / "none.yaml")
    two = tmp_path / "two.yaml"
    two.write_text("a: 1\n---\nb: 2\n")
    with pytest.raises(fleet.FleetError, match="expected one SimulatedFleet document, found 2"):
        fleet.load(two)


def test_merge_maps_merge_lists_replace_null_deletes() -> None:
    base = {"a": {"b": 1, "c": [1, 2]}, "d": 1}
    assert fleet.merge(base, {"a": {"c": [3]}, "d": None}) == {"a": {"b": 1, "c": [3]}}
    assert base == {"a": {"b": 1, "c": [1, 2]}, "d": 1}


def test_the_local_fleet_replay_target_simulates_with_a_calibration(tmp_path) -> None:
    import json

    from pdfleet_operator import trace as tr
    from pdfleet_operator.sim import calibration, report, simulator

    f = fleet.load(EXAMPLE.parent / "local-tiny.yaml")
    cal = tmp_path / "cal.json"
    cal.write_text(
        json.dumps(
            {
                "kind": calibration.CALIBRATION_KIND,
                "class": "cpu",
                "prefill_mfu": 0.05,
                "decode_mbu": 0.5,
                "step_overhead_s": 0.002,
            }
        )
    )
    effs = calibration.load([cal], f.classes)
    t = tr.synthetic("conversation", mean_rate=2.0, duration=120, seed=1)
    t = tr.Trace(t.name, t.arrival, t.prompt.clip(max=600), t.output.clip(max=200), t.duration)
    sim = simulator.Simulator(f, f.policy("local"), t, efficiencies=effs).run()
    e = report.summarize(sim)
    assert e["completed"] == e["requests"] > 100
    assert set(e["accelerator_hours"]) == {"cpu"}
