"""The checks of a request that need no tokenizer and no engine (`check`), run by the router before it picks a worker
and by the worker before any work; plus the token budgets a request asks for. No torch."""

from __future__ import annotations

import json

from pdfleet_worker.wire.errors import RequestError, shown
from pdfleet_worker.wire.limits import Limits
from pdfleet_worker.wire.request_types import TOKEN_ID_LIMIT, ChatCompletionRequest, CompletionRequest, NamedToolChoice
from pdfleet_worker.wire.structured_output import structured_output


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
        raise RequestError(
            400,
            "max_tokens 0 generates nothing; it is only allowed with echo: true (score the prompt)",
            param="max_tokens",
        )
    lengths = [1] if chat else _prompt_lengths(req.prompt, limits)
    check_context(max(lengths), requested_max_tokens(req), limits, chat)


def _check_sampling(req: CompletionRequest | ChatCompletionRequest) -> None:
    for key in req.logit_bias or {}:
        if not (key.isascii() and key.isdigit() and int(key) < TOKEN_ID_LIMIT):
            raise RequestError(400, f"logit_bias keys are token ids, got {shown(key)}", param="logit_bias")
    wanted = requested_max_tokens(req)
    if wanted is not None and req.min_tokens > wanted:
        raise RequestError(400, f"min_tokens ({req.min_tokens}) is more than max_tokens ({wanted})", param="min_tokens")


def _check_tools(req: ChatCompletionRequest) -> None:
    choice = req.tool_choice
    names = [t.function.name for t in req.tools or ()]
    if len(set(names)) != len(names):
        raise RequestError(400, "tools hold two functions of one name", param="tools")
    if choice == "required" and not names:
        raise RequestError(400, "tool_choice required needs tools", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise RequestError(
            400, f"tool_choice names {shown(choice.function.name)}, which is not in tools", param="tool_choice"
        )
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if forced and structured_output(req) is not None:
        raise RequestError(
            400, "a forced tool call and a structured output both constrain the output; send one", param="tool_choice"
        )
    for i, msg in enumerate(req.messages):
        for j, call in enumerate(msg.tool_calls or ()):
            try:
                args = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                args = None
            if not isinstance(args, dict):
                raise RequestError(
                    400,
                    "a tool call's arguments are a JSON object",
                    param=f"messages.{i}.tool_calls.{j}.function.arguments",
                )


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
        raise RequestError(
            400, f"max_tokens is {max_tokens}; this server allows at most {limits.max_tokens}", param="max_tokens"
        )
    ctx = limits.max_model_len
    if ctx is None:
        return
    if longest >= ctx:
        raise RequestError(
            400,
            f"This model's maximum context length is {ctx} tokens, but the prompt has {longest} tokens",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is not None and longest + max_tokens > ctx:
        raise RequestError(
            400,
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for the "
            f"completion). Reduce the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )


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
        raise RequestError(
            400,
            f"prompt holds {len(items)} prompts; this server allows at most {limits.max_prompts} in one request",
            param="prompt",
            code="too_many_prompts",
        )
    lengths = []
    for i, item in enumerate(items):
        if not item:
            raise RequestError(400, f"prompt {i} is empty", param="prompt")
        if isinstance(item, list):
            bad = [t for t in item if not 0 <= t < TOKEN_ID_LIMIT]
            if bad:
                raise RequestError(
                    400, f"prompt {i} has token ids outside [0, {TOKEN_ID_LIMIT}): {shown(bad[:5])}", param="prompt"
                )
        lengths.append(len(item) if isinstance(item, list) else 1)
    return lengths


def _refuse_unsupported(req: CompletionRequest | ChatCompletionRequest, chat: bool) -> None:
    """Fields this server cannot honour: 400 naming the field unless at their default."""
    so = req.structured_outputs
    unsupported = [
        ("use_beam_search", req.use_beam_search),
        ("length_penalty", req.length_penalty != 1.0),
        ("allowed_token_ids", req.allowed_token_ids is not None),
        ("bad_words", bool(req.bad_words)),
        ("skip_special_tokens", not req.skip_special_tokens),
        ("spaces_between_special_tokens", not req.spaces_between_special_tokens),
        ("truncate_prompt_tokens", req.truncate_prompt_tokens is not None),
        ("priority", req.priority != 0),
        ("guided_whitespace_pattern", req.guided_whitespace_pattern is not None),
        ("guided_decoding_backend", req.guided_decoding_backend not in (None, "auto", "guidance", "llguidance")),
        ("structured_outputs.structural_tag", so is not None and so.structural_tag is not None),
        ("structured_outputs.whitespace_pattern", so is not None and so.whitespace_pattern is not None),
        ("structured_outputs.disable_additional_properties", so is not None and so.disable_additional_properties),
        ("structured_outputs.backend", so is not None and so.backend not in (None, "auto", "guidance", "llguidance")),
    ]
    if chat:
        unsupported += [
            ("functions", bool(req.functions)),
            ("function_call", req.function_call not in (None, "none", "auto")),
            ("modalities", req.modalities is not None and set(req.modalities) != {"text"}),
            ("audio", req.audio is not None),
            ("prediction", req.prediction is not None),
            ("reasoning_effort", req.reasoning_effort is not None),
            ("verbosity", req.verbosity is not None),
            ("web_search_options", req.web_search_options is not None),
            ("echo", req.echo),
            ("continue_final_message", req.continue_final_message),
        ]
        for i, msg in enumerate(req.messages):
            unsupported += [
                (f"messages.{i}.function_call", msg.function_call is not None),
                (f"messages.{i}.audio", msg.audio is not None),
            ]
    else:
        unsupported += [
            ("suffix", req.suffix is not None),
            ("best_of", req.best_of is not None and req.best_of != req.n),
        ]
    for name, bad in unsupported:
        if bad:
            raise RequestError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")
