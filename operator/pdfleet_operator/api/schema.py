"""The CustomResourceDefinitions of the pdfleet.io API, built from the pydantic models (pure).

The CRD schema is the models' JSON schema turned into a Kubernetes *structural* schema: `$ref`s
inlined, `Optional` unwrapped (no `anyOf` with null), OpenAPI v3.0 exclusive bounds, field
descriptions kept, and each model's CEL rules attached as `x-kubernetes-validations`. Admission
(`api.admission`), `pdfleet validate` and the simulator check objects against it; `gen.crds` writes
it to `crds/` and the chart.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel

from pdfleet_operator import api
from pdfleet_operator.api.meta import ApiModel

CATEGORIES = ["pdfleet"]

# Per kind: plural, scope, short names, printer columns. Everything else comes from the model.
KIND_INFO: dict[str, dict[str, Any]] = {
    "AcceleratorClass": {
        "plural": "acceleratorclasses",
        "scope": "Cluster",
        "shortNames": ["acc"],
        "columns": [
            {"name": "Vendor", "type": "string", "jsonPath": ".spec.vendor"},
            {"name": "Resource", "type": "string", "jsonPath": ".spec.resourceName"},
            {"name": "Memory GiB", "type": "number", "jsonPath": ".spec.memoryGiB", "priority": 1},
            {"name": "TFLOPS", "type": "number", "jsonPath": ".spec.peakTflops", "priority": 1},
            {"name": "$/h", "type": "number", "jsonPath": ".spec.costPerHour"},
            {"name": "Free", "type": "integer", "jsonPath": ".status.free", "priority": 1},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    },
    "InferenceDeployment": {
        "plural": "inferencedeployments",
        "scope": "Namespaced",
        "shortNames": ["infdep"],
        "columns": [
            {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
            {"name": "Prefill", "type": "integer", "jsonPath": ".status.prefillReplicas"},
            {"name": "Decode", "type": "integer", "jsonPath": ".status.decodeReplicas"},
            {"name": "P:D", "type": "string", "jsonPath": ".status.pdRatio"},
            {"name": "$/h", "type": "number", "jsonPath": ".status.costPerHour"},
            {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
            {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "priority": 1},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    },
}


def _models_by_name(root: type[BaseModel]) -> dict[str, type[ApiModel]]:
    """Every ApiModel reachable from `root`'s fields, by class name (= the JSON schema $defs key)."""
    found: dict[str, type[ApiModel]] = {}

    def visit(tp: Any) -> None:
        if isinstance(tp, type) and issubclass(tp, ApiModel):
            if tp.__name__ in found:
                assert found[tp.__name__] is tp, f"two API models named {tp.__name__}"
                return
            found[tp.__name__] = tp
            for f in tp.model_fields.values():
                visit(f.annotation)
            return
        if get_origin(tp) is not None or get_args(tp):
            for arg in get_args(tp):
                visit(arg)

    visit(root)
    return found


# Marks, while converting, an object model with `absent_is_unset = True`: the API server must not create it.
_NO_DEFAULT = "x-pdfleet-no-default"


class _Converter:
    def __init__(self, root: type[ApiModel]):
        self.full = root.model_json_schema(by_alias=True, mode="validation")
        self.defs = self.full.get("$defs", {})
        self.models = _models_by_name(root)

    def convert(self, node: dict[str, Any], model_name: str | None = None) -> dict[str, Any]:
        node = copy.deepcopy(node)
        if "$ref" in node:
            name = node.pop("$ref").split("/")[-1]
            target = self.convert(self.defs[name], name)
            if getattr(self.models.get(name), "absent_is_unset", False):
                target[_NO_DEFAULT] = True  # read (and removed) by _object_defaults of the parent
            # Field-level keys (description, default) win over the model's own.
            target.update({k: v for k, v in node.items() if k in ("description", "default")})
            return target
        if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
            options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
            assert len(options) == 1, f"only Optional[X] unions are supported in the API, got {options}"
            inner = self.convert(options[0])
            inner.update({k: v for k, v in node.items() if k in ("description", "default")})
            if inner.get("default", 0) is None:
                del inner["default"]
            return inner

        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in ("title", "$defs"):
                continue
            if key == "additionalProperties" and value is False:
                continue  # structural schemas prune unknown fields; strict validation reports them
            if key == "const":
                out["enum"] = [value]
            elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
                out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
                out[key] = True
            elif key == "properties":
                out["properties"] = {k: self.convert(v) for k, v in value.items()}
            elif key == "items" or (key == "additionalProperties" and isinstance(value, dict)):
                out[key] = self.convert(value)
            else:
                out[key] = value
        if out.get("type") == "object" and "properties" in out:
            self._object_defaults(out)
        if model_name and model_name in self.models:
            rules = self.models[model_name].cel_rules
            if rules:
                out["x-kubernetes-validations"] = [r.as_crd() for r in rules]
        return out

    @staticmethod
    def _object_defaults(obj: dict[str, Any]) -> None:
        """Optional nested objects whose fields all have defaults default to {}, so the API server fills them in."""
        required = set(obj.get("required", ()))
        for name, prop in obj["properties"].items():
            if prop.pop(_NO_DEFAULT, False):
                continue  # a model whose absence means something (`absent_is_unset`): never defaulted into being
            if (
                prop.get("type") == "object"
                and "properties" in prop
                and "default" not in prop
                and not prop.get("required")
                and name not in required
            ):
                prop["default"] = {}

    def root_schema(self) -> dict[str, Any]:
        schema = self.convert(self.full, model_name=None)
        props = schema["properties"]
        props["apiVersion"] = {"type": "string", "description": "APIVersion of this object (pdfleet.io/v1alpha1)."}
        props["kind"] = {"type": "string", "description": "Kind of this object."}
        # The one place a CRD may constrain metadata: the object's name.
        model = self.models[self.full["title"]]
        max_len, pattern = model.name_rule
        props["metadata"] = {
            "type": "object",
            "properties": {
                "name": {
                    "type": "string",
                    "maxLength": max_len,
                    "pattern": pattern,
                    "description": f"The object's name: {model.name_rule_why}.",
                }
            },
        }
        props.get("status", {}).pop("default", None)
        schema["required"] = ["spec"]
        if model.cel_rules:  # rules over the whole object (they may read metadata.name, as Kubernetes allows)
            schema["x-kubernetes-validations"] = [r.as_crd() for r in model.cel_rules]
        return schema


def build_crd(kind: str) -> dict[str, Any]:
    """The CustomResourceDefinition of one kind, as a plain dict."""
    model = api.KINDS[kind]
    info = KIND_INFO[kind]
    schema = _Converter(model).root_schema()
    schema["description"] = (model.__doc__ or "").strip()
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{info['plural']}.{api.GROUP}",
            "labels": {"app.kubernetes.io/name": "pdfleet", "app.kubernetes.io/part-of": "pdfleet"},
        },
        "spec": {
            "group": api.GROUP,
            "scope": info["scope"],
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": info["plural"],
                "singular": kind.lower(),
                "shortNames": info["shortNames"],
                "categories": CATEGORIES,
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": info["columns"],
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


def load_crds(crd_dir: Path | None = None) -> dict[str, dict[str, Any]]:
    """kind -> CRD dict; from files when crd_dir is given (what a cluster has), else generated."""
    if crd_dir is None:
        return {kind: build_crd(kind) for kind in KIND_INFO}
    crds = {}
    for path in sorted(crd_dir.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        crds[doc["spec"]["names"]["kind"]] = doc
    return crds
