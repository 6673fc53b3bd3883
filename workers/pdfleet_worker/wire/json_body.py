"""Hostile-JSON decoding of a request body (UTF-8, finite numbers, bounded nesting, no lone surrogates); the router and
the worker read every body through `decode_json`. No torch."""

from __future__ import annotations

import json
import re
from typing import Any

from pdfleet_worker.wire.errors import RequestError

MAX_JSON_DEPTH = 32  # nesting of arrays/objects in a body (a request needs 4)


def decode_json(body: bytes) -> Any:
    """A request body as JSON. Refused (400, code invalid_json) besides malformed JSON: bytes that are
    not UTF-8, NaN and Infinity (also as a number that overflows to them), integers of more than
    4,300 digits, nesting deeper than MAX_JSON_DEPTH, and lone surrogate escapes such as "\\ud800"
    (a string no UTF-8 encoder, tokenizer or JSON writer downstream can take)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _invalid_json(f"the body is not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        obj = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise _invalid_json(f"it nests deeper than {MAX_JSON_DEPTH} levels") from None
    except json.JSONDecodeError as e:
        raise _invalid_json(str(e)) from None
    except ValueError:  # int() past its digit limit
        raise _invalid_json("an integer has more than 4,300 digits") from None
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH or _SURROGATE_ESCAPE.search(text):
        _check_tree(obj)
    return obj


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _invalid_json(why: str) -> RequestError:
    return RequestError(400, f"the request body is not valid JSON: {why}", code="invalid_json")


def _no_constant(name: str) -> Any:
    raise _invalid_json(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _invalid_json(f"{text[:40]} is out of range for a number")
    return value


def _check_tree(obj: Any) -> None:
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            items = node.values()
            for key in node:
                _check_string(key)
        elif isinstance(node, list):
            items = node
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise _invalid_json(f"it nests deeper than {MAX_JSON_DEPTH} levels")
        for item in items:
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1))
            elif isinstance(item, str):
                _check_string(item)


def _check_string(s: str) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise _invalid_json(
                f"a string holds a lone surrogate escape (\\u{ord(s[e.start]):04x}); "
                f"send the character itself or a valid surrogate pair"
            ) from None
