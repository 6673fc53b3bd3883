"""The API models, the generated CRDs and `pdfleet validate`: defaults, invalid resources, staleness."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdfleet_operator import api, validate
from pdfleet_operator.api import admission
from pdfleet_operator.api import schema as crd_schema
from pdfleet_operator.api.meta import parse_duration, parse_quantity
from pdfleet_operator.gen import crds
from tests.api import invalid_resources
from tests.api.invalid_resources import CASES

ROOT = Path(__file__).resolve().parents[2]
PDFLEET = [sys.executable, "-m", "pdfleet_operator"]


def run_pdfleet(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PDFLEET, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


# --- models ----------------------------------------------------------------------------------------


def test_defaults_a_newcomer_can_live_with():
    spec = api.InferenceDeploymentSpec.model_validate(
        {
            "model": {"name": "m", "source": {"local": {"path": "/m"}}},
            "prefill": {"acceleratorClasses": ["cpu"]},
            "decode": {"acceleratorClasses": ["cpu"]},
        }
    )
    assert spec.engine.block_size == 16
    assert spec.engine.kv_cache_memory_fraction == 0.85
    assert spec.engine.enable_prefix_caching is True
    assert parse_duration(spec.autoscaling.scale_down_stabilization) == 300
    assert parse_duration(spec.autoscaling.scale_up_stabilization) == 0
    assert spec.autoscaling.tolerance == 0.1
    assert spec.rollback.error_ratio_threshold == 0.01
    assert parse_duration(spec.rollback.for_) == 120
    assert spec.disaggregation is True and spec.tier == "cost"
    assert spec.target_queue("prefill") == 4 and spec.target_queue("decode") == 16
    assert spec.autoscaling.pd_ratio.min <= spec.autoscaling.pd_ratio.max


@pytest.mark.parametrize("text,seconds", [("500ms", 0.5), ("30s", 30), ("5m", 300), ("1h30m", 5400), ("1.5s", 1.5)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5", "5 minutes", "-1s", "1d"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    "text,value",
    [("1Gi", 2**30), ("512Mi", 512 * 2**20), ("500m", 0.5), ("2", 2), (4, 4), ("1e3", 1000), ("1.5G", 1.5e9)],
)
def test_parse_quantity(text, value):
    assert parse_quantity(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["lots", "32GB", "1gi", "", "1.2.3"])
def test_parse_quantity_rejects(text):
    with pytest.raises(ValueError, match="invalid quantity"):
        parse_quantity(text)


def test_wire_round_trip_keeps_camel_case_and_for():
    doc = invalid_resources.BASE_DEPLOYMENT
    obj = api.InferenceDeployment.model_validate(doc)
    wire = obj.wire()
    assert wire["spec"]["rollback"]["for"] == "2m"
    assert wire["spec"]["engine"]["kvCacheMemoryFraction"] == 0.85
    assert api.InferenceDeployment.model_validate(wire) == obj


def test_set_condition_moves_transition_time_only_on_status_change():
    import datetime as dt

    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    t1 = t0 + dt.timedelta(minutes=5)
    ready = api.Condition(type="Ready", status="False", reason="Pending", last_transition_time=t0)
    conds = api.set_condition([], ready)
    conds = api.set_condition(conds, ready.model_copy(update={"reason": "StillPending", "last_transition_time": t1}))
    assert conds[0].last_transition_time == t0 and conds[0].reason == "StillPending"
    conds = api.set_condition(
        conds, ready.model_copy(update={"status": "True", "reason": "AllPoolsReady", "last_transition_time": t1})
    )
    assert len(conds) == 1 and conds[0].last_transition_time == t1


# --- generated CRDs ---------------------------------------------------------------------------------


def _walk(node, path="schema"):
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")


@pytest.mark.parametrize("kind", list(api.KINDS))
def test_crd_schema_is_structural(kind):
    crd = crd_schema.build_crd(kind)
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        if not isinstance(node, dict):
            continue
        assert "$ref" not in node, f"{path} has a $ref"
        assert "title" not in node or path.endswith(".properties"), f"{path} keeps a title"
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string") is True, f"{path} has anyOf outside int-or-string"
            assert all(o.get("type") != "null" for o in node["anyOf"]), f"{path} has anyOf with null"
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is not False, f"{path} sets additionalProperties: false"
            for name, prop in node["properties"].items():
                if path == "schema" and name in ("apiVersion", "kind", "metadata"):
                    continue
                assert prop.get("description"), f"{path}.properties.{name} has no description"
    assert admission.check_crd(crd) == []


def test_crd_printer_columns_and_names():
    infdep = crd_schema.build_crd("InferenceDeployment")
    version = infdep["spec"]["versions"][0]
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns[:6] == ["Model", "Prefill", "Decode", "P:D", "$/h", "Ready"] and columns[-1] == "Age"
    assert version["subresources"] == {"status": {}}
    assert infdep["spec"]["names"]["shortNames"] == ["infdep"]
    assert infdep["spec"]["names"]["categories"] == ["pdfleet"]
    acc = crd_schema.build_crd("AcceleratorClass")
    assert acc["spec"]["scope"] == "Cluster"
    assert [c["name"] for c in acc["spec"]["versions"][0]["additionalPrinterColumns"] if "priority" not in c] == [
        "Vendor",
        "Resource",
        "$/h",
        "Age",
    ]


def test_crd_rules_match_the_models():
    """The CEL text in the CRD is the text the models evaluate: one rule, not two copies."""
    root = crd_schema.build_crd("InferenceDeployment")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    role_rules = root["properties"]["spec"]["properties"]["decode"]["x-kubernetes-validations"]
    assert [r["rule"] for r in role_rules] == [r.rule for r in api.RoleSpec.cel_rules]


def test_crds_are_valid_kubernetes_objects():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for kind in api.KINDS:
        kubernetes_validate.validate(crd_schema.build_crd(kind), "1.30.0", strict=True)


def test_committed_crds_are_fresh():
    assert crds.stale_files(ROOT / "crds") == [], "run `pdfleet crds` and commit the result"


def test_crds_check_cli_detects_a_changed_model(tmp_path):
    out = tmp_path / "crds"
    assert run_pdfleet("crds", "--out", str(out)).returncode == 0
    assert run_pdfleet("crds", "--out", str(out), "--check").returncode == 0
    # A field added to a model makes the committed files stale: simulate by editing one file.
    path = next(out.glob("*inferencedeployments.yaml"))
    path.write_text(path.read_text().replace("Tokens per KV cache block.", "Tokens per block."))
    result = run_pdfleet("crds", "--out", str(out), "--check")
    assert result.returncode == 1 and "stale" in result.stderr


def test_crds_check_fails_after_a_model_field_changes(monkeypatch):
    from pdfleet_operator.api import inference_deployment as infdep

    field = infdep.EngineSpec.model_fields["block_size"]
    monkeypatch.setattr(field, "description", "changed")
    infdep.EngineSpec.model_rebuild(force=True)
    infdep.InferenceDeploymentSpec.model_rebuild(force=True)
    infdep.InferenceDeployment.model_rebuild(force=True)
    try:
        assert crds.stale_files(ROOT / "crds") != []
    finally:
        monkeypatch.undo()
        for model in (infdep.EngineSpec, infdep.InferenceDeploymentSpec, infdep.InferenceDeployment):
            model.model_rebuild(force=True)
    assert crds.stale_files(ROOT / "crds") == []


# --- examples and validation ------------------------------------------------------------------------


def test_examples_cover_the_fleet_we_promise():
    classes = {
        d["metadata"]["name"]: d["spec"]
        for d in yaml.safe_load_all((ROOT / "examples/acceleratorclasses.yaml").read_text())
    }
    resources = {spec["resourceName"] for spec in classes.values()}
    assert {
        "nvidia.com/gpu",
        "nvidia.com/mig-3g.40gb",
        "nvidia.com/mig-1g.10gb",
        "huawei.com/Ascend910",
        "cambricon.com/mlu",
        "hygon.com/dcu",
        "kunlunxin.com/xpu",
        "cpu",
    } <= resources
    assert {"h100-80gb", "h200-141gb", "a100-80gb", "l40s-48gb", "cpu"} <= set(classes)
    for name, spec in classes.items():
        assert spec["costSource"] and spec["costAsOf"], f"{name} has no documented price source/date"
    deployments = [
        d
        for p in ROOT.glob("examples/*.yaml")
        for d in yaml.safe_load_all(p.read_text())
        if d and d["kind"] == "InferenceDeployment"
    ]
    assert len(deployments) >= 3
    # Every class a deployment refers to exists.
    for d in deployments:
        for role in ("prefill", "decode", "colocated"):
            for cls in d["spec"].get(role, {}).get("acceleratorClasses", []):
                assert cls in classes, f"{d['metadata']['name']} uses unknown class {cls}"


def test_every_example_passes_validate_cli():
    result = run_pdfleet("validate", *sorted(str(p) for p in (ROOT / "examples").glob("*.yaml")))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "object(s) valid" in result.stderr


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_invalid_resource_rejected_by_validate(case):
    obj = case.build()
    problems = validate.validate_object(obj, "case.yaml")
    assert any(invalid_resources.matches(case, p.field, p.message) for p in problems), (
        f"expected an error at {case.field} mentioning {case.word!r}; got {[str(p) for p in problems]}"
    )
    # Both layers must reject on their own: the CRD's admission rules and the operator's models.
    kind = obj["kind"]
    assert any(
        invalid_resources.matches(case, e.field, e.message) for e in admission.validate(crd_schema.build_crd(kind), obj)
    ), "admission (schema + CEL) accepted it"
    assert any(invalid_resources.matches(case, f, m) for f, m in validate.pydantic_problems(api.KINDS[kind], obj)), (
        "the pydantic model accepted it"
    )


def test_kept_rule_results_answer_as_the_interpreter_does():
    """evaluate_rule keeps results per (rule, self); a kept answer is the interpreter's, and a refusal stays one."""
    from pdfleet_operator.api import meta

    rule = "(has(self.pvc) ? 1 : 0) + (has(self.hostPath) ? 1 : 0) + (has(self.local) ? 1 : 0) == 1"
    values = [{"pvc": {"claimName": "m"}}, {"pvc": {"claimName": "m"}, "local": {"path": "/m"}}, {}]
    meta._RESULTS.clear()
    first = [meta.evaluate_rule(rule, v) for v in values]
    assert first == [True, False, False]
    assert len(meta._RESULTS) == 3
    assert [meta.evaluate_rule(rule, copy.deepcopy(v)) for v in values] == first  # kept, same answers
    # Key order does not matter; a different value is a different key.
    assert meta.evaluate_rule(rule, {"local": {"path": "/m"}, "pvc": {"claimName": "m"}}) is False
    assert meta.evaluate_rule(rule, {"local": {"path": "/m"}}) is True
    # Every invalid case is refused again when its rules' results are kept from the first refusal.
    for case in CASES:
        obj = case.build()
        once = validate.pydantic_problems(api.KINDS[obj["kind"]], obj)
        assert validate.pydantic_problems(api.KINDS[obj["kind"]], copy.deepcopy(obj)) == once


