"""The one definition of a valid OpenAI request, applied by the router and by the worker: hostile-JSON decoding, strict request models (null means the default), per-request limits; plus error objects and response/chunk builders. No torch."""
from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pdfleet_worker.engine.sampling_params import StructuredOutput

# Bounds on what one request may hold, whatever the server's flags: each costs the engine per step
# (stop strings are searched on every token) or the server per request, and no real client needs more.
MAX_JSON_DEPTH = 32            # nesting of arrays/objects in a body (a request needs 4)
MAX_STOP_SEQUENCES = 16        # OpenAI allows 4
MAX_STOP_CHARS = 256           # per stop string; the stream holds back that many characters
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300           # OpenAI's limit on logit_bias entries
MAX_TOOLS = 128                # OpenAI's limit on tools
MAX_METADATA_KEYS = 16         # OpenAI's metadata limits: 16 pairs, keys of 64 and values of 512 characters
TOKEN_ID_LIMIT = 2 ** 31       # token ids are below it in any vocabulary
DEFAULT_MAX_PROMPTS = 64       # prompts in one /v1/completions request (`--max-prompts`)

Number = float  # strict float accepts JSON integers, never strings
Int64 = Annotated[int, Field(ge=-2 ** 63, le=2 ** 63 - 1)]
Text = Annotated[str, Field(max_length=256)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES)]
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=MAX_METADATA_KEYS)]


class RequestError(Exception):
    """An error the client gets as an OpenAI error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- hostile JSON -------------------------------------------------------------------------------
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
            raise _invalid_json(f"a string holds a lone surrogate escape (\\u{ord(s[e.start]):04x}); "
                                f"send the character itself or a valid surrogate pair") from None


# -- request models -----------------------------------------------------------------------------
class _Request(BaseModel):
    """Strict: unknown fields and wrong JSON types are refused. `null` for a field that has a
    default means that default (the OpenAI spec marks them nullable)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    _null_means_default: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls._null_means_default = frozenset(
            name for name, f in cls.model_fields.items()
            if not f.is_required() and type(None) not in get_args(f.annotation))

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in cls._null_means_default):
            data = {k: v for k, v in data.items() if not (v is None and k in cls._null_means_default)}
        return data


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool = False  # accepted, ignored (nothing to pad on a private network)


class JsonSchemaFormat(_Request):
    """response_format's json_schema: the output is one JSON value valid against `schema`."""

    name: Annotated[str, Field(min_length=1, max_length=64)] = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is enforced token by token either way


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False          # accepted: there is no other backend to fall back to
    disable_any_whitespace: bool = False    # accepted: JSON is always compact here (engine/structured.py)
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    backend: str | None = None              # accepted when "guidance"/"auto": llguidance is the one backend


class _Common(_Request):
    """Fields both endpoints share: OpenAI's (some accepted and ignored, some refused unless at their
    default by check()), then vLLM's extensions the engine supports."""

    model: Annotated[str, Field(max_length=256)]
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, ge=0, le=1)  # 0: only the most likely token
    stop: Stop | None = None
    seed: Int64 | None = None
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    logit_bias: Annotated[dict[str, Annotated[Number, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    response_format: ResponseFormat | None = None
    # accepted and ignored: nothing is stored, tiered or keyed by them here
    user: Text | None = None
    store: bool | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1, lt=TOKEN_ID_LIMIT)
    min_p: Number | None = Field(None, ge=0, le=1)
    repetition_penalty: Number | None = Field(None, gt=0, le=100)
    min_tokens: int = Field(0, ge=0)
    prompt_logprobs: int | None = Field(None, ge=0)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT)]],
                              Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM extensions accepted at their defaults only (check() refuses the rest, naming the field)
    use_beam_search: bool = False
    length_penalty: Number = 1.0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0: only with echo (score the prompt, generate nothing)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    add_special_tokens: bool = True
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Request):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64)]


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: Text | None = None
    # what an SDK sends back when a previous answer is appended to the conversation
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    annotations: list[dict[str, Any]] | None = None  # accepted, ignored (citations of an earlier answer)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call in `required` mode
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, str | bool | int | float | None] | None = None  # extra template variables
    echo: bool = False                      # vLLM: refused unless false
    continue_final_message: bool = False    # vLLM: refused unless false


