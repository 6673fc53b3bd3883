"""Whether a live object already holds everything the operator rendered for it (pure; kube.py asks before writing).

A live object carries more than was applied (server defaults, other managers' fields, status), so the
question is containment, not equality: every field we render must be present with our value; lists
must match element by element (we own whole lists, as server-side apply replaces them). Quantities
compare by value, because the API server canonicalises them ("1024Mi" is stored as "1Gi").

Containment cannot see a field the operator stopped rendering (a toleration dropped from a class stays on the
live object, which still contains everything rendered now). `with_applied_hash` stamps each child with a digest
of what was rendered: when the render loses a field the digest differs, the child is applied again, and
server-side apply removes the fields this field manager applied before and no longer sends. (A shorter list
was always seen: lists compare whole. A dropped map key, label or annotation was not.)
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pdfleet_operator.api import parse_quantity
from pdfleet_operator.api.names import ANNOTATION_APPLIED_HASH

# Map keys whose values are Kubernetes quantities.
QUANTITY_PARENTS = frozenset({"requests", "limits"})
QUANTITY_KEYS = frozenset({"sizeLimit"})


def _same_quantity(actual: Any, desired: Any) -> bool:
    try:
        return parse_quantity(actual) == parse_quantity(desired)
    except (ValueError, TypeError):
        return actual == desired


def contains(actual: Any, desired: Any, *, quantities: bool = False) -> bool:
    """True when `actual` has every field of `desired` with the same value (recursively)."""
    if isinstance(desired, dict):
        if not isinstance(actual, dict):
            return not desired and actual is None
        for key, value in desired.items():
            if key not in actual:
                if value in ({}, [], None):
                    continue  # the server drops empty maps and lists
                return False
            as_quantity = key in QUANTITY_KEYS or quantities
            if not contains(
                actual[key], value, quantities=as_quantity if not isinstance(value, dict) else key in QUANTITY_PARENTS
            ):
                return False
        return True
    if isinstance(desired, list):
        if not isinstance(actual, list):
            return not desired and actual is None
        return len(actual) == len(desired) and all(contains(a, d) for a, d in zip(actual, desired))
    if quantities:
        return _same_quantity(actual, desired)
    return actual == desired


def differences(actual: Any, desired: Any, path: str = "") -> list[str]:
    """Paths where `actual` does not contain `desired` (for Events and logs: what a hand edit changed)."""
    if contains(actual, desired):
        return []
    if isinstance(desired, dict) and isinstance(actual, dict):
        out: list[str] = []
        for key, value in desired.items():
            out += differences(actual.get(key), value, f"{path}.{key}")
        return out or [path or "."]
    return [path or "."]


def _without_stamp(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` without its applied-hash annotation (shallow copies of the maps on the way; `obj` is not modified)."""
    meta = obj.get("metadata")
    annotations = (meta or {}).get("annotations")
    if not annotations or ANNOTATION_APPLIED_HASH not in annotations:
        return obj
    rest = {k: v for k, v in annotations.items() if k != ANNOTATION_APPLIED_HASH}
    meta = {**meta, "annotations": rest} if rest else {k: v for k, v in meta.items() if k != "annotations"}
    return {**obj, "metadata": meta}


def applied_hash(obj: dict[str, Any]) -> str:
    """Digest of a rendered object, its own applied-hash annotation left out."""
    text = json.dumps(_without_stamp(obj), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def with_applied_hash(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` carrying `pdfleet.io/applied-hash` (what `contains` compares, so removals are seen). NOTE: a shallow
    copy down to the annotations: the rest is shared with `obj`, which neither the caller nor the writer modify."""
    meta = obj.get("metadata") or {}
    return {
        **obj,
        "metadata": {
            **meta,
            "annotations": {**(meta.get("annotations") or {}), ANNOTATION_APPLIED_HASH: applied_hash(obj)},
        },
    }


def pruned_only(actual: Any, desired: dict[str, Any]) -> bool:
    """True when `actual` differs from `desired` (stamped) only by the applied hash: the render lost fields."""
    bare = _without_stamp(desired)  # (an emptied annotations map is left out: an empty map is contained)
    return contains(actual, bare) and not contains(actual, desired)