def test_enough_invalid_cases():
    assert len(CASES) >= 25


def test_validate_cli_reports_one_line_per_error_naming_object_and_field(tmp_path):
    bad = invalid_resources.CASES[0].build()
    worse = invalid_resources.CASES[2].build()
    worse["metadata"]["name"] = "other"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump_all([bad, worse]))
    result = run_pdfleet("validate", str(path), str(ROOT / "examples/qwen2-7b.yaml"))
    assert result.returncode == 1
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2, lines
    assert "InferenceDeployment/llama31-8b" in lines[0] and "spec.decode.minReplicas" in lines[0]
    assert "InferenceDeployment/other" in lines[1] and "spec.engine.kvCacheMemoryFraction" in lines[1]


def test_validate_cli_bad_yaml_and_missing_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("kind: [unclosed\n")
    result = run_pdfleet("validate", str(path), str(tmp_path / "absent.yaml"))
    assert result.returncode == 1
    assert "not valid YAML" in result.stdout and "absent.yaml" in result.stdout


def test_cli_version():
    result = run_pdfleet("--version")
    assert result.returncode == 0 and result.stdout.startswith("pdfleet ")


def test_an_engine_choice_alone_is_admitted_and_vllm_settings_are_not_defaulted_into_being():
    """runtime pdfleet with no vllm block passes admission: the CRD must not default engine.vllm to {},
    which the rule "vllm settings need runtime vllm" would then refuse."""
    crd = crd_schema.build_crd("InferenceDeployment")
    obj = copy.deepcopy(invalid_resources.BASE_DEPLOYMENT)
    for runtime in ("pdfleet", "vllm"):
        obj["spec"].setdefault("engine", {})["runtime"] = runtime
        assert admission.validate(crd, obj) == [], runtime
        assert "vllm" not in admission.apply_defaults(crd, obj)["spec"]["engine"]
    engine = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["engine"]
    assert "default" not in engine["properties"]["vllm"]
    assert not any(k.startswith("x-pdfleet") for k in json.dumps(crd).split('"'))
