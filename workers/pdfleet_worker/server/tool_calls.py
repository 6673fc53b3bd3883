"""Tool calls for chat: what a request's tools and tool_choice ask of the model (ToolPlan: the grammar that forces a
call, the format to parse), the parsers of Qwen2.5's (hermes) and Llama 3.1's (JSON) call formats, and the streamer that
turns a growing answer into OpenAI delta tool_calls; openai_serving calls it. No torch.

Forced calls work as vLLM's: a named function's output is its arguments object (a JSON schema grammar of its
parameters); `required` outputs a JSON array of {"name", "parameters"} objects, one of the tools each."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from pdfleet_worker.model import chat_templates
from pdfleet_worker.sampling_params import StructuredOutput
from pdfleet_worker.wire import request_types as rq
from pdfleet_worker.wire.errors import RequestError

NONE, AUTO, NAMED, REQUIRED = "none", "auto", "named", "required"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    mode: str  # none, auto, named or required
    tools: list[dict[str, Any]] | None  # for the chat template, as OpenAI's request has them
    structured: StructuredOutput | None = None  # the grammar a forced call runs under
    name: str | None = None  # the named function
    parser: str | None = None  # auto: chat_templates.HERMES or LLAMA3_JSON


@dataclasses.dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text of the arguments object

    def to_json(self, index: int | None = None, call_id: str | None = None) -> dict[str, Any]:
        out = {
            "id": call_id or new_call_id(),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def plan(req: rq.ChatCompletionRequest, template: str | None) -> ToolPlan:
    """What the request's tools ask for; 400 when the model cannot do it (auto with a template that takes no tools)."""
    if not req.tools:
        return ToolPlan(NONE, None)
    tools = [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools]
    choice = req.tool_choice or AUTO
    if choice == NONE:
        return ToolPlan(NONE, tools)
    if isinstance(choice, rq.NamedToolChoice):
        fn = next(t.function for t in req.tools if t.function.name == choice.function.name)
        return ToolPlan(NAMED, tools, StructuredOutput("json", _schema_text(_parameters(fn))), name=fn.name)
    if choice == REQUIRED:
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t.function)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in req.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan(REQUIRED, tools, StructuredOutput("json", _schema_text(schema)))
    parser = chat_templates.tool_format(template)
    if parser is None:
        raise RequestError(
            400,
            "this model's chat template takes no tools, so it cannot choose to call one; send "
            'tool_choice "required" or a named function (a grammar forces the call)',
            param="tool_choice",
        )
    return ToolPlan(AUTO, tools, parser=parser)


def _parameters(fn: rq.FunctionDefinition) -> dict[str, Any]:
    return fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}


def _schema_text(schema: dict[str, Any]) -> str:
    return json.dumps(schema, sort_keys=True, ensure_ascii=False)


# -- a complete answer ----------------------------------------------------------------------------
def parse(plan_: ToolPlan, text: str) -> tuple[str | None, list[Call]]:
    """(content, calls) of a finished answer. An answer that does not parse as calls is content."""
    if plan_.mode == NAMED:
        return None, [Call(plan_.name, text.strip())] if _is_object(text) else []
    if plan_.mode == REQUIRED:
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        return None, [Call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
    if plan_.mode == AUTO:
        return (_parse_hermes if plan_.parser == chat_templates.HERMES else _parse_llama3)(text)
    return text, []


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|$)", re.DOTALL)


def _parse_hermes(text: str) -> tuple[str | None, list[Call]]:
    start = text.find(HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    for block in _HERMES_BLOCK.findall(text[start:]):
        call = _call_object(block)
        if call is None:
            return text, []
        calls.append(call)
    return text[:start].strip() or None, calls


def _parse_llama3(text: str) -> tuple[str | None, list[Call]]:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].lstrip()
    if not body.startswith("{"):
        return text, []
    calls = []
    for obj in scan_objects(body):
        call = _call_object(body[obj.start : obj.end + 1]) if obj.end is not None else None
        if call is None:
            return text, []
        calls.append(call)
    return (None, calls) if calls else (text, [])


def _call_object(text: str) -> Call | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        return Call(obj["name"], args) if _is_object(args) else None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


# -- scanning a growing answer ----------------------------------------------------------------------
@dataclasses.dataclass
class ObjectSpan:
    """A top-level JSON object in a (possibly unfinished) text: where it starts and ends, its "name" string
    value once complete, and where its arguments ("arguments" or "parameters") value starts and ends."""

    start: int
    end: int | None = None
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None


