"""spec.routing and spec.router.heartbeatInterval as admission and the operator's models see them: each refusal names
its field."""

from __future__ import annotations

import copy

import pytest
import yaml

from pdfleet_operator.api import InferenceDeployment, admission, schema, validation
from tests.kube.cluster import EXAMPLES

BASE = yaml.safe_load((EXAMPLES / "qwen2-7b-routing.yaml").read_text().split("\n---\n")[0])


def with_routing(**routing) -> dict:
    doc = copy.deepcopy(BASE)
    doc["spec"]["routing"] = routing
    return doc


def problems(doc: dict) -> dict[str, str]:
    return {p.field: p.message for p in validation.validate_object(doc, "routing.yaml")}


def test_the_example_is_valid_and_defaults_fill_in() -> None:
    assert problems(BASE) == {}
    dep = InferenceDeployment.model_validate(BASE)
    assert dep.spec.routing.confidence_floor == 0.5 and dep.spec.router.heartbeat_interval == "10s"


@pytest.mark.parametrize(
    "doc, field, text",
    [
        (
            with_routing(target="qwen2-7b-routed", rules={"maxTokens": 8}),
            "spec.routing.target",
            "cannot route to itself",
        ),
        (with_routing(target="small"), "spec.routing.rules", "at least one rule or a classifier"),
        (
            with_routing(target="small", rules={"patterns": ["ok", "(unclosed"]}),
            "spec.routing.rules.patterns",
            "[1] '(unclosed' is not a valid regular expression",
        ),
        (
            with_routing(target="small", rules={"maxTokens": 0}),
            "spec.routing.rules.maxTokens",
            "greater than or equal to 1",
        ),
        (with_routing(target="small", classifier={"entryPoint": "no colon"}), "spec.routing.classifier.entryPoint", ""),
        (with_routing(target="small", rules={"maxTokens": 8}, confidenceFloor=1.5), "spec.routing.confidenceFloor", ""),
    ],
)
def test_bad_routing_is_refused_naming_the_field(doc, field, text) -> None:
    found = problems(doc)
    assert field in found, found
    assert text in found[field]


def test_admission_itself_refuses_self_routing_and_an_empty_rule_set() -> None:
    crd = schema.load_crds()["InferenceDeployment"]
    fields = {e.field for e in admission.validate(crd, with_routing(target="qwen2-7b-routed", rules={"maxTokens": 8}))}
    assert "spec.routing.target" in fields
    assert "spec.routing.rules" in {e.field for e in admission.validate(crd, with_routing(target="small"))}


def test_a_bad_heartbeat_interval_is_refused() -> None:
    doc = copy.deepcopy(BASE)
    doc["spec"]["router"]["heartbeatInterval"] = "soon"
    assert "spec.router.heartbeatInterval" in problems(doc)
