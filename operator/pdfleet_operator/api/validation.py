"""One object checked as the API server and the operator would check it: admission (the CRD's structural
schema and CEL rules) and the pydantic models must agree; errors per object and field (pure).

`pdfleet validate` (files), `pdfleet up` and the simulator's fleet file call `validate_object`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import pydantic

from pdfleet_operator import api
from pdfleet_operator.api import admission, schema


@dataclass(frozen=True)
class Problem:
    """One thing wrong with one object."""

    source: str  # file name (and document index when a file has several)
    obj: str  # Kind/name
    field: str  # Kubernetes field path, e.g. spec.decode.maxReplicas
    message: str

    def __str__(self) -> str:
        where = f"{self.field}: " if self.field else ""
        return f"{self.source}: {self.obj}: {where}{self.message}"


def _loc_to_path(loc: Iterable[Any]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def pydantic_problems(model: type[pydantic.BaseModel], doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, message) for every pydantic error of doc against model."""
    try:
        model.model_validate(doc)
    except pydantic.ValidationError as exc:
        out = []
        for err in exc.errors():
            field = _loc_to_path(err["loc"])
            ctx = err.get("ctx") or {}
            if err["type"] == "rule" and ctx.get("field_path"):
                field = f"{field}{ctx['field_path']}" if field else ctx["field_path"].lstrip(".")
            if err["type"] == "extra_forbidden":
                out.append((field, "unknown field (not declared in the schema)"))
            else:
                out.append((field, err["msg"]))
        return out
    return []


def validate_object(doc: Any, source: str, crd_by_kind: dict[str, dict[str, Any]] | None = None) -> list[Problem]:
    """Every problem of one parsed YAML document, as admission and the operator would see them."""
    crd_by_kind = crd_by_kind or schema.load_crds()
    if not isinstance(doc, dict):
        return [Problem(source, "?", "", f"expected a Kubernetes object (a mapping), got {type(doc).__name__}")]
    kind = doc.get("kind")
    name = (doc.get("metadata") or {}).get("name") or "<no name>"
    label = f"{kind}/{name}"
    if kind not in api.KINDS:
        return [Problem(source, label, "kind", f"not a pdfleet kind (expected one of {', '.join(api.KINDS)})")]
    if doc.get("apiVersion") != api.API_VERSION:
        return [
            Problem(
                source,
                label,
                "apiVersion",
                f"unsupported apiVersion {doc.get('apiVersion')!r}, expected {api.API_VERSION!r}",
            )
        ]
    if not (doc.get("metadata") or {}).get("name"):
        return [Problem(source, label, "metadata.name", "Required value: every object needs a name")]

    problems: dict[str, Problem] = {}
    for err in admission.validate(crd_by_kind[kind], doc):
        problems.setdefault(err.field, Problem(source, label, err.field, err.message))
    for field, message in pydantic_problems(api.KINDS[kind], doc):
        problems.setdefault(field, Problem(source, label, field, message))
    return list(problems.values())