def parse(model: type[_Request], raw: Any) -> Any:
    """Validate a decoded JSON body; RequestError(400) names the first bad field."""
    if not isinstance(raw, dict):
        raise RequestError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        errors = e.errors()
        field = errors[0]["loc"][:1]
        # A union field reports one error per member; the deepest one is about the member the input meant.
        err = max((x for x in errors if x["loc"][:1] == field),
                  key=lambda x: (len(x["loc"]), not x["type"].endswith("_type")))
        param = ".".join(str(p) for p in err["loc"] if not _is_type_tag(p)) or None
        if err["type"] == "extra_forbidden":
            raise RequestError(400, f"Unrecognized request argument supplied: {param}", param=param) from None
        if err["type"] == "missing":
            raise RequestError(400, f"Missing required parameter: {param}", param=param) from None
        raise RequestError(400, f"Invalid value for {param}: {err['msg']} (got {shown(err.get('input'))})",
                           param=param) from None


def _is_type_tag(part: Any) -> bool:
    """pydantic names union members in error locations ('str', 'list[TextPart]', '[key]'); they are not fields."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or part.startswith(("constrained-",
                                                                                           "function-")))


_TYPE_TAGS = {"str", "int", "float", "bool", "StreamOptions", "TextPart", "ChatMessage", "NamedToolChoice",
              "ToolCall", "Tool", "ResponseFormat", "StructuredOutputs", "JsonSchemaFormat"}


def shown(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# -- limits and the checks that need no model -----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask for. The worker's flags and model set it and its /load reports it;
    the router applies the strictest of a tier's workers before any work. None: not known here."""

    max_model_len: int | None = None   # prompt + completion tokens
    max_tokens: int | None = None      # completion tokens (`--max-tokens-limit`)
    max_n: int | None = None           # choices per prompt (`--max-n`)
    max_logprobs: int | None = None    # logprobs / top_logprobs (`--max-logprobs`)
    max_prompts: int | None = None     # prompts in one /v1/completions request (`--max-prompts`)

    def to_json(self) -> dict[str, int | None]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: Any) -> "Limits":
        """From a worker's /load `limits` (bad or missing values are unknown, never a crash)."""
        raw = raw if isinstance(raw, dict) else {}
        return cls(**{f.name: v for f in dataclasses.fields(cls)
                      if isinstance(v := raw.get(f.name), int) and not isinstance(v, bool) and v >= 0})

    @classmethod
    def strictest(cls, all_limits: list["Limits"]) -> "Limits":
        def least(name: str) -> int | None:
            known = [v for lim in all_limits if (v := getattr(lim, name)) is not None]
            return min(known) if known else None
        return cls(**{f.name: least(f.name) for f in dataclasses.fields(cls)})


def check(req: CompletionRequest | ChatCompletionRequest, limits: Limits) -> None:
    """Everything about a request that needs neither a tokenizer nor an engine. The router runs it
    before choosing a worker, the worker again before any work, so that no request a decode worker
    would refuse costs a prefill first. Text lengths are checked once tokenized (the worker)."""
    chat = isinstance(req, ChatCompletionRequest)
    _refuse_unsupported(req, chat)
    if limits.max_n is not None and req.n > limits.max_n:
        raise RequestError(400, f"n is {req.n}; this server allows at most {limits.max_n}", param="n")
    if req.stream_options is not None and not req.stream:
        raise RequestError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if chat and req.top_logprobs is not None and not req.logprobs:
        raise RequestError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = requested_logprobs(req)
    for name, value in (("top_logprobs" if chat else "logprobs", logprobs), ("prompt_logprobs", req.prompt_logprobs)):
        if value is not None and limits.max_logprobs is not None and value > limits.max_logprobs:
            raise RequestError(400, f"at most {limits.max_logprobs} logprobs may be asked for", param=name)
    _check_sampling(req)
    structured_output(req)
    if chat:
        _check_tools(req)
    elif req.max_tokens == 0 and not req.echo:
        raise RequestError(400, "max_tokens 0 generates nothing; it is only allowed with echo: true (score the prompt)",
                           param="max_tokens")
    lengths = [1] if chat else _prompt_lengths(req.prompt, limits)
    check_context(max(lengths), requested_max_tokens(req), limits, chat)


