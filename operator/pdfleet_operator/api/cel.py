"""CEL `x-kubernetes-validations` of a CRD schema evaluated as kube-apiserver does, with cel-python (pure).

`admission.validate` calls `check_cel` after the structural checks; `check_crd` compiles every rule.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from pdfleet_operator.api import field_errors as fe
from pdfleet_operator.api.field_errors import FieldError


def _cel_functions() -> dict[str, Any]:
    import celpy.celtypes as ct

    def lower_ascii(s: Any) -> Any:
        return ct.StringType(str(s).lower())

    def upper_ascii(s: Any) -> Any:
        return ct.StringType(str(s).upper())

    def trim(s: Any) -> Any:
        return ct.StringType(str(s).strip())

    def split(s: Any, sep: Any) -> Any:
        return ct.ListType([ct.StringType(p) for p in str(s).split(str(sep))])

    def join(items: Any, sep: Any = "") -> Any:
        return ct.StringType(str(sep).join(str(i) for i in items))

    def index_of(s: Any, sub: Any) -> Any:
        if isinstance(s, list):
            return ct.IntType(s.index(sub) if sub in s else -1)
        return ct.IntType(str(s).find(str(sub)))

    def last_index_of(s: Any, sub: Any) -> Any:
        if isinstance(s, list):
            return ct.IntType(len(s) - 1 - s[::-1].index(sub) if sub in s else -1)
        return ct.IntType(str(s).rfind(str(sub)))

    def is_sorted(items: Any) -> Any:
        values = list(items)
        return ct.BoolType(all(a <= b for a, b in zip(values, values[1:])))

    def cel_sum(items: Any) -> Any:
        values = list(items)
        if not values:
            return ct.IntType(0)
        total = values[0]
        for v in values[1:]:
            total = total + v
        return total

    def cel_min(items: Any) -> Any:
        return min(list(items))

    def cel_max(items: Any) -> Any:
        return max(list(items))

    def replace(s: Any, old: Any, new: Any, n: Any = -1) -> Any:
        return ct.StringType(str(s).replace(str(old), str(new), int(n)))

    return {
        "lowerAscii": lower_ascii,
        "upperAscii": upper_ascii,
        "trim": trim,
        "split": split,
        "join": join,
        "indexOf": index_of,
        "lastIndexOf": last_index_of,
        "isSorted": is_sorted,
        "sum": cel_sum,
        "min": cel_min,
        "max": cel_max,
        "replace": replace,
    }


@functools.lru_cache(maxsize=1)
def _cel_env() -> Any:
    import logging

    import celpy

    # celpy logs every evaluation step at DEBUG (and absorbs errors of short-circuited branches
    # with a log line): quiet it unless someone configured it on purpose.
    for name in ("celpy", "celpy.Evaluator", "celpy.Environment", "celpy.celtypes"):
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.WARNING)
    return celpy.Environment()


@functools.lru_cache(maxsize=1024)
def cel_program(expression: str) -> Any:
    env = _cel_env()
    return env.program(env.compile(expression), functions=_cel_functions())


# NOTE: cel-python interprets each rule's tree on every call (milliseconds a rule), and admission evaluates
# every rule of an object on every write, a status patch included (the test API server at 500 deployments spent
# most of its CPU here). A rule is a pure function of its variables: outcomes are kept per (rule, canonical JSON
# of the variables), errors included. Bounded: emptied when full.
_OUTCOMES: dict[tuple[str, str], tuple[bool, Any]] = {}
_OUTCOMES_MAX = 8192


def _cel_eval(expression: str, activation: dict[str, Any]) -> Any:
    import celpy

    key = (expression, json.dumps(activation, sort_keys=True, separators=(",", ":"), default=str))
    kept = _OUTCOMES.get(key)
    if kept is None:
        try:
            result = cel_program(expression).evaluate({k: celpy.json_to_cel(v) for k, v in activation.items()})
            kept = (not isinstance(result, celpy.CELEvalError), result)
        except Exception as exc:  # noqa: BLE001  -- kept and raised again as the caller expects
            kept = (False, exc)
        if len(_OUTCOMES) >= _OUTCOMES_MAX:
            _OUTCOMES.clear()
        _OUTCOMES[key] = kept
    ok, value = kept
    if not ok:
        raise value.with_traceback(None)  # (a kept error: no traceback piling up over raises)
    return value


def _field_path(base: str, field_path: str) -> str:
    """Join a rule's path with its ``fieldPath`` (``.spec.x``, ``.x['y.z']``)."""
    out = base
    for m in re.finditer(r"\.([A-Za-z0-9_$-]+)|\['([^']*)'\]|\[(\d+)\]", field_path):
        if m.group(1) is not None:
            out = fe.child(out, m.group(1))
        elif m.group(2) is not None:
            out = fe.child(out, m.group(2)) if "." not in m.group(2) else f"{out}[{m.group(2)}]"
        else:
            out = fe.index(out, m.group(3))
    return out


