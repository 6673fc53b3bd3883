"""What a request constrains its output to (response_format, structured_outputs or vLLM's guided_* fields) as the
engine's `StructuredOutput`, with a 400 naming the field when malformed; `checks.check` and the worker's OpenAI serving
call it. No torch."""

from __future__ import annotations

import json
from typing import Any

from pdfleet_worker.sampling_params import StructuredOutput
from pdfleet_worker.wire.errors import RequestError
from pdfleet_worker.wire.request_types import ChatCompletionRequest, CompletionRequest


def structured_output(req: CompletionRequest | ChatCompletionRequest) -> tuple[str, StructuredOutput] | None:
    """What the request constrains its output to (response_format, structured_outputs or vLLM's guided_*
    fields) and the field that says so, None when free; 400 naming the field when it is malformed or asked
    for twice. Forced tool calls are the tools' business (server/tool_calls.py)."""
    asked: list[tuple[str, StructuredOutput]] = []

    def want(param: str, kind: str, spec: str = "") -> None:
        try:
            asked.append((param, StructuredOutput(kind, spec)))
        except ValueError as e:
            raise RequestError(400, str(e), param=param) from None

    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        want("response_format", "json_object")
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise RequestError(
                400, "response_format json_schema needs json_schema.schema", param="response_format.json_schema"
            )
        want("response_format.json_schema", "json", _json_text(fmt.json_schema.schema_))
    so = req.structured_outputs
    if so is not None:
        given = [
            (n, v)
            for n, v in (
                ("json", so.json_),
                ("regex", so.regex),
                ("choice", so.choice),
                ("grammar", so.grammar),
                ("json_object", so.json_object or None),
            )
            if v is not None
        ]
        if len(given) != 1:
            raise RequestError(
                400,
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
                param="structured_outputs",
            )
        name, value = given[0]
        _structured_field(want, f"structured_outputs.{name}", name, value)
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{name}")
        if value is not None:
            _structured_field(want, f"guided_{name}", name, value)
    if len(asked) > 1:
        raise RequestError(
            400, f"{asked[1][0]} and {asked[0][0]} both constrain the output; send one", param=asked[1][0]
        )
    return asked[0] if asked else None


def _structured_field(want, param: str, name: str, value: Any) -> None:
    if name == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise RequestError(400, f"{param} is not a JSON schema: {e}", param=param) from None
        want(param, "json", _json_text(value))
    elif name == "choice":
        if not value or not all(value):
            raise RequestError(400, f"{param} needs at least one non-empty string", param=param)
        want(param, "choice", json.dumps(value, ensure_ascii=False))
    elif name == "json_object":
        want(param, "json_object")
    else:
        want(param, name, value)


def _json_text(value: Any) -> str:
    # NOTE: sorted keys: the same schema is one grammar-cache entry whatever order a client wrote it in.
    return json.dumps(value, sort_keys=True, ensure_ascii=False)