def _check_sampling(req: CompletionRequest | ChatCompletionRequest) -> None:
    for key in req.logit_bias or {}:
        if not (key.isascii() and key.isdigit() and int(key) < TOKEN_ID_LIMIT):
            raise RequestError(400, f"logit_bias keys are token ids, got {shown(key)}", param="logit_bias")
    wanted = requested_max_tokens(req)
    if wanted is not None and req.min_tokens > wanted:
        raise RequestError(400, f"min_tokens ({req.min_tokens}) is more than max_tokens ({wanted})", param="min_tokens")


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
            raise RequestError(400, "response_format json_schema needs json_schema.schema",
                               param="response_format.json_schema")
        want("response_format.json_schema", "json", _json_text(fmt.json_schema.schema_))
    so = req.structured_outputs
    if so is not None:
        given = [(n, v) for n, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                     ("grammar", so.grammar), ("json_object", so.json_object or None)) if v is not None]
        if len(given) != 1:
            raise RequestError(400, "structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
                               param="structured_outputs")
        name, value = given[0]
        _structured_field(want, f"structured_outputs.{name}", name, value)
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{name}")
        if value is not None:
            _structured_field(want, f"guided_{name}", name, value)
    if len(asked) > 1:
        raise RequestError(400, f"{asked[1][0]} and {asked[0][0]} both constrain the output; send one",
                           param=asked[1][0])
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