def scan_objects(text: str) -> list[ObjectSpan]:
    """The top-level objects of `text` as far as it goes (separators between them, such as `,` or `;`, and a
    surrounding text are skipped)."""
    objs: list[ObjectSpan] = []
    depth, in_str, esc = 0, False, False
    str_start, last_str, key = 0, None, None
    cur: ObjectSpan | None = None
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                last_str = text[str_start : i + 1]
                if cur is not None and depth == 1 and key == "name" and cur.name is None:
                    cur.name = _string(last_str)
            continue
        if ch == '"':
            in_str, str_start = True, i
        elif ch in "{[":
            if depth == 0 and ch == "{":
                cur = ObjectSpan(i)
                objs.append(cur)
                key = None
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0 and cur is not None:
                cur.end = i
                if cur.args_start is not None and cur.args_end is None:
                    cur.args_end = i
                cur = None
        elif cur is not None and depth == 1 and ch == ":" and last_str is not None:
            key = _string(last_str)
            if key in ("arguments", "parameters"):
                cur.args_start = i + 1
        elif cur is not None and depth == 1 and ch == ",":
            if cur.args_start is not None and cur.args_end is None:
                cur.args_end = i
            key, last_str = None, None
    return objs


def _string(literal: str) -> str | None:
    try:
        value = json.loads(literal)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


class ToolCallStreamer:
    """Feeds on the answer's text deltas and yields OpenAI chat deltas: `content` pieces and `tool_calls`
    pieces (the first of a call has its index, id, type and name; the next ones extend its arguments)."""

    def __init__(self, plan_: ToolPlan):
        self.plan = plan_
        self.text = ""
        self.content_sent = 0  # characters of text sent as content
        self.calls_from: int | None = 0 if plan_.mode in (NAMED, REQUIRED) else None  # where calls begin
        self.headers: list[str] = []  # ids of the calls whose header went out
        self.args_at: list[int | None] = []  # per call, how far into the calls' text its arguments went out

    @property
    def called(self) -> bool:
        return bool(self.headers)

    def feed(self, delta: str, final: bool = False) -> list[dict[str, Any]]:
        self.text += delta
        out: list[dict[str, Any]] = []
        if self.calls_from is None:
            self._find_calls(final)
            upto = len(self.text) if self.calls_from is None else self.calls_from
            if self.calls_from is None and not final:
                upto -= self._held_back()
            if upto > self.content_sent:
                out.append({"content": self.text[self.content_sent : upto]})
                self.content_sent = upto
        if self.calls_from is not None:
            out += self._call_deltas(final)
        return out

    def _find_calls(self, final: bool) -> None:
        if self.plan.mode != AUTO:
            return
        if self.plan.parser == chat_templates.HERMES:
            at = self.text.find(HERMES_OPEN)
            if at >= 0:
                self.calls_from = at
        else:
            body = self.text.lstrip()
            if body.startswith((PYTHON_TAG, "{")):
                self.calls_from = len(self.text) - len(body)

    def _held_back(self) -> int:
        """Characters at the end that may begin a call (not sent as content until decided)."""
        if self.plan.mode != AUTO:
            return 0
        if self.plan.parser == chat_templates.HERMES:
            for n in range(min(len(HERMES_OPEN) - 1, len(self.text)), 0, -1):
                if HERMES_OPEN.startswith(self.text[-n:]):
                    return n
            return 0
        body = self.text.lstrip()
        return len(self.text) if PYTHON_TAG.startswith(body) else 0  # only blanks or part of the tag so far

    def _call_deltas(self, final: bool) -> list[dict[str, Any]]:
        region = self.text[self.calls_from :]
        if self.plan.mode == NAMED:
            spans = [ObjectSpan(0, name=self.plan.name, args_start=0, args_end=len(region) if final else None)]
        else:
            if region.startswith(PYTHON_TAG):
                region = region[len(PYTHON_TAG) :]
            spans = scan_objects(region[1:] if self.plan.mode == REQUIRED else region)
            if self.plan.mode == REQUIRED:
                for s in spans:  # offsets in region, past the array's "["
                    s.args_start = None if s.args_start is None else s.args_start + 1
                    s.args_end = None if s.args_end is None else s.args_end + 1
        out = []
        for k, span in enumerate(spans):
            if span.name is None:
                break
            if k == len(self.headers):
                self.headers.append(new_call_id())
                self.args_at.append(None)
                out.append(
                    {
                        "tool_calls": [
                            {
                                "index": k,
                                "id": self.headers[k],
                                "type": "function",
                                "function": {"name": span.name, "arguments": ""},
                            }
                        ]
                    }
                )
            if span.args_start is None:
                continue
            end = span.args_end if span.args_end is not None else len(region)
            at = self.args_at[k]
            if at is None:  # the value starts after any blanks
                at = span.args_start
                while at < end and region[at].isspace():
                    at += 1
                if at == end:
                    continue
            if end > at:
                out.append({"tool_calls": [{"index": k, "function": {"arguments": region[at:end]}}]})
            self.args_at[k] = end
        return out
