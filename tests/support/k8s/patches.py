"""The patch formats of the API: JSON merge patch (RFC 7386), JSON patch (RFC 6902), an approximation of
strategic merge patch, and the merge helpers of server-side apply; used by the PATCH verb."""

from __future__ import annotations

import copy
from typing import Any


def json_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = json_merge_patch(result.get(key), value)
    return result


_SMP_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
    "conditions": "type",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
    "ownerReferences": "uid",
    "resourceClaims": "name",
    "envFrom": None,
    "tolerations": None,
}


def strategic_merge_patch(target: Any, patch: Any, field_name: str | None = None) -> Any:
    """An approximation of strategic merge patch: merge patch + merge keys for well-known lists."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if not k.startswith("$")}
    if patch.get("$patch") == "delete":
        return None
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            merged = strategic_merge_patch(result.get(key), value, key)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        elif (
            isinstance(value, list)
            and _SMP_MERGE_KEYS.get(key)
            and isinstance(result.get(key), list)
            and all(isinstance(v, dict) for v in value)
        ):
            merge_key = _SMP_MERGE_KEYS[key]
            items = [copy.deepcopy(v) for v in result[key]]
            for item in value:
                idx = next(
                    (
                        i
                        for i, old in enumerate(items)
                        if isinstance(old, dict) and old.get(merge_key) == item.get(merge_key)
                    ),
                    None,
                )
                if item.get("$patch") == "delete":
                    if idx is not None:
                        items.pop(idx)
                elif idx is None:
                    items.append({k: v for k, v in item.items() if not k.startswith("$")})
                else:
                    items[idx] = strategic_merge_patch(items[idx], item, None)
            result[key] = items
        else:
            result[key] = (
                [{k: v for k, v in i.items() if not k.startswith("$")} if isinstance(i, dict) else i for i in value]
                if isinstance(value, list)
                else copy.deepcopy(value)
            )
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ValueError(f"invalid JSON pointer: {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json_patch(doc: Any, operations: Any) -> Any:
    """RFC 6902. Raises ``ValueError`` with jsonpatch-like messages when an operation fails."""
    if not isinstance(operations, list):
        raise TypeError("json patch must be a list of operations")
    doc = copy.deepcopy(doc)

    def parent_of(d: Any, parts: list[str], op: str, path: str) -> tuple[Any, str]:
        cur = d
        for part in parts[:-1]:
            if isinstance(cur, dict) and part in cur:
                cur = cur[part]
            elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
                cur = cur[int(part)]
            else:
                raise ValueError(f'{op} operation does not apply: doc is missing path: "{path}"')
        return cur, parts[-1]

    def get(d: Any, path: str, op: str) -> Any:
        cur = d
        for part in _pointer(path):
            if isinstance(cur, dict) and part in cur:
                cur = cur[part]
            elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
                cur = cur[int(part)]
            else:
                raise ValueError(f'{op} operation does not apply: doc is missing path: "{path}"')
        return cur

    def remove(d: Any, path: str, op: str) -> Any:
        parts = _pointer(path)
        if not parts:
            raise ValueError("cannot remove the whole document")
        parent, last = parent_of(d, parts, op, path)
        if isinstance(parent, dict) and last in parent:
            return parent.pop(last)
        if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
            return parent.pop(int(last))
        raise ValueError(f'{op} operation does not apply: doc is missing path: "{path}"')

    def add(d: Any, path: str, value: Any, op: str) -> Any:
        parts = _pointer(path)
        if not parts:
            return value
        parent, last = parent_of(d, parts, op, path)
        if isinstance(parent, dict):
            parent[last] = value
        elif isinstance(parent, list):
            if last == "-":
                parent.append(value)
            elif last.isdigit() and int(last) <= len(parent):
                parent.insert(int(last), value)
            else:
                raise ValueError(f'{op} operation does not apply: index out of range: "{path}"')
        else:
            raise ValueError(f'{op} operation does not apply: doc is missing path: "{path}"')
        return d

    for operation in operations:
        if not isinstance(operation, dict) or "op" not in operation or "path" not in operation:
            raise TypeError(f"invalid JSON patch operation: {operation!r}")
        op, path = operation["op"], operation["path"]
        if op == "add":
            doc = add(doc, path, copy.deepcopy(operation.get("value")), op)
        elif op == "remove":
            remove(doc, path, op)
        elif op == "replace":
            get(doc, path, op)
            parts = _pointer(path)
            if not parts:
                doc = copy.deepcopy(operation.get("value"))
            else:
                parent, last = parent_of(doc, parts, op, path)
                if isinstance(parent, list):
                    parent[int(last)] = copy.deepcopy(operation.get("value"))
                else:
                    parent[last] = copy.deepcopy(operation.get("value"))
        elif op == "move":
            value = remove(doc, operation["from"], op)
            doc = add(doc, path, value, op)
        elif op == "copy":
            doc = add(doc, path, copy.deepcopy(get(doc, operation["from"], op)), op)
        elif op == "test":
            try:
                actual = get(doc, path, op)
            except ValueError:
                raise ValueError(f"testing value {path} failed: test failed") from None
            if actual != operation.get("value"):
                raise ValueError(f"testing value {path} failed: test failed")
        else:
            raise TypeError(f"unsupported JSON patch operation: {op!r}")
    return doc


def leaf_paths(value: Any, prefix: tuple = ()) -> set[tuple]:
    if isinstance(value, dict) and value:
        out: set[tuple] = set()
        for k, v in value.items():
            out |= leaf_paths(v, prefix + (k,))
        return out
    return {prefix}


def deep_merge(target: Any, applied: Any) -> Any:
    if isinstance(target, dict) and isinstance(applied, dict):
        result = copy.deepcopy(target)
        for k, v in applied.items():
            result[k] = deep_merge(result.get(k), v)
        return result
    return copy.deepcopy(applied)


def delete_path(obj: dict, path: tuple) -> None:
    cur: Any = obj
    for part in path[:-1]:
        if not isinstance(cur, dict) or part not in cur:
            return
        cur = cur[part]
    if isinstance(cur, dict):
        cur.pop(path[-1], None)
