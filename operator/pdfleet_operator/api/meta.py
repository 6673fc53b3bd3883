"""Shared building blocks of the pdfleet API: the base model, Kubernetes-shaped types and CEL rules.

Every API type inherits `ApiModel`: camelCase wire names, unknown fields rejected (as kubectl's
strict field validation does), and cross-field rules written once in CEL. The same CEL text is put
into the CRD as `x-kubernetes-validations` (see `pdfleet_operator.api.schema`) and evaluated here by
`celpy`, so the API server's admission and `pydantic` enforce one rule, not two copies of it.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import re
from collections.abc import Iterable
from typing import Annotated, Any, ClassVar, Literal

import celpy
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

# --- patterns shared by the schema and the parsers ----------------------------------------------

DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# Go's time.ParseDuration subset that makes sense for config: "500ms", "30s", "5m", "1h30m".
DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"
# apimachinery's resource.Quantity grammar (decimal SI, binary SI, or exponent).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
# An extended resource name: a domain-prefixed name (nvidia.com/gpu, huawei.com/Ascend910) or "cpu".
RESOURCE_NAME_PATTERN = (
    r"^(cpu|([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+"
    r"/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?))$"
)
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_QUANTITY_SUFFIX = {
    "": 1,
    "n": 1e-9,
    "u": 1e-6,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
_QUANTITY = re.compile(QUANTITY_PATTERN)


def parse_duration(text: str) -> float:
    """Seconds in a Go-style duration string ("1m30s" -> 90.0); ValueError when it does not parse."""
    if not isinstance(text, str):
        raise ValueError(f"invalid duration {text!r}: expected a number with a unit (ms, s, m, h), e.g. '30s', '1m30s'")
    return _duration_s(text)


@functools.lru_cache(maxsize=1024)
def _duration_s(text: str) -> float:
    # NOTE: cached: the autoscaler and the simulator read the spec's durations on every decision
    if not re.fullmatch(DURATION_PATTERN, text):
        raise ValueError(f"invalid duration {text!r}: expected a number with a unit (ms, s, m, h), e.g. '30s', '1m30s'")
    return sum(float(n) * _DURATION_UNITS[u] for n, u in _DURATION_PART.findall(text))


def parse_quantity(value: str | int | float) -> float:
    """The value of a Kubernetes quantity ("1Gi" -> 1073741824.0, "500m" -> 0.5); ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"invalid quantity {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value)
    if not _QUANTITY.fullmatch(text):
        raise ValueError(f"invalid quantity {text!r}: expected e.g. '512Mi', '1Gi', '500m', '2'")
    number = re.match(r"^[+-]?(\d+(\.\d*)?|\.\d+)", text)
    assert number is not None, text
    suffix = text[number.end() :]
    if suffix[:1] in ("e", "E"):
        return float(text)
    return float(number.group(0)) * _QUANTITY_SUFFIX[suffix]


def _check_duration(text: str) -> str:
    parse_duration(text)
    return text


def _check_quantity(value: str | int) -> str | int:
    parse_quantity(value)
    return value


Duration = Annotated[
    str,
    StringConstraints(pattern=DURATION_PATTERN),
    AfterValidator(_check_duration),
    WithJsonSchema({"type": "string", "pattern": DURATION_PATTERN}),
]
Quantity = Annotated[
    str | int,
    AfterValidator(_check_quantity),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
        }
    ),
]
DnsLabel = Annotated[str, StringConstraints(pattern=DNS_LABEL_PATTERN, min_length=1, max_length=63)]


# --- CEL -------------------------------------------------------------------------------------------


