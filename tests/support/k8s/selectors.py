"""Label and field selectors: the query-string forms lists and watches take (``a=b,c in (x,y)``,
``spec.nodeName=n``) and the ``LabelSelector`` objects Deployments, ReplicaSets and PodDisruptionBudgets
hold (``matchLabels`` + ``matchExpressions``); used by reads, watches and the controllers."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from tests.support.k8s.errors import bad_request

_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"


def parse_label_selector(text: str) -> Callable[[dict], bool]:
    """Parse ``a=b,c!=d,e in (x,y),f notin (z),g,!h`` into a predicate over a labels dict."""
    terms: list[str] = []
    depth, cur = 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            terms.append(cur)
            cur = ""
        else:
            cur += ch
    terms.append(cur)
    checks: list[Callable[[dict], bool]] = []
    for raw in terms:
        term = raw.strip()
        if not term:
            continue
        if m := re.fullmatch(rf"!\s*({_KEY})", term):
            key = m.group(1)
            checks.append(lambda labels, key=key: key not in labels)
        elif m := re.fullmatch(rf"({_KEY})\s+(in|notin)\s+\(([^)]*)\)", term):
            key, op = m.group(1), m.group(3)
            values = {v.strip() for v in m.group(4).split(",") if v.strip()}
            if op == "in":
                checks.append(lambda labels, key=key, values=values: labels.get(key) in values)
            else:
                checks.append(lambda labels, key=key, values=values: labels.get(key) not in values)
        elif m := re.fullmatch(rf"({_KEY})\s*(==|=|!=)\s*([-A-Za-z0-9_.]*)", term):
            key, op, value = m.group(1), m.group(3), m.group(4)
            if op == "!=":
                checks.append(lambda labels, key=key, value=value: labels.get(key) != value)
            else:
                checks.append(lambda labels, key=key, value=value: labels.get(key) == value)
        elif m := re.fullmatch(rf"({_KEY})", term):
            key = m.group(1)
            checks.append(lambda labels, key=key: key in labels)
        else:
            raise bad_request(f"unable to parse requirement: invalid label selector: {term!r}")
    return lambda labels: all(check(labels or {}) for check in checks)


def parse_field_selector(text: str) -> Callable[[dict], bool]:
    """Parse ``metadata.name=x,status.phase!=Running`` into a predicate over an object."""
    checks: list[Callable[[dict], bool]] = []
    for raw in text.split(","):
        term = raw.strip()
        if not term:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(.*)", term)
        if not m:
            raise bad_request(f"invalid field selector: {term!r}")
        path, op, value = m.group(1), m.group(2), m.group(3)

        def lookup(obj: dict, path: str = path) -> str:
            cur: Any = obj
            for part in path.split("."):
                cur = cur.get(part) if isinstance(cur, dict) else None
            if cur is None:
                return ""
            if isinstance(cur, bool):
                return "true" if cur else "false"
            return str(cur)

        if op == "!=":
            checks.append(lambda obj, lookup=lookup, value=value: lookup(obj) != value)
        else:
            checks.append(lambda obj, lookup=lookup, value=value: lookup(obj) == value)
    return lambda obj: all(check(obj) for check in checks)


def selector_matches(selector: dict | None, labels: dict[str, str] | None) -> bool:
    """A ``LabelSelector`` object against a labels dict, as apimachinery's ``LabelSelectorAsSelector`` builds it:
    every ``matchLabels`` pair and every ``matchExpressions`` requirement (In, NotIn, Exists, DoesNotExist) must
    hold; an empty selector matches everything, a missing one (None) nothing."""
    if selector is None:
        return False
    labels = labels or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        if op == "In" and not (key in labels and labels[key] in values):
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise bad_request(f"{op!r} is not a valid label selector operator")
    return True
