"""Admission checks for custom resources, as kube-apiserver applies them for a CRD.

Given a ``CustomResourceDefinition`` (as a plain dict, e.g. loaded from ``crds/*.yaml``) and a custom
resource, :func:`validate` reports what the real API server would reject on create/update:

* the version lookup from ``apiVersion`` (the version must exist and be served) and the ``kind``;
* ``metadata.name`` (a DNS subdomain, or ``generateName``);
* unknown fields (only with ``unknown_fields="Strict"``, kubectl's default ``--validate=strict``);
* the structural ``openAPIV3Schema``: type, required, enum, pattern, minimum/maximum (+exclusive),
  multipleOf, minLength/maxLength, minItems/maxItems, minProperties/maxProperties, the formats
  Kubernetes checks, nullable, additionalProperties, allOf/anyOf/oneOf/not,
  ``x-kubernetes-int-or-string``, ``x-kubernetes-preserve-unknown-fields``,
  ``x-kubernetes-embedded-resource``, ``x-kubernetes-list-type`` set/map uniqueness;
* CEL ``x-kubernetes-validations`` (rule, message, messageExpression, fieldPath, reason) evaluated
  with ``cel-python``; transition rules (those using ``oldSelf``) only when an old object is given.

Defaults from the schema are applied (on a copy) before validation, as the API server does.
Messages follow Kubernetes' wording (``Invalid value: 0: spec.x in body should be greater than or
equal to 1``), so a message read here is the one ``kubectl`` would print.

This module is pure: it imports no kopf, Kubernetes client or torch (``pdfleet validate`` uses it).
Not covered: the Kubernetes CEL extension libraries beyond a few list/string helpers (no
``quantity()``, ``url()``, ``ip()``, ``format.*``), ratcheting of unchanged invalid values,
CEL cost limits, and validation of labels/annotations syntax.
"""

from __future__ import annotations

import base64
import copy
import datetime
import functools
import ipaddress
import json
import math
import re
import uuid
from typing import Any

from pdfleet_operator.api import cel
from pdfleet_operator.api import field_errors as fe
from pdfleet_operator.api.field_errors import FieldError, status_message

__all__ = [
    "FieldError",
    "validate",
    "prune_unknown",
    "apply_defaults",
    "unknown_fields",
    "find_version",
    "check_crd",
    "status_message",
    "DNS1123_SUBDOMAIN",
]


# ---------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------

DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_SUBDOMAIN = DNS1123_LABEL + r"(\." + DNS1123_LABEL + r")*"
_SUBDOMAIN_RE = re.compile(f"^{DNS1123_SUBDOMAIN}$")
_LABEL_RE = re.compile(f"^{DNS1123_LABEL}$")


def name_errors(name: str, *, label: bool = False) -> list[str]:
    """Kubernetes' messages for an invalid object name (DNS subdomain, or DNS label for namespaces)."""
    if label:
        msgs = []
        if len(name) > 63:
            msgs.append("must be no more than 63 characters")
        if not _LABEL_RE.match(name):
            msgs.append(
                "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
                "and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', "
                f"regex used for validation is '{DNS1123_LABEL}')"
            )
        return msgs
    msgs = []
    if len(name) > 253:
        msgs.append("must be no more than 253 characters")
    if not _SUBDOMAIN_RE.match(name):
        msgs.append(
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
            "and must start and end with an alphanumeric character (e.g. 'example.com', "
            f"regex used for validation is '{DNS1123_SUBDOMAIN}')"
        )
    return msgs


# ---------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------
# CRD helpers
# ---------------------------------------------------------------------------------------------


def find_version(crd: dict, api_version: str | None) -> dict | None:
    """The CRD's version entry for an object's ``apiVersion`` (``group/version``), if served."""
    spec = crd.get("spec") or {}
    if not api_version or "/" not in api_version:
        return None
    group, _, version = api_version.rpartition("/")
    if group != spec.get("group"):
        return None
    for entry in spec.get("versions") or []:
        if entry.get("name") == version and entry.get("served", True):
            return entry
    return None