class Rule(BaseModel):
    """A cross-field rule in CEL, evaluated against the object it is attached to (`self`)."""

    model_config = ConfigDict(frozen=True)
    rule: str
    message: str
    field_path: str | None = None  # where the error points, relative to `self` (".maxReplicas")

    def as_crd(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rule": self.rule, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out


@functools.lru_cache(maxsize=None)
def _cel_program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


# NOTE: cel-python interprets the parse tree on every call (1-10 ms a rule here; an InferenceDeployment
# evaluates ~23 rules, which was most of an operator reconcile's CPU at 500 CRs). A rule is a pure function
# of `self`, so results are kept per (rule, canonical JSON of self); sub-objects repeat across a fleet
# (defaulted engines, roles, SLOs). Bounded: emptied when full.
_RESULTS: dict[tuple[str, str], bool] = {}
_RESULTS_MAX = 8192


def failing_rule(rules: Iterable[Rule], self_value: Any) -> Rule | None:
    """The first of `rules` that does not hold for `self` (a JSON-like value), or None; a rule error counts as
    not holding. `self` is converted to CEL values once for all the rules not answered before."""
    key = json.dumps(self_value, sort_keys=True, separators=(",", ":"))
    activation: dict[str, Any] | None = None
    for r in rules:
        holds = _RESULTS.get((r.rule, key))
        if holds is None:
            if activation is None:
                activation = {"self": celpy.json_to_cel(self_value)}
            try:
                result = _cel_program(r.rule).evaluate(activation)
                holds = isinstance(result, celpy.celtypes.BoolType) and bool(result)
            except Exception:  # noqa: BLE001  -- celpy raises its own error types; a failing rule is a rejection
                holds = False
            if len(_RESULTS) >= _RESULTS_MAX:
                _RESULTS.clear()
            _RESULTS[(r.rule, key)] = holds
        if not holds:
            return r
    return None


def evaluate_rule(rule: str, self_value: Any) -> bool:
    """Evaluate one CEL rule with `self` bound to a JSON-like value; a rule error counts as false."""
    return failing_rule((Rule(rule=rule, message=""),), self_value) is None


def rule_error(field_path: str | None, message: str) -> PydanticCustomError:
    """A validation error that carries the field it points at (relative to the model) in its context."""
    return PydanticCustomError("rule", "{message}", {"message": message, "field_path": field_path or ""})


# --- base model ------------------------------------------------------------------------------------


class ApiModel(BaseModel):
    """Base of all API types: camelCase on the wire, unknown fields are errors, CEL rules enforced."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
    )
    # Cross-field rules; copied into the CRD as x-kubernetes-validations of this object's schema.
    cel_rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _apply_cel_rules(self) -> "ApiModel":
        if self.cel_rules:
            failed = failing_rule(self.cel_rules, self.model_dump(by_alias=True, exclude_none=True, mode="json"))
            if failed is not None:
                raise rule_error(failed.field_path, failed.message)
        return self

    def wire(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase keys, no nulls."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class Condition(ApiModel):
    """A Kubernetes-shaped status condition (the same shape as metav1.Condition)."""

    type: str = Field(
        description="Type of condition in CamelCase, e.g. Ready, Progressing, Degraded.",
        pattern=r"^[A-Z][A-Za-z0-9]*$",
        max_length=316,
    )
    status: Literal["True", "False", "Unknown"] = Field(description="Status of the condition: True, False or Unknown.")
    reason: str = Field(
        description="A machine-readable CamelCase reason for the last transition.",
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        min_length=1,
        max_length=1024,
    )
    message: str = Field(
        "", description="A human-readable message with details about the transition.", max_length=32768
    )
    last_transition_time: dt.datetime = Field(
        description="When the condition last changed status (RFC 3339).",
        json_schema_extra={"format": "date-time"},
    )
    observed_generation: int | None = Field(
        None, ge=0, description="The .metadata.generation the condition was set from."
    )


def set_condition(conditions: list[Condition], new: Condition) -> list[Condition]:
    """Return conditions with `new` merged in; lastTransitionTime only moves when status changes."""
    out: list[Condition] = []
    replaced = False
    for c in conditions:
        if c.type == new.type:
            keep_time = c.status == new.status
            out.append(new.model_copy(update={"last_transition_time": c.last_transition_time}) if keep_time else new)
            replaced = True
        else:
            out.append(c)
    if not replaced:
        out.append(new)
    return out


class ObjectMeta(BaseModel):
    """The part of metav1.ObjectMeta pdfleet reads; server-managed fields are accepted and kept."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, alias_generator=to_camel)
    name: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    generate_name: str | None = None
    namespace: str | None = Field(None, max_length=63, pattern=DNS_LABEL_PATTERN)
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    generation: int | None = None
    uid: str | None = None
    resource_version: str | None = None


class Resource(ApiModel):
    """Base of the top-level kinds: a name rule that both the CRD schema and pydantic enforce."""

    # (max length, pattern) of metadata.name; the CRD puts it under openAPIV3Schema.metadata.
    name_rule: ClassVar[tuple[int, str]] = (253, DNS_SUBDOMAIN_PATTERN)
    name_rule_why: ClassVar[str] = "a DNS subdomain"

    @model_validator(mode="after")
    def _check_name(self) -> "Resource":
        name = getattr(self, "metadata").name
        max_len, pattern = self.name_rule
        if name is not None and (len(name) > max_len or not re.fullmatch(pattern, name)):
            raise rule_error(
                ".metadata.name",
                f"{name!r} must be at most {max_len} characters and match {pattern} ({self.name_rule_why})",
            )
        return self
