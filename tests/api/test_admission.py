"""pdfleet_operator.api.admission: kube-apiserver's CR admission (structural schema + CEL), offline.

Small hand-written CRDs pin each rule and the Kubernetes wording of its message; the project's
generated CRDs (crds/*.yaml) must accept every example in examples/.
"""

from __future__ import annotations

import copy
import pathlib

import pytest
import yaml

from pdfleet_operator.api import admission
from pdfleet_operator.api.admission import FieldError

REPO = pathlib.Path(__file__).resolve().parents[2]


def make_crd(
    spec_schema: dict,
    *,
    status: dict | None = None,
    scope: str = "Namespaced",
    versions: list[str] = ("v1",),
    spec_rules: list[dict] | None = None,
) -> dict:
    spec = dict(spec_schema)
    if spec_rules:
        spec["x-kubernetes-validations"] = spec_rules
    schema = {
        "type": "object",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status or {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "things.example.io"},
        "spec": {
            "group": "example.io",
            "scope": scope,
            "names": {"plural": "things", "singular": "thing", "kind": "Thing"},
            "versions": [
                {"name": v, "served": True, "storage": i == 0, "schema": {"openAPIV3Schema": copy.deepcopy(schema)}}
                for i, v in enumerate(versions)
            ],
        },
    }


def thing(spec: dict, name: str = "t", version: str = "v1", **top) -> dict:
    return {"apiVersion": f"example.io/{version}", "kind": "Thing", "metadata": {"name": name}, "spec": spec, **top}


SPEC = {
    "type": "object",
    "required": ["replicas"],
    "properties": {
        "replicas": {"type": "integer", "minimum": 1, "maximum": 10},
        "ratio": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "exclusiveMaximum": True, "maximum": 1},
        "step": {"type": "integer", "multipleOf": 4},
        "tier": {"type": "string", "enum": ["latency", "cost"], "default": "latency"},
        "name": {"type": "string", "pattern": "^[a-z0-9-]+$", "minLength": 2, "maxLength": 8},
        "since": {"type": "string", "format": "date-time"},
        "email": {"type": "string", "format": "email"},
        "classes": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "x-kubernetes-list-type": "set",
            "items": {"type": "string"},
        },
        "pools": {
            "type": "array",
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["role"],
            "items": {
                "type": "object",
                "required": ["role"],
                "properties": {"role": {"type": "string"}, "size": {"type": "integer", "default": 1}},
            },
        },
        "labels": {"type": "object", "additionalProperties": {"type": "string"}, "maxProperties": 2},
        "quantity": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "maybe": {"type": "string", "nullable": True},
        "flag": {"type": "boolean"},
        "template": {
            "type": "object",
            "x-kubernetes-embedded-resource": True,
            "properties": {"spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
        },
        "limits": {
            "type": "object",
            "properties": {"min": {"type": "integer"}, "max": {"type": "integer"}},
            "x-kubernetes-validations": [
                {"rule": "self.min <= self.max", "message": "min must be <= max", "fieldPath": ".min"},
                {
                    "rule": "self.max < 100",
                    "messageExpression": "'max is ' + string(self.max) + ', too big'",
                    "reason": "FieldValueForbidden",
                },
            ],
        },
        "immutable": {
            "type": "string",
            "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": "immutable is immutable"}],
        },
    },
}

CRD = make_crd(
    SPEC,
    spec_rules=[
        {
            "rule": "!has(self.classes) || self.classes.all(c, c.matches('^[a-z0-9-]+$'))",
            "message": "classes must be DNS labels",
        },
        {"rule": "size(self.pools) <= 2 || !has(self.pools)"},
    ],
)


def errors_of(spec: dict, **kw) -> list[FieldError]:
    return admission.validate(CRD, thing(spec), **kw)


def only(spec: dict, **kw) -> FieldError:
    errors = [e for e in errors_of(spec, **kw) if e.field]  # minus the "rules were not checked" note
    assert len(errors) == 1, errors
    return errors[0]


