"""The one definition of a valid OpenAI request, applied by the router and by the worker: hostile-JSON decoding, strict request models (null means the default), per-request limits; plus error objects and response/chunk builders. No torch."""
from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# Bounds on what one request may hold, whatever the server's flags: each costs the engine per step
# (stop strings are searched on every token) or the server per request, and no real client needs more.
MAX_JSON_DEPTH = 32            # nesting of arrays/objects in a body (a request needs 4)
MAX_STOP_SEQUENCES = 16        # OpenAI allows 4
MAX_STOP_CHARS = 256           # per stop string; the stream holds back that many characters
MAX_STOP_TOKEN_IDS = 256
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
    logit_bias: dict[str, Number] | None = None
    # accepted and ignored: nothing is stored, tiered or keyed by them here
    user: Text | None = None
    store: bool | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1, lt=TOKEN_ID_LIMIT)
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT)]],
                              Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: Text | None = None
    # what an SDK sends back when a previous answer is appended to the conversation
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
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
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # accepted, ignored: no tools run here
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    add_generation_prompt: bool = True


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


_TYPE_TAGS = {"str", "int", "float", "bool", "StreamOptions", "TextPart", "ChatMessage"}


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
    if logprobs is not None and limits.max_logprobs is not None and logprobs > limits.max_logprobs:
        raise RequestError(400, f"at most {limits.max_logprobs} logprobs may be asked for",
                           param="top_logprobs" if chat else "logprobs")
    lengths = [1] if chat else _prompt_lengths(req.prompt, limits)
    check_context(max(lengths), requested_max_tokens(req), limits, chat)


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
    """OpenAI fields this server cannot honour: 400 naming the field unless at their default."""
    unsupported = [("presence_penalty", bool(req.presence_penalty)), ("frequency_penalty", bool(req.frequency_penalty)),
                   ("logit_bias", bool(req.logit_bias))]
    if chat:
        fmt = req.response_format
        unsupported += [
            ("tools", bool(req.tools)), ("tool_choice", req.tool_choice not in (None, "none", "auto")),
            ("response_format", bool(fmt) and fmt.get("type") != "text"),
            ("functions", bool(req.functions)), ("function_call", req.function_call not in (None, "none", "auto")),
            ("modalities", req.modalities is not None and set(req.modalities) != {"text"}),
            ("audio", req.audio is not None), ("prediction", req.prediction is not None),
            ("reasoning_effort", req.reasoning_effort is not None), ("verbosity", req.verbosity is not None),
            ("web_search_options", req.web_search_options is not None)]
        for i, msg in enumerate(req.messages):
            unsupported += [(f"messages.{i}.tool_calls", bool(msg.tool_calls)),
                            (f"messages.{i}.function_call", msg.function_call is not None),
                            (f"messages.{i}.audio", msg.audio is not None)]
    else:
        unsupported += [("echo", req.echo), ("suffix", req.suffix is not None),
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