def _check_tools(req: ChatCompletionRequest) -> None:
    choice = req.tool_choice
    names = [t.function.name for t in req.tools or ()]
    if len(set(names)) != len(names):
        raise RequestError(400, "tools hold two functions of one name", param="tools")
    if choice == "required" and not names:
        raise RequestError(400, "tool_choice required needs tools", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise RequestError(400, f"tool_choice names {shown(choice.function.name)}, which is not in tools",
                           param="tool_choice")
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if forced and structured_output(req) is not None:
        raise RequestError(400, "a forced tool call and a structured output both constrain the output; send one",
                           param="tool_choice")
    for i, msg in enumerate(req.messages):
        for j, call in enumerate(msg.tool_calls or ()):
            try:
                args = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                args = None
            if not isinstance(args, dict):
                raise RequestError(400, "a tool call's arguments are a JSON object",
                                   param=f"messages.{i}.tool_calls.{j}.function.arguments")


def requested_max_tokens(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        return req.max_completion_tokens or req.max_tokens
    return req.max_tokens


def requested_logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def check_context(longest: int, max_tokens: int | None, limits: Limits, chat: bool) -> None:
    """The longest prompt (tokens, or a lower bound before tokenizing) and the completion fit the model."""
    if max_tokens is not None and limits.max_tokens is not None and max_tokens > limits.max_tokens:
        raise RequestError(400, f"max_tokens is {max_tokens}; this server allows at most {limits.max_tokens}",
                           param="max_tokens")
    ctx = limits.max_model_len
    if ctx is None:
        return
    if longest >= ctx:
        raise RequestError(400, f"This model's maximum context length is {ctx} tokens, but the prompt has "
                                f"{longest} tokens", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
    if max_tokens is not None and longest + max_tokens > ctx:
        raise RequestError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                                f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for the "
                                f"completion). Reduce the prompt or max_tokens.", param="max_tokens",
                           code="context_length_exceeded")


def prompt_items(prompt: str | list) -> list[str | list[int]]:
    """A completions `prompt` as a list of prompts, each text or token ids."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def _prompt_lengths(prompt: str | list, limits: Limits) -> list[int]:
    """Token counts of token-id prompts, 1 (a lower bound) for text ones; refuses empty and too many."""
    items = prompt_items(prompt)
    if not items:
        raise RequestError(400, "prompt is empty", param="prompt")
    if limits.max_prompts is not None and len(items) > limits.max_prompts:
        raise RequestError(400, f"prompt holds {len(items)} prompts; this server allows at most "
                                f"{limits.max_prompts} in one request", param="prompt", code="too_many_prompts")
    lengths = []
    for i, item in enumerate(items):
        if not item:
            raise RequestError(400, f"prompt {i} is empty", param="prompt")
        if isinstance(item, list):
            bad = [t for t in item if not 0 <= t < TOKEN_ID_LIMIT]
            if bad:
                raise RequestError(400, f"prompt {i} has token ids outside [0, {TOKEN_ID_LIMIT}): "
                                        f"{shown(bad[:5])}", param="prompt")
        lengths.append(len(item) if isinstance(item, list) else 1)
    return lengths


def _refuse_unsupported(req: CompletionRequest | ChatCompletionRequest, chat: bool) -> None:
    """Fields this server cannot honour: 400 naming the field unless at their default."""
    so = req.structured_outputs
    unsupported = [
        ("use_beam_search", req.use_beam_search), ("length_penalty", req.length_penalty != 1.0),
        ("allowed_token_ids", req.allowed_token_ids is not None), ("bad_words", bool(req.bad_words)),
        ("skip_special_tokens", not req.skip_special_tokens),
        ("spaces_between_special_tokens", not req.spaces_between_special_tokens),
        ("truncate_prompt_tokens", req.truncate_prompt_tokens is not None), ("priority", req.priority != 0),
        ("guided_whitespace_pattern", req.guided_whitespace_pattern is not None),
        ("guided_decoding_backend", req.guided_decoding_backend not in (None, "auto", "guidance", "llguidance")),
        ("structured_outputs.structural_tag", so is not None and so.structural_tag is not None),
        ("structured_outputs.whitespace_pattern", so is not None and so.whitespace_pattern is not None),
        ("structured_outputs.disable_additional_properties", so is not None and so.disable_additional_properties),
        ("structured_outputs.backend", so is not None and so.backend not in (None, "auto", "guidance", "llguidance"))]
    if chat:
        unsupported += [
            ("functions", bool(req.functions)), ("function_call", req.function_call not in (None, "none", "auto")),
            ("modalities", req.modalities is not None and set(req.modalities) != {"text"}),
            ("audio", req.audio is not None), ("prediction", req.prediction is not None),
            ("reasoning_effort", req.reasoning_effort is not None), ("verbosity", req.verbosity is not None),
            ("web_search_options", req.web_search_options is not None), ("echo", req.echo),
            ("continue_final_message", req.continue_final_message)]
        for i, msg in enumerate(req.messages):
            unsupported += [(f"messages.{i}.function_call", msg.function_call is not None),
                            (f"messages.{i}.audio", msg.audio is not None)]
    else:
        unsupported += [("suffix", req.suffix is not None),
                        ("best_of", req.best_of is not None and req.best_of != req.n)]
    for name, bad in unsupported:
        if bad:
            raise RequestError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")


# -- responses ----------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def model_card(model_id: str, created: int, **extra: Any) -> dict[str, Any]:
    """One entry of /v1/models (and the body of /v1/models/{id})."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": "pdfleet", **extra}


def model_not_found(model_id: str, served: list[str]) -> RequestError:
    return RequestError(404, f"The model `{model_id}` does not exist; this server serves "
                             f"{', '.join(f'`{m}`' for m in served) or 'no model yet'}",
                        param="model", code="model_not_found")


def assistant_message(content: str) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "refusal": None}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def completion_chunk(rid: str, created: int, model: str, choices: list[dict[str, Any]],
                     usage_: dict[str, Any] | None = None) -> dict[str, Any]:
    out = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out


def chat_chunk(rid: str, created: int, model: str, choices: list[dict[str, Any]],
               usage_: dict[str, Any] | None = None) -> dict[str, Any]:
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out
