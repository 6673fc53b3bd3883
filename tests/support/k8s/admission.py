"""Admission: what kube-apiserver checks and changes before an object is stored. CRD schemas, CEL rules, unknown
fields and defaults (through ``pdfleet_operator.api.admission``), CRD checks, object names, and the built-in
plugins the emulator has (OwnerReferencesPermissionEnforcement lives in :mod:`.rbac`). Mixed into the emulator."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from pdfleet_operator.api import admission as crd_admission
from tests.support.k8s.errors import bad_request, invalid
from tests.support.k8s.resources import ApiResource


class AdmissionMixin:
    """Validation, pruning and defaulting of would-be stored objects."""

    def _admit(self, res: ApiResource, obj: dict, old: dict | None, field_validation: str, warnings: list[str]) -> dict:
        """Validate/prune/default a would-be stored object; returns the object to store."""
        self._check_owner_references(res, obj, old)
        name = obj["metadata"].get("name") or obj["metadata"].get("generateName") or ""
        if res.crd is not None:
            crd = res.crd
            mode = field_validation if field_validation in ("Strict", "Warn", "Ignore") else "Warn"
            errors = crd_admission.validate(crd, obj, unknown_fields=mode, old=old)
            unknown = [e for e in errors if e.reason == "FieldValueUnknown"]
            if unknown:
                raise bad_request("strict decoding error: " + ", ".join(e.message for e in unknown))
            if errors:
                raise invalid(res, name, errors)
            if mode == "Warn":
                warnings += [f'unknown field "{p}"' for p in crd_admission.unknown_fields(crd, obj)]
            obj = crd_admission.apply_defaults(crd, crd_admission.prune_unknown(crd, obj))
        elif res.group == "apiextensions.k8s.io" and res.plural == "customresourcedefinitions":
            errors = crd_admission.check_crd(obj)
            if errors:
                raise invalid(res, name, errors)
        if old is None and obj["metadata"].get("name"):
            label = res.group == "" and res.plural in ("namespaces", "services")
            msgs = crd_admission.name_errors(obj["metadata"]["name"], label=label)
            if msgs:
                raise invalid(
                    res,
                    name,
                    [
                        crd_admission.FieldError(
                            "metadata.name",
                            "FieldValueInvalid",
                            f"Invalid value: {json.dumps(obj['metadata']['name'])}: {msgs[0]}",
                        )
                    ],
                )
        if (res.group, res.plural) == ("apps", "deployments"):
            errors = deployment_strategy_errors(obj)
            if errors:
                raise invalid(res, name, errors)
        if old is None and (res.group, res.plural) == ("", "pods"):
            obj = default_toleration_seconds(obj)
        return obj

    def _normalize(self, res: ApiResource, body: Any, namespace: str | None, name: str | None) -> dict:
        if not isinstance(body, dict):
            raise bad_request("the body of the request must be a JSON/YAML object")
        obj = copy.deepcopy(body)
        if obj.get("kind") not in (None, res.kind):
            raise bad_request(
                f"the kind of the object ({obj.get('kind')}) does not match the expected kind ({res.kind})"
            )
        api_version = obj.get("apiVersion")
        if api_version not in (None, res.api_version):
            known = {r.api_version for r in self._api.values() if r.group == res.group and r.plural == res.plural}
            if api_version not in known:
                raise bad_request(
                    f"the API version in the data ({api_version}) does not match the "
                    f"expected API version ({res.api_version})"
                )
        obj["apiVersion"], obj["kind"] = res.api_version, res.kind
        meta = obj.get("metadata")
        if meta is None:
            meta = obj["metadata"] = {}
        if not isinstance(meta, dict):
            raise bad_request("metadata must be an object")
        if res.namespaced:
            if namespace and meta.get("namespace") and meta["namespace"] != namespace:
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            if namespace:
                meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        if name is not None:
            if meta.get("name") and meta["name"] != name:
                raise bad_request(
                    f"the name of the object ({meta['name']}) does not match the name on the URL ({name})"
                )
            meta["name"] = name
        for key in ("selfLink", "managedFields"):
            meta.pop(key, None)
        return obj

    @staticmethod
    def _spec_part(res: ApiResource, obj: dict) -> dict:
        drop = {"metadata", "status"} if res.has_status else {"metadata"}
        return {k: v for k, v in obj.items() if k not in drop}

    @staticmethod
    def _tracks_generation(res: ApiResource) -> bool:
        return res.crd is not None or (res.has_status and res.plural != "namespaces")


# The DefaultTolerationSeconds admission plugin (on by default in kube-apiserver).
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
DEFAULT_TOLERATION_S = 300
_PERCENT = re.compile(r"^[0-9]+%$")


def default_toleration_seconds(pod: dict) -> dict:
    """A new pod that tolerates neither ``node.kubernetes.io/not-ready`` nor ``unreachable`` (NoExecute) gets a
    300 s toleration for each, so its node's NotReady evicts it after 5 minutes, not at once."""
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        return pod
    tolerations = spec.get("tolerations") or []

    def tolerated(taint: str) -> bool:
        return any(
            (t.get("key") in (taint, None, "")) and (t.get("effect") in ("NoExecute", None, ""))
            for t in tolerations
            if isinstance(t, dict)
        )

    added = [
        {"key": taint, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": DEFAULT_TOLERATION_S}
        for taint in (NOT_READY_TAINT, UNREACHABLE_TAINT)
        if not tolerated(taint)
    ]
    if not added:
        return pod
    pod = copy.deepcopy(pod)
    pod["spec"]["tolerations"] = list(tolerations) + added
    return pod


def deployment_strategy_errors(deployment: dict) -> list[crd_admission.FieldError]:
    """apps/v1 validation of ``spec.strategy``: the type, maxSurge/maxUnavailable as non-negative ints or percents
    (maxUnavailable at most 100%), not both 0, no rollingUpdate with Recreate."""
    strategy = (deployment.get("spec") or {}).get("strategy") or {}
    kind = strategy.get("type") or "RollingUpdate"
    if kind not in ("RollingUpdate", "Recreate"):
        return [
            _invalid_value(
                "spec.strategy.type",
                kind,
                'supported values: "Recreate", "RollingUpdate"',
                reason="FieldValueNotSupported",
                prefix="Unsupported value",
            )
        ]
    rolling = strategy.get("rollingUpdate")
    if kind == "Recreate":
        return (
            []
            if rolling is None
            else [
                crd_admission.FieldError(
                    "spec.strategy.rollingUpdate",
                    "FieldValueForbidden",
                    "Forbidden: may not be specified when strategy `type` is 'Recreate'",
                )
            ]
        )
    errors, values = [], {}
    for name, value in ((n, (rolling or {}).get(n)) for n in ("maxUnavailable", "maxSurge")):
        where = f"spec.strategy.rollingUpdate.{name}"
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            errors.append(_invalid_value(where, value, "must be an integer or percentage"))
        elif isinstance(value, str) and not _PERCENT.match(value):
            errors.append(_invalid_value(where, value, _PERCENT_MESSAGE))
        elif isinstance(value, int) and value < 0:
            errors.append(_invalid_value(where, value, "must be greater than or equal to 0"))
        else:
            values[name] = int(value[:-1]) if isinstance(value, str) else value
    unavailable = (rolling or {}).get("maxUnavailable")
    if isinstance(unavailable, str) and values.get("maxUnavailable", 0) > 100:
        errors.append(
            _invalid_value("spec.strategy.rollingUpdate.maxUnavailable", unavailable, "must not be greater than 100%")
        )
    if values.get("maxUnavailable", 1) == 0 and values.get("maxSurge", 1) == 0:
        errors.append(
            _invalid_value(
                "spec.strategy.rollingUpdate.maxUnavailable", unavailable, "may not be 0 when `maxSurge` is 0"
            )
        )
    return errors


_PERCENT_MESSAGE = (
    "a valid percent string must be a numeric string followed by an ending '%' "
    "(e.g. '1%',  or '93%', regex used for validation is '[0-9]+%')"
)


def _invalid_value(
    field: str, value: object, detail: str, *, reason: str = "FieldValueInvalid", prefix: str = "Invalid value"
) -> crd_admission.FieldError:
    return crd_admission.FieldError(field, reason, f"{prefix}: {json.dumps(value)}: {detail}")