def test_a_valid_object_has_no_errors():
    assert (
        errors_of(
            {
                "replicas": 3,
                "ratio": 0.5,
                "classes": ["a", "b"],
                "pools": [{"role": "p"}, {"role": "d"}],
                "labels": {"a": "b"},
                "quantity": "10Gi",
                "free": {"anything": [1, {"x": None}]},
                "maybe": None,
                "limits": {"min": 1, "max": 2},
                "since": "2026-01-01T00:00:00Z",
                "email": "a@b.io",
                "template": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": {"containers": []}},
            }
        )
        == []
    )


@pytest.mark.parametrize(
    ("spec", "field", "reason", "message"),
    [
        ({}, "spec.replicas", "FieldValueRequired", "Required value"),
        (
            {"replicas": 0},
            "spec.replicas",
            "FieldValueInvalid",
            "Invalid value: 0: spec.replicas in body should be greater than or equal to 1",
        ),
        (
            {"replicas": 11},
            "spec.replicas",
            "FieldValueInvalid",
            "Invalid value: 11: spec.replicas in body should be less than or equal to 10",
        ),
        (
            {"replicas": 1, "ratio": 0},
            "spec.ratio",
            "FieldValueInvalid",
            "Invalid value: 0: spec.ratio in body should be greater than 0",
        ),
        (
            {"replicas": 1, "ratio": 1.0},
            "spec.ratio",
            "FieldValueInvalid",
            "Invalid value: 1: spec.ratio in body should be less than 1",
        ),
        (
            {"replicas": 1, "step": 6},
            "spec.step",
            "FieldValueInvalid",
            "Invalid value: 6: spec.step in body should be a multiple of 4",
        ),
        (
            {"replicas": 1, "tier": "fast"},
            "spec.tier",
            "FieldValueNotSupported",
            'Unsupported value: "fast": supported values: "latency", "cost"',
        ),
        (
            {"replicas": 1, "name": "Bad!"},
            "spec.name",
            "FieldValueInvalid",
            "Invalid value: \"Bad!\": spec.name in body should match '^[a-z0-9-]+$'",
        ),
        (
            {"replicas": 1, "name": "a"},
            "spec.name",
            "FieldValueInvalid",
            'Invalid value: "a": spec.name in body should be at least 2 chars long',
        ),
        (
            {"replicas": 1, "name": "abcdefghij"},
            "spec.name",
            "FieldValueTooLong",
            "Too long: may not be more than 8 bytes",
        ),
        (
            {"replicas": 1, "since": "yesterday"},
            "spec.since",
            "FieldValueInvalid",
            'Invalid value: "yesterday": spec.since in body must be of type date-time: "yesterday"',
        ),
        (
            {"replicas": 1, "email": "nope"},
            "spec.email",
            "FieldValueInvalid",
            'Invalid value: "nope": spec.email in body must be of type email: "nope"',
        ),
        (
            {"replicas": 1, "classes": []},
            "spec.classes",
            "FieldValueInvalid",
            "Invalid value: []: spec.classes in body should have at least 1 items",
        ),
        (
            {"replicas": 1, "classes": ["a", "b", "c", "d"]},
            "spec.classes",
            "FieldValueTooMany",
            "Too many: 4: must have at most 3 items",
        ),
        ({"replicas": 1, "classes": ["a", "a"]}, "spec.classes[1]", "FieldValueDuplicate", 'Duplicate value: "a"'),
        (
            {"replicas": 1, "pools": [{"role": "p"}, {"role": "p", "size": 2}]},
            "spec.pools[1]",
            "FieldValueDuplicate",
            'Duplicate value: {"role":"p"}',
        ),
        ({"replicas": 1, "pools": [{"size": 2}]}, "spec.pools[0].role", "FieldValueRequired", "Required value"),
        (
            {"replicas": 1, "labels": {"a": 1}},
            "spec.labels.a",
            "FieldValueTypeInvalid",
            'Invalid value: "integer": spec.labels.a in body must be of type string: "integer"',
        ),
        (
            {"replicas": 1, "labels": {"a": "1", "b": "2", "c": "3"}},
            "spec.labels",
            "FieldValueTooMany",
            "Too many: 3: must have at most 2 items",
        ),
        (
            {"replicas": 1, "flag": "yes"},
            "spec.flag",
            "FieldValueTypeInvalid",
            'Invalid value: "string": spec.flag in body must be of type boolean: "string"',
        ),
        (
            {"replicas": 1, "quantity": 1.5},
            "spec.quantity",
            "FieldValueTypeInvalid",
            'Invalid value: "number": spec.quantity in body must be of type integer-or-string: "number"',
        ),
        (
            {"replicas": 1, "classes": ["Bad"]},
            "spec",
            "FieldValueInvalid",
            'Invalid value: "object": classes must be DNS labels',
        ),
        (
            {"replicas": 1, "pools": [{"role": "a"}, {"role": "b"}, {"role": "c"}]},
            "spec",
            "FieldValueInvalid",
            'Invalid value: "object": failed rule: size(self.pools) <= 2 || !has(self.pools)',
        ),
        (
            {"replicas": 1, "limits": {"min": 5, "max": 2}},
            "spec.limits.min",
            "FieldValueInvalid",
            'Invalid value: "object": min must be <= max',
        ),
        (
            {"replicas": 1, "limits": {"min": 5, "max": 200}},
            "spec.limits",
            "FieldValueForbidden",
            "Forbidden: max is 200, too big",
        ),
    ],
)
def test_each_rule_reports_the_field_and_kubernetes_wording(spec, field, reason, message):
    error = only(spec)
    assert (error.field, error.reason, error.message) == (field, reason, message)