def _schema_of(crd: dict, version: dict | None) -> dict:
    if version is not None and (version.get("schema") or {}).get("openAPIV3Schema") is not None:
        return version["schema"]["openAPIV3Schema"]
    # apiextensions.k8s.io/v1beta1 style: a top-level validation.
    legacy = ((crd.get("spec") or {}).get("validation") or {}).get("openAPIV3Schema")
    return legacy if legacy is not None else {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _type_ok(schema_type: str, value: Any) -> bool:
    if schema_type == "object":
        return isinstance(value, dict)
    if schema_type == "array":
        return isinstance(value, list)
    if schema_type == "string":
        return isinstance(value, str)
    if schema_type == "boolean":
        return isinstance(value, bool)
    if schema_type == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if schema_type == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return True


# ---------------------------------------------------------------------------------------------
# Pruning, unknown fields, defaulting
# ---------------------------------------------------------------------------------------------

_TOP_LEVEL = ("apiVersion", "kind", "metadata")


def _walk_unknown(schema: dict, value: Any, path: str, found: list[str], prune: bool, *, root: bool = False) -> Any:
    """Find (and optionally drop) fields that the structural schema does not specify."""
    if not isinstance(schema, dict):
        return value
    if (
        schema.get("x-kubernetes-preserve-unknown-fields")
        and not schema.get("properties")
        and not isinstance(schema.get("additionalProperties"), dict)
    ):
        return value
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        embedded = bool(schema.get("x-kubernetes-embedded-resource"))
        preserve = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        for key in list(value):
            sub = value[key]
            if (root or embedded) and key in _TOP_LEVEL:
                if key == "metadata":
                    continue  # ObjectMeta is handled by the API machinery, not by the CRD schema
                if key in props:
                    value[key] = _walk_unknown(props[key], sub, fe.child(path, key), found, prune)
                continue
            if key in props:
                value[key] = _walk_unknown(props[key], sub, fe.child(path, key), found, prune)
            elif isinstance(additional, dict):
                value[key] = _walk_unknown(additional, sub, fe.child(path, key), found, prune)
            elif additional is True or preserve:
                continue
            else:
                found.append(fe.child(path, key))
                if prune:
                    del value[key]
        return value
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            value[i] = _walk_unknown(schema["items"], item, fe.index(path, i), found, prune)
    return value


def unknown_fields(crd: dict, obj: dict) -> list[str]:
    """The paths of fields the object's schema does not know (``spec.foo``, ``spec.roles[0].x``)."""
    schema = _schema_of(crd, find_version(crd, obj.get("apiVersion")))
    found: list[str] = []
    _walk_unknown(schema, copy.deepcopy(obj), "", found, prune=False, root=True)
    return sorted(found)


def prune_unknown(crd: dict, obj: dict) -> dict:
    """Return a copy of the object without fields unknown to the schema (structural pruning)."""
    schema = _schema_of(crd, find_version(crd, obj.get("apiVersion")))
    result = copy.deepcopy(obj)
    _walk_unknown(schema, result, "", [], prune=True, root=True)
    return result


def _default(schema: dict, value: Any) -> Any:
    if not isinstance(schema, dict):
        return value
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for key, sub in props.items():
            if not isinstance(sub, dict):
                continue
            if key in value and value[key] is None and not sub.get("nullable"):
                del value[key]  # nulls of non-nullable fields are dropped (and then defaulted)
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
        for key in list(value):
            if key in props:
                value[key] = _default(props[key], value[key])
            elif isinstance(schema.get("additionalProperties"), dict):
                value[key] = _default(schema["additionalProperties"], value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            value[i] = _default(schema["items"], item)
    return value


def apply_defaults(crd: dict, obj: dict) -> dict:
    """Return a copy of the object with the schema's defaults filled in (as the API server does)."""
    schema = _schema_of(crd, find_version(crd, obj.get("apiVersion")))
    result = copy.deepcopy(obj)
    _default(schema, result)
    return result


# ---------------------------------------------------------------------------------------------
# Formats Kubernetes checks (kube-openapi's strfmt registry, the useful part of it)
# ---------------------------------------------------------------------------------------------

_DURATION_RE = re.compile(
    r"^(?:[-+]?\d+(?:\.\d+)?(?:ns|us|µs|ms|s|m|h|d|w))+$|^\d+\s*(?:ns|us|ms|s|sec|secs|second|seconds|m|min|mins|minute|minutes|h|hr|hour|hours|d|day|days|w|wk|week|weeks)$"
)
_EMAIL_RE = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")
_HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?)*$"
)
_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_DATETIME_RE = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")
_MAC_RE = re.compile(r"^([0-9A-Fa-f]{2}[:-]){5}[0-9A-Fa-f]{2}$")


