"""The subset of Kubernetes JSONPath that printer columns use (``.a.b[0]``, ``[*]``, ``[?(@.k=="v")]``); the
tables of ``kubectl get`` are built with it."""

from __future__ import annotations

import re
from typing import Any

_JP_TOKEN = re.compile(
    r"""\.\.(?P<rec>[A-Za-z0-9_$-]+)|\.(?P<field>[A-Za-z0-9_$-]+)|\[\s*'(?P<quoted>[^']*)'\s*\]"""
    r"""|\[\s*"(?P<dquoted>[^"]*)"\s*\]|\[\s*(?P<index>-?\d+)\s*\]|\[\s*\*\s*\]|\.\*"""
    r"""|\[\s*\?\(\s*@\.(?P<fpath>[A-Za-z0-9_.$-]+)\s*(?P<fop>==|!=)\s*(?P<fval>"[^"]*"|'[^']*'|[^)\s]+)\s*\)\s*\]"""
)


def jsonpath(obj: Any, expression: str) -> list[Any]:
    """The subset of Kubernetes JSONPath that printer columns use (``.a.b[0]``, ``[*]``, ``[?(@.k=="v")]``)."""
    expr = expression.strip()
    if expr.startswith("{") and expr.endswith("}"):
        expr = expr[1:-1]
    if expr.startswith("$"):
        expr = expr[1:]
    current = [obj]
    pos = 0
    while pos < len(expr):
        m = _JP_TOKEN.match(expr, pos)
        if not m:
            raise ValueError(f"unsupported JSONPath: {expression!r}")
        pos = m.end()
        nxt: list[Any] = []
        if m.group("field") is not None or m.group("quoted") is not None or m.group("dquoted") is not None:
            key = m.group("field") or m.group("quoted") or m.group("dquoted") or ""
            nxt = [c[key] for c in current if isinstance(c, dict) and key in c]
        elif m.group("rec") is not None:
            key = m.group("rec")

            def walk(node: Any) -> None:
                if isinstance(node, dict):
                    if key in node:
                        nxt.append(node[key])
                    for v in node.values():
                        walk(v)
                elif isinstance(node, list):
                    for v in node:
                        walk(v)

            for c in current:
                walk(c)
        elif m.group("index") is not None:
            i = int(m.group("index"))
            nxt = [c[i] for c in current if isinstance(c, list) and -len(c) <= i < len(c)]
        elif m.group("fpath") is not None:
            raw = m.group("fval")
            want: Any = raw[1:-1] if raw[:1] in "'\"" else raw
            for c in current:
                for item in c if isinstance(c, list) else []:
                    got: Any = item
                    for part in m.group("fpath").split("."):
                        got = got.get(part) if isinstance(got, dict) else None
                    same = (
                        (str(got).lower() if isinstance(got, bool) else str(got)) == str(want)
                        if got is not None
                        else False
                    )
                    if same == (m.group("fop") == "=="):
                        nxt.append(item)
        else:  # [*] or .*
            for c in current:
                if isinstance(c, list):
                    nxt.extend(c)
                elif isinstance(c, dict):
                    nxt.extend(c.values())
        current = nxt
    return current