def test_type_errors_stop_cel_like_the_api_server():
    errors = errors_of({"replicas": "three", "classes": ["Bad"]})
    assert errors[0] == FieldError(
        "spec.replicas",
        "FieldValueTypeInvalid",
        'Invalid value: "string": spec.replicas in body must be of type integer: "string"',
    )
    assert "some validation rules were not checked" in errors[-1].message
    assert not any("DNS labels" in e.message for e in errors)


def test_unknown_fields_strict_reports_them_and_other_modes_leave_them_to_pruning():
    obj = thing({"replicas": 1, "bogus": 1, "pools": [{"role": "p", "extra": True}], "free": {"ok": 1}}, extra=1)
    strict = admission.validate(CRD, obj)
    assert [(e.field, e.reason, e.message) for e in strict] == [
        ("extra", "FieldValueUnknown", 'unknown field "extra"'),
        ("spec.bogus", "FieldValueUnknown", 'unknown field "spec.bogus"'),
        ("spec.pools[0].extra", "FieldValueUnknown", 'unknown field "spec.pools[0].extra"'),
    ]
    assert admission.validate(CRD, obj, unknown_fields="Warn") == []
    assert admission.validate(CRD, obj, unknown_fields="Ignore") == []
    pruned = admission.prune_unknown(CRD, obj)
    assert pruned["spec"] == {"replicas": 1, "pools": [{"role": "p"}], "free": {"ok": 1}}
    assert "extra" not in pruned and pruned["metadata"] == {"name": "t"}
    assert obj["spec"]["bogus"] == 1  # the input is not modified
    assert admission.unknown_fields(CRD, obj) == ["extra", "spec.bogus", "spec.pools[0].extra"]


def test_defaults_fill_in_and_nulls_of_non_nullable_fields_drop():
    obj = thing({"replicas": 2, "tier": None, "pools": [{"role": "p"}], "maybe": None})
    defaulted = admission.apply_defaults(CRD, obj)
    assert defaulted["spec"]["tier"] == "latency"
    assert defaulted["spec"]["pools"] == [{"role": "p", "size": 1}]
    assert defaulted["spec"]["maybe"] is None  # nullable: kept
    assert admission.validate(CRD, obj) == []


def test_transition_rules_run_only_with_the_old_object():
    new = thing({"replicas": 1, "immutable": "b"})
    assert admission.validate(CRD, new) == []  # on create, oldSelf does not exist
    old = thing({"replicas": 1, "immutable": "a"})
    assert admission.validate(CRD, new, old=old) == [
        FieldError("spec.immutable", "FieldValueInvalid", 'Invalid value: "string": immutable is immutable')
    ]
    assert admission.validate(CRD, new, old=thing({"replicas": 1, "immutable": "b"})) == []