def _format_ok(fmt: str, value: str) -> bool:
    try:
        if fmt == "date-time" or fmt == "datetime":
            if not _DATETIME_RE.match(value):
                return False
            datetime.datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
            return True
        if fmt == "date":
            if not _DATE_RE.match(value):
                return False
            datetime.date.fromisoformat(value)
            return True
        if fmt == "duration":
            return bool(_DURATION_RE.match(value))
        if fmt == "email":
            return bool(_EMAIL_RE.match(value))
        if fmt == "hostname":
            return bool(_HOSTNAME_RE.match(value))
        if fmt == "ipv4":
            ipaddress.IPv4Address(value)
            return True
        if fmt == "ipv6":
            ipaddress.IPv6Address(value)
            return True
        if fmt == "cidr":
            ipaddress.ip_network(value, strict=False)
            return "/" in value
        if fmt == "mac":
            return bool(_MAC_RE.match(value))
        if fmt in ("uuid", "uuid3", "uuid4", "uuid5"):
            u = uuid.UUID(value)
            return fmt == "uuid" or u.version == int(fmt[-1])
        if fmt == "byte":
            base64.b64decode(value, validate=True)
            return True
        if fmt == "uri":
            return bool(re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", value))
    except (ValueError, TypeError):
        return False
    return True  # int32, int64, float, double, password and unknown formats are not checked


# ---------------------------------------------------------------------------------------------
# Structural schema validation
# ---------------------------------------------------------------------------------------------


class _Validator:
    def __init__(self) -> None:
        self.errors: list[FieldError] = []

    def add(self, error: FieldError) -> None:
        self.errors.append(error)

    def check(self, schema: dict, value: Any, path: str, *, root: bool = False) -> None:
        if not isinstance(schema, dict):
            return
        body = path or "<root>"

        if value is None:
            if schema.get("nullable"):
                return
            if schema.get("type"):
                self.add(fe.type_invalid(path, "null", f'{body} in body must be of type {schema["type"]}: "null"'))
            return

        int_or_string = bool(schema.get("x-kubernetes-int-or-string"))
        stype = schema.get("type")
        if int_or_string:
            if not (isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))):
                self.add(
                    fe.type_invalid(
                        path,
                        _type_name(value),
                        f'{body} in body must be of type integer-or-string: "{_type_name(value)}"',
                    )
                )
                return
        elif stype and not _type_ok(stype, value):
            self.add(
                fe.type_invalid(
                    path, _type_name(value), f'{body} in body must be of type {stype}: "{_type_name(value)}"'
                )
            )
            return

        # Combinators (value validations only in structural schemas).
        for sub in schema.get("allOf") or []:
            self.check(sub, value, path)
        if schema.get("anyOf"):
            if not any(not _errors_for(sub, value, path) for sub in schema["anyOf"]):
                self.add(fe.invalid(path, value, f"{body} in body must validate at least one schema (anyOf)"))
        if schema.get("oneOf"):
            matches = sum(1 for sub in schema["oneOf"] if not _errors_for(sub, value, path))
            if matches != 1:
                self.add(fe.invalid(path, value, f"{body} in body must validate one and only one schema (oneOf)"))
        if isinstance(schema.get("not"), dict) and not _errors_for(schema["not"], value, path):
            self.add(fe.invalid(path, value, f"{body} in body should not match the schema (not)"))

        if "enum" in schema and isinstance(schema["enum"], list) and value not in schema["enum"]:
            self.add(fe.not_supported(path, value, schema["enum"]))

        if isinstance(value, bool):
            pass
        elif isinstance(value, (int, float)):
            self._number(schema, value, path, body)
        elif isinstance(value, str):
            self._string(schema, value, path, body)
        elif isinstance(value, list):
            self._array(schema, value, path, body)
        elif isinstance(value, dict):
            self._object(schema, value, path, body, root=root)

    def _number(self, schema: dict, value: float, path: str, body: str) -> None:
        if "minimum" in schema:
            lo = schema["minimum"]
            if schema.get("exclusiveMinimum") is True:
                if not value > lo:
                    self.add(fe.invalid(path, value, f"{body} in body should be greater than {fe.num(lo)}"))
            elif not value >= lo:
                self.add(fe.invalid(path, value, f"{body} in body should be greater than or equal to {fe.num(lo)}"))
        elif isinstance(schema.get("exclusiveMinimum"), (int, float)) and not isinstance(
            schema["exclusiveMinimum"], bool
        ):
            if not value > schema["exclusiveMinimum"]:
                self.add(
                    fe.invalid(
                        path, value, f"{body} in body should be greater than {fe.num(schema['exclusiveMinimum'])}"
                    )
                )
        if "maximum" in schema:
            hi = schema["maximum"]
            if schema.get("exclusiveMaximum") is True:
                if not value < hi:
                    self.add(fe.invalid(path, value, f"{body} in body should be less than {fe.num(hi)}"))
            elif not value <= hi:
                self.add(fe.invalid(path, value, f"{body} in body should be less than or equal to {fe.num(hi)}"))
        elif isinstance(schema.get("exclusiveMaximum"), (int, float)) and not isinstance(
            schema["exclusiveMaximum"], bool
        ):
            if not value < schema["exclusiveMaximum"]:
                self.add(
                    fe.invalid(path, value, f"{body} in body should be less than {fe.num(schema['exclusiveMaximum'])}")
                )
        if schema.get("multipleOf"):
            factor = schema["multipleOf"]
            quotient = value / factor
            if not math.isclose(quotient, round(quotient), rel_tol=0, abs_tol=1e-9):
                self.add(fe.invalid(path, value, f"{body} in body should be a multiple of {fe.num(factor)}"))

    def _string(self, schema: dict, value: str, path: str, body: str) -> None:
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            self.add(fe.too_long(path, schema["maxLength"]))
        if "minLength" in schema and len(value) < schema["minLength"]:
            self.add(fe.invalid(path, value, f"{body} in body should be at least {schema['minLength']} chars long"))
        if "pattern" in schema:
            if _compiled(schema["pattern"]).search(value) is None:
                self.add(fe.invalid(path, value, f"{body} in body should match '{schema['pattern']}'"))
        if "format" in schema and not _format_ok(schema["format"], value):
            self.add(fe.invalid(path, value, f"{body} in body must be of type {schema['format']}: {json.dumps(value)}"))

    def _array(self, schema: dict, value: list, path: str, body: str) -> None:
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            self.add(fe.too_many(path, len(value), schema["maxItems"]))
        if "minItems" in schema and len(value) < schema["minItems"]:
            self.add(fe.invalid(path, value, f"{body} in body should have at least {schema['minItems']} items"))
        items = schema.get("items")
        if isinstance(items, dict):
            for i, item in enumerate(value):
                self.check(items, item, fe.index(path, i))
        list_type = schema.get("x-kubernetes-list-type")
        if list_type == "set" or schema.get("uniqueItems"):
            seen: list[Any] = []
            for i, item in enumerate(value):
                if item in seen:
                    self.add(fe.duplicate(fe.index(path, i), item))
                else:
                    seen.append(item)
        elif list_type == "map":
            keys = schema.get("x-kubernetes-list-map-keys") or []
            seen_keys: list[tuple] = []
            for i, item in enumerate(value):
                if not isinstance(item, dict):
                    continue
                key = tuple(item.get(k) for k in keys)
                if key in seen_keys:
                    self.add(fe.duplicate(fe.index(path, i), {k: item.get(k) for k in keys}))
                else:
                    seen_keys.append(key)

    def _object(self, schema: dict, value: dict, path: str, body: str, *, root: bool) -> None:
        props = schema.get("properties") or {}
        for key in schema.get("required") or []:
            if key not in value or (value[key] is None and not (props.get(key) or {}).get("nullable")):
                self.add(fe.required(fe.child(path, key)))
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            self.add(fe.too_many(path, len(value), schema["maxProperties"]))
        if "minProperties" in schema and len(value) < schema["minProperties"]:
            self.add(
                fe.invalid(path, value, f"{body} in body should have at least {schema['minProperties']} properties")
            )
        additional = schema.get("additionalProperties")
        for key, sub in value.items():
            if root and key == "metadata":
                continue
            if key in props:
                self.check(props[key], sub, fe.child(path, key))
            elif isinstance(additional, dict):
                self.check(additional, sub, fe.child(path, key))


