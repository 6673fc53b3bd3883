"""Admission errors shaped like Kubernetes' `StatusCause`s, with kube-apiserver's wording, and field paths (pure)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FieldError:
    """One admission error, shaped like a Kubernetes ``StatusCause``."""

    field: str  # a Kubernetes field path, e.g. "spec.decode.maxReplicas", "spec.roles[0]", "metadata.name"
    reason: str  # FieldValueInvalid, FieldValueRequired, ..., or FieldValueUnknown for unknown fields
    message: str  # the detail without the field, e.g. 'Invalid value: 0: spec.x in body should be ...'

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


# Kubernetes-style error wording
# ---------------------------------------------------------------------------------------------


def value_str(value: Any) -> str:
    """Render a bad value the way apimachinery's field.Error does (close enough for JSON values)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (int, float)):
        return num(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def num(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def invalid(path: str, value: Any, detail: str) -> FieldError:
    return FieldError(path, "FieldValueInvalid", f"Invalid value: {value_str(value)}: {detail}")


def type_invalid(path: str, value: Any, detail: str) -> FieldError:
    return FieldError(path, "FieldValueTypeInvalid", f"Invalid value: {value_str(value)}: {detail}")


def required(path: str, detail: str = "") -> FieldError:
    return FieldError(path, "FieldValueRequired", "Required value" + (f": {detail}" if detail else ""))


def forbidden(path: str, detail: str) -> FieldError:
    return FieldError(path, "FieldValueForbidden", f"Forbidden: {detail}")


def duplicate(path: str, value: Any) -> FieldError:
    return FieldError(path, "FieldValueDuplicate", f"Duplicate value: {value_str(value)}")


def not_supported(path: str, value: Any, allowed: list[Any]) -> FieldError:
    shown = ", ".join(json.dumps(v) if isinstance(v, str) else value_str(v) for v in allowed)
    return FieldError(
        path, "FieldValueNotSupported", f"Unsupported value: {value_str(value)}: supported values: {shown}"
    )


def too_long(path: str, maximum: int) -> FieldError:
    return FieldError(path, "FieldValueTooLong", f"Too long: may not be more than {maximum} bytes")


def too_many(path: str, actual: int, maximum: int) -> FieldError:
    return FieldError(path, "FieldValueTooMany", f"Too many: {actual}: must have at most {maximum} items")


def status_message(kind: str, group: str, name: str, errors: list[FieldError]) -> str:
    """The top-level message of a 422 Status: ``Kind.group "name" is invalid: <errors>``."""
    qualified = f"{kind}.{group}" if group else kind
    parts = [str(e) for e in errors]
    body = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
    return f'{qualified} "{name}" is invalid: {body}'


def child(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def index(path: str, i: int | str) -> str:
    return f"{path}[{i}]"