def test_metadata_name_api_version_and_kind():
    bad_name = admission.validate(CRD, thing({"replicas": 1}, name="Not_A_Name"))
    assert bad_name[0].field == "metadata.name" and bad_name[0].reason == "FieldValueInvalid"
    assert "lowercase RFC 1123 subdomain" in bad_name[0].message
    no_name = admission.validate(CRD, {**thing({"replicas": 1}), "metadata": {}})
    assert no_name == [
        FieldError("metadata.name", "FieldValueRequired", "Required value: name or generateName is required")
    ]
    assert admission.validate(CRD, {**thing({"replicas": 1}), "metadata": {"generateName": "t-"}}) == []
    wrong_version = admission.validate(CRD, thing({"replicas": 1}, version="v2"))
    assert wrong_version == [
        FieldError(
            "apiVersion",
            "FieldValueNotSupported",
            'Unsupported value: "example.io/v2": supported values: "example.io/v1"',
        )
    ]
    wrong_kind = admission.validate(CRD, {**thing({"replicas": 1}), "kind": "Other"})
    assert wrong_kind[0].field == "kind"
    cluster = make_crd(SPEC, scope="Cluster")
    namespaced = admission.validate(cluster, {**thing({"replicas": 1}), "metadata": {"name": "t", "namespace": "x"}})
    assert namespaced[0].field == "metadata.namespace"


def test_versions_are_looked_up_from_api_version():
    crd = make_crd({"type": "object", "properties": {"a": {"type": "integer"}}}, versions=["v1", "v2beta1"])
    crd["spec"]["versions"][1]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["a"] = {
        "type": "string"
    }
    assert admission.validate(crd, thing({"a": 1})) == []
    assert admission.validate(crd, thing({"a": 1}, version="v2beta1"))[0].field == "spec.a"
    crd["spec"]["versions"][1]["served"] = False
    assert admission.validate(crd, thing({"a": "x"}, version="v2beta1"))[0].field == "apiVersion"


def test_status_message_is_the_kubernetes_one():
    one = [FieldError("spec.a", "FieldValueRequired", "Required value")]
    assert (
        admission.status_message("Thing", "example.io", "t", one)
        == 'Thing.example.io "t" is invalid: spec.a: Required value'
    )
    two = one + [FieldError("spec.b", "FieldValueInvalid", "Invalid value: 0: x")]
    assert (
        admission.status_message("Thing", "example.io", "t", two)
        == 'Thing.example.io "t" is invalid: [spec.a: Required value, spec.b: Invalid value: 0: x]'
    )


def test_check_crd_catches_bad_names_and_cel_that_does_not_compile():
    assert admission.check_crd(CRD) == []
    broken = make_crd(SPEC, spec_rules=[{"rule": "self.replicas >"}])
    errors = admission.check_crd(broken)
    assert len(errors) == 1 and "compilation failed" in errors[0].message
    assert errors[0].field.startswith("spec.versions[0].schema.openAPIV3Schema.spec.x-kubernetes-validations")
    misnamed = copy.deepcopy(CRD)
    misnamed["metadata"]["name"] = "wrong"
    assert admission.check_crd(misnamed)[0].field == "metadata.name"


def test_the_project_crds_accept_every_example():
    crds = {}
    for path in sorted((REPO / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        assert admission.check_crd(crd) == [], path
        crds[crd["spec"]["names"]["kind"]] = crd
    assert crds, "crds/*.yaml are generated and committed"
    checked = 0
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") in crds:
                assert admission.validate(crds[doc["kind"]], doc) == [], (path.name, doc["metadata"]["name"])
                checked += 1
    assert checked > 0


def test_admission_does_not_import_kopf_kubernetes_or_torch():
    import subprocess
    import sys

    code = (
        "import sys, pdfleet_operator.api.admission as a; a.validate({}, {}); "
        "bad = [m for m in ('kopf', 'kubernetes', 'torch') if m in sys.modules]; print(bad); sys.exit(bool(bad))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0