def _cel_error(path: str, schema: dict, rule: dict, detail: str) -> FieldError:
    if rule.get("fieldPath"):
        path = _field_path(path, rule["fieldPath"])
    shown_type = schema.get("type") or ("" if not schema.get("x-kubernetes-int-or-string") else "integer-or-string")
    reason = rule.get("reason")
    if reason == "FieldValueForbidden":
        return fe.forbidden(path, detail)
    if reason == "FieldValueRequired":
        return fe.required(path, detail)
    if reason == "FieldValueDuplicate":
        return fe.duplicate(path, shown_type)
    return fe.invalid(path, shown_type, detail)


def check_cel(schema: dict, value: Any, old: Any, has_old: bool, path: str, errors: list[FieldError]) -> None:
    if not isinstance(schema, dict) or value is None:
        return
    # Children first would also be fine; Kubernetes reports in schema order, parents first.
    for rule in schema.get("x-kubernetes-validations") or []:
        expression = rule.get("rule", "")
        uses_old = re.search(r"\boldSelf\b", expression) is not None
        if uses_old and not has_old:
            continue  # transition rules only run on updates where the old value exists
        activation = {"self": value}
        if uses_old:
            activation["oldSelf"] = old
        try:
            ok = _cel_eval(expression, activation)
        except Exception as exc:  # compile errors are caught by check_crd; here: evaluation errors
            errors.append(_cel_error(path, schema, rule, f"rule evaluation error: {cel_exc(exc)}"))
            continue
        if bool(ok):
            continue
        message = rule.get("message") or f"failed rule: {expression.strip()}"
        if rule.get("messageExpression"):
            try:
                rendered = _cel_eval(rule["messageExpression"], activation)
                if isinstance(rendered, str) and rendered.strip():
                    message = str(rendered)
            except Exception:
                pass
        errors.append(_cel_error(path, schema, rule, message))

    if isinstance(value, dict):
        props = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        for key, sub in value.items():
            sub_old_present = has_old and isinstance(old, dict) and key in old
            sub_old = old.get(key) if sub_old_present else None
            if key in props:
                check_cel(props[key], sub, sub_old, sub_old_present, fe.child(path, key), errors)
            elif isinstance(additional, dict):
                check_cel(additional, sub, sub_old, sub_old_present, fe.child(path, key), errors)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        items = schema["items"]
        old_by_key: dict[tuple, Any] = {}
        keys = schema.get("x-kubernetes-list-map-keys") or []
        if has_old and isinstance(old, list) and schema.get("x-kubernetes-list-type") == "map":
            old_by_key = {tuple(o.get(k) for k in keys): o for o in old if isinstance(o, dict)}
        for i, item in enumerate(value):
            key = tuple(item.get(k) for k in keys) if keys and isinstance(item, dict) else None
            present = key is not None and key in old_by_key
            check_cel(items, item, old_by_key.get(key) if present else None, present, fe.index(path, i), errors)


def cel_exc(exc: Exception) -> str:
    args = getattr(exc, "args", ())
    return str(args[0]) if args else str(exc)


def walk_rules(schema: Any, path: str) -> list[tuple[str, dict]]:
    found: list[tuple[str, dict]] = []
    if not isinstance(schema, dict):
        return found
    for rule in schema.get("x-kubernetes-validations") or []:
        found.append((path, rule))
    for key, sub in (schema.get("properties") or {}).items():
        found += walk_rules(sub, fe.child(path, key))
    if isinstance(schema.get("items"), dict):
        found += walk_rules(schema["items"], f"{path}.items" if path else "items")
    if isinstance(schema.get("additionalProperties"), dict):
        found += walk_rules(schema["additionalProperties"], f"{path}.additionalProperties")
    return found