def _errors_for(schema: dict, value: Any, path: str) -> list[FieldError]:
    v = _Validator()
    v.check(schema, value, path)
    return v.errors


@functools.lru_cache(maxsize=512)
def _compiled(pattern: str) -> re.Pattern[str]:
    # Go's RE2 and Python's re agree on the patterns CRDs use; \z is Go's end of text.
    return re.compile(pattern.replace(r"\z", r"\Z"))


# ---------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------


def validate(crd: dict, obj: dict, *, unknown_fields: str = "Strict", old: dict | None = None) -> list[FieldError]:
    """Validate a custom resource the way kube-apiserver's admission would for this CRD.

    ``unknown_fields`` is the request's ``fieldValidation``: ``Strict`` reports unknown fields
    (reason ``FieldValueUnknown``); ``Warn`` and ``Ignore`` do not (the caller prunes them).
    ``old`` is the stored object on updates: transition rules (``oldSelf``) run only with it.
    Defaults are applied to a copy before the schema and CEL checks, as the API server does.
    """
    spec = crd.get("spec") or {}
    errors: list[FieldError] = []
    api_version = obj.get("apiVersion")
    version = find_version(crd, api_version)
    group = spec.get("group", "")
    if version is None:
        served = [f"{group}/{v.get('name')}" for v in spec.get("versions") or [] if v.get("served", True)]
        if not api_version:
            errors.append(fe.required("apiVersion"))
        else:
            errors.append(fe.not_supported("apiVersion", api_version, served))
        return errors
    kind = (spec.get("names") or {}).get("kind")
    if obj.get("kind") != kind:
        errors.append(fe.not_supported("kind", obj.get("kind"), [kind]))

    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        meta = {}
    name = meta.get("name")
    if not name and not meta.get("generateName"):
        errors.append(fe.required("metadata.name", "name or generateName is required"))
    elif name:
        for msg in name_errors(str(name)):
            errors.append(fe.invalid("metadata.name", name, msg))
    if (spec.get("scope") == "Cluster") and meta.get("namespace"):
        errors.append(fe.forbidden("metadata.namespace", "not allowed on this type"))

    schema = _schema_of(crd, version)
    # Name constraints that a CRD may declare in its schema's metadata.
    meta_schema = (schema.get("properties") or {}).get("metadata") or {}
    if name and isinstance((meta_schema.get("properties") or {}).get("name"), dict):
        v = _Validator()
        v.check(meta_schema["properties"]["name"], name, "metadata.name")
        errors += v.errors

    if unknown_fields == "Strict":
        found: list[str] = []
        _walk_unknown(schema, copy.deepcopy(obj), "", found, prune=False, root=True)
        for path in sorted(found):
            errors.append(FieldError(path, "FieldValueUnknown", f'unknown field "{path}"'))

    work = copy.deepcopy(obj)
    _walk_unknown(schema, work, "", [], prune=True, root=True)
    _default(schema, work)
    old_work = None
    if old is not None:
        old_work = copy.deepcopy(old)
        _walk_unknown(schema, old_work, "", [], prune=True, root=True)
        _default(schema, old_work)

    validator = _Validator()
    validator.check(schema, work, "", root=True)
    errors += validator.errors

    # Like kube-apiserver: CEL rules are not run over values of the wrong type.
    if any(e.reason in ("FieldValueTypeInvalid",) for e in validator.errors) and cel.walk_rules(schema, ""):
        errors.append(
            FieldError(
                "",
                "FieldValueInvalid",
                "some validation rules were not checked because the object was invalid; "
                "correct the existing errors to complete validation",
            )
        )
        return errors
    cel_errors: list[FieldError] = []
    root_value = {k: v for k, v in work.items() if k != "metadata"}
    root_value["metadata"] = {k: meta.get(k) for k in ("name", "generateName") if k in meta}
    old_root = None
    if old_work is not None:
        old_root = {k: v for k, v in old_work.items() if k != "metadata"}
        old_root["metadata"] = {
            k: (old.get("metadata") or {}).get(k) for k in ("name", "generateName") if k in (old.get("metadata") or {})
        }
    cel.check_cel(schema, root_value, old_root, old_root is not None, "", cel_errors)
    errors += cel_errors
    return errors


