"""The OpenAI request bodies the router and the worker accept: strict pydantic models (unknown fields refused, null
means the default) and `parse`, whose 400 names the first bad field. No torch."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pdfleet_worker.wire.errors import RequestError, shown

# Bounds on what one request may hold, whatever the server's flags: each costs the engine per step
# (stop strings are searched on every token) or the server per request, and no real client needs more.
MAX_STOP_SEQUENCES = 16  # OpenAI allows 4
MAX_STOP_CHARS = 256  # per stop string; the stream holds back that many characters
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_TOOLS = 128  # OpenAI's limit on tools
MAX_METADATA_KEYS = 16  # OpenAI's metadata limits: 16 pairs, keys of 64 and values of 512 characters
TOKEN_ID_LIMIT = 2**31  # token ids are below it in any vocabulary

Number = float  # strict float accepts JSON integers, never strings
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
Text = Annotated[str, Field(max_length=256)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES)]
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
    Field(max_length=MAX_METADATA_KEYS),
]


class _Request(BaseModel):
    """Strict: unknown fields and wrong JSON types are refused. `null` for a field that has a
    default means that default (the OpenAI spec marks them nullable)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    _null_means_default: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls._null_means_default = frozenset(
            name
            for name, f in cls.model_fields.items()
            if not f.is_required() and type(None) not in get_args(f.annotation)
        )

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
    disable_fallback: bool = False  # accepted: there is no other backend to fall back to
    disable_any_whitespace: bool = False  # accepted: JSON is always compact here (engine/structured.py)
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    backend: str | None = None  # accepted when "guidance"/"auto": llguidance is the one backend


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
    logit_bias: (
        Annotated[dict[str, Annotated[Number, Field(ge=-100, le=100)]], Field(max_length=MAX_LOGIT_BIAS)] | None
    ) = None
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
    stop_token_ids: (
        Annotated[list[Annotated[int, Field(ge=0, lt=TOKEN_ID_LIMIT)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None
    ) = None
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
    echo: bool = False  # vLLM: refused unless false
    continue_final_message: bool = False  # vLLM: refused unless false


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
        err = max(
            (x for x in errors if x["loc"][:1] == field), key=lambda x: (len(x["loc"]), not x["type"].endswith("_type"))
        )
        param = ".".join(str(p) for p in err["loc"] if not _is_type_tag(p)) or None
        if err["type"] == "extra_forbidden":
            raise RequestError(400, f"Unrecognized request argument supplied: {param}", param=param) from None
        if err["type"] == "missing":
            raise RequestError(400, f"Missing required parameter: {param}", param=param) from None
        raise RequestError(
            400, f"Invalid value for {param}: {err['msg']} (got {shown(err.get('input'))})", param=param
        ) from None


def _is_type_tag(part: Any) -> bool:
    """pydantic names union members in error locations ('str', 'list[TextPart]', '[key]'); they are not fields."""
    return isinstance(part, str) and (
        part in _TYPE_TAGS or "[" in part or part.startswith(("constrained-", "function-"))
    )


_TYPE_TAGS = {
    "str",
    "int",
    "float",
    "bool",
    "StreamOptions",
    "TextPart",
    "ChatMessage",
    "NamedToolChoice",
    "ToolCall",
    "Tool",
    "ResponseFormat",
    "StructuredOutputs",
    "JsonSchemaFormat",
}