def check_crd(crd: dict) -> list[FieldError]:
    """Sanity checks a CRD the way the API server does on create: names, versions, CEL compiles."""
    errors: list[FieldError] = []
    if crd.get("apiVersion") != "apiextensions.k8s.io/v1" or crd.get("kind") != "CustomResourceDefinition":
        errors.append(
            fe.invalid("apiVersion", crd.get("apiVersion"), "must be apiextensions.k8s.io/v1 CustomResourceDefinition")
        )
        return errors
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group = spec.get("group") or ""
    if not group:
        errors.append(fe.required("spec.group"))
    for key in ("plural", "kind"):
        if not names.get(key):
            errors.append(fe.required(f"spec.names.{key}"))
    name = (crd.get("metadata") or {}).get("name")
    if names.get("plural") and group and name != f"{names['plural']}.{group}":
        errors.append(fe.invalid("metadata.name", name, 'must be spec.names.plural+"."+spec.group'))
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        errors.append(fe.not_supported("spec.scope", spec.get("scope"), ["Cluster", "Namespaced"]))
    versions = spec.get("versions") or []
    if not versions:
        errors.append(fe.required("spec.versions", "must have exactly one version marked as storage version"))
    if versions and sum(1 for v in versions if v.get("storage")) != 1:
        errors.append(
            fe.invalid(
                "spec.versions",
                [v.get("name") for v in versions],
                "must have exactly one version marked as storage version",
            )
        )
    for i, version in enumerate(versions):
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        base = f"spec.versions[{i}].schema.openAPIV3Schema"
        if schema is None:
            continue
        for path, rule in cel.walk_rules(schema, ""):
            for key in ("rule", "messageExpression"):
                if not rule.get(key):
                    continue
                try:
                    cel.cel_program(rule[key])
                except Exception as exc:
                    where = f"{base}.{path}.x-kubernetes-validations" if path else f"{base}.x-kubernetes-validations"
                    errors.append(fe.invalid(f"{where}[{key}]", rule[key], f"compilation failed: {cel.cel_exc(exc)}"))
    return errors
