"""The OpenAI completions and chat handlers: request -> engine requests -> JSON or SSE, including the PD prefill and
decode modes; the app routes to it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdfleet_worker.engine.llm_engine import QueueFullError
from pdfleet_worker.engine.outputs import RequestOutput
from pdfleet_worker.kv_transfer.params import DO_REMOTE_DECODE, DO_REMOTE_PREFILL, KVTransferParams
from pdfleet_worker.layers.sampler import TokenLogprobs
from pdfleet_worker.sampling_params import SamplingParams, StructuredOutput
from pdfleet_worker.server import tool_calls as tc
from pdfleet_worker.server.engine_loop import EngineLoop, StreamError
from pdfleet_worker.server.pd import PD, TransferRefused
from pdfleet_worker.server.worker_config import WorkerConfig
from pdfleet_worker.wire import checks, errors, heartbeat, limits, responses
from pdfleet_worker.wire import request_types as rq
from pdfleet_worker.wire import structured_output as so
from pdfleet_worker.wire.errors import RequestError
from pdfleet_worker.wire.streaming import SSE_HEADERS, EventStreamResponse, read_json, sse, until_disconnect

log = logging.getLogger("pdfleet.serving")


@dataclasses.dataclass
class ServerState:
    draining: bool = False
    inflight: int = 0  # generation requests not yet fully answered


@dataclasses.dataclass
class Prepared:
    """A validated request in engine terms."""

    chat: bool
    prompts: list[list[int]]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    logprobs: int | None
    prefill_only: bool = False  # PD prefill: hold the KV, return transfer params
    remote: KVTransferParams | None = None  # PD decode: take the KV from a prefill worker
    echo: bool = False  # completions: the prompt comes first in the answer
    echo_only: bool = False  # max_tokens 0: the one token the engine samples is dropped
    prompt_texts: list[str] = dataclasses.field(default_factory=list)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field (also set by echo + logprobs)
    tools: tc.ToolPlan | None = None  # chat with tools


@dataclasses.dataclass
class Choice:
    index: int
    prompt_index: int
    request_id: str
    text: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    final: RequestOutput | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    streamer: tc.ToolCallStreamer | None = None  # streamed chat with tools
    echoed: bool = False  # streamed echo: the prompt went out


class OpenAIServing:
    def __init__(self, cfg: WorkerConfig, loop: EngineLoop, pd: PD | None, metrics, state: ServerState):
        self.cfg = cfg
        self.loop = loop
        self.engine = loop.engine
        self.tokenizer = loop.engine.tokenizer
        self.pd = pd
        self.metrics = metrics
        self.state = state
        self.model_name = cfg.served_model_name
        self.max_model_len = loop.engine.max_model_len
        self.vocab_size = loop.engine.model_config.vocab_size
        self.limits = limits.Limits(
            max_model_len=self.max_model_len,
            max_tokens=cfg.max_tokens,
            max_n=cfg.max_n,
            max_logprobs=cfg.max_logprobs,
            max_prompts=cfg.max_prompts,
        )
        self.longest_token_chars = _longest_token_chars(self.tokenizer)
        # NOTE: a lower bound on tokens without tokenizing: no token stands for more characters than the
        # longest one decodes to; x4 leaves room for normalizers that shrink text before it is split.
        self.max_prompt_chars = 4 * self.max_model_len * self.longest_token_chars

    # -- entry points ---------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def _handle(self, request: Request, chat: bool) -> Response:
        if self.state.draining:
            self.metrics.rejected("draining")
            raise RequestError(
                503,
                "this worker is draining (shutting down); retry on another worker",
                type="service_unavailable",
                code="draining",
                headers={"Retry-After": str(self.cfg.retry_after_s)},
            )
        raw = await read_json(request, self.cfg.max_request_bytes)
        req = rq.parse(rq.ChatCompletionRequest if chat else rq.CompletionRequest, raw)
        prep = await self._prepare(req, chat)
        self.state.inflight += 1
        handed_over = False
        try:
            choices, queue = await self._admit(prep)
            if prep.stream and not prep.prefill_only:
                response = await self._stream(request, prep, choices, queue)
                handed_over = True  # the response's iterator finishes the bookkeeping
                return response
            return await self._complete(request, prep, choices, queue)
        finally:
            if not handed_over:
                self.state.inflight -= 1

    # -- validation -----------------------------------------------------------------------------
    async def _prepare(self, req: rq.CompletionRequest | rq.ChatCompletionRequest, chat: bool) -> Prepared:
        """The same checks as the router's (protocol.check), then the ones that need the model. A
        prefill-only request is the client's whole request: it is refused here exactly when the
        decode worker would refuse it, before any prefill."""
        if req.model != self.model_name:
            raise responses.model_not_found(req.model, [self.model_name])
        checks.check(req, self.limits)
        tools = tc.plan(req, self.tokenizer.chat_template if self.tokenizer else None) if chat else None
        structured = await self._structured(req, tools)
        prompts = await (
            self._chat_prompt(req, tools) if chat else self._completion_prompts(req.prompt, req.add_special_tokens)
        )
        max_tokens = checks.requested_max_tokens(req)
        logprobs = checks.requested_logprobs(req)
        echo_only = not chat and req.echo and max_tokens == 0
        if echo_only:
            max_tokens = 1  # NOTE: as vLLM: the prompt is scored by a step that samples one token, then dropped
        longest = max(len(t) for t in prompts)
        checks.check_context(longest, max_tokens, self.limits, chat)
        if max_tokens is None:
            max_tokens = self.max_model_len - longest
            if self.cfg.max_tokens is not None:
                max_tokens = min(max_tokens, self.cfg.max_tokens)
        top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
        top_p = 1.0 if req.top_p is None else float(req.top_p)
        if top_p == 0:  # OpenAI allows it: the smallest set of tokens with mass >= 0, the most likely one
            top_k, top_p = 1, 1.0
        prefill_only, remote = self._pd_mode(req.kv_transfer_params, len(prompts))
        n = req.n
        echo = not chat and req.echo
        prompt_logprobs = req.prompt_logprobs
        if echo and logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, logprobs)
        bias = {int(k): float(v) for k, v in (req.logit_bias or {}).items()}
        if bias and max(bias) >= self.vocab_size:
            raise RequestError(
                400, f"logit_bias names token {max(bias)}; the vocabulary has {self.vocab_size}", param="logit_bias"
            )
        try:
            if prefill_only:  # only the prompt's KV matters: the decode worker samples (and constrains) for real
                params = SamplingParams(max_tokens=1, temperature=0.0)
                n, logprobs = 1, None
            else:
                params = SamplingParams(
                    max_tokens=max_tokens,
                    temperature=1.0 if req.temperature is None else float(req.temperature),
                    top_k=top_k,
                    top_p=top_p,
                    min_p=float(req.min_p or 0.0),
                    seed=req.seed,
                    stop=req.stop,
                    stop_token_ids=req.stop_token_ids,
                    ignore_eos=req.ignore_eos,
                    min_tokens=0 if echo_only else req.min_tokens,
                    repetition_penalty=float(req.repetition_penalty or 1.0),
                    presence_penalty=float(req.presence_penalty or 0.0),
                    frequency_penalty=float(req.frequency_penalty or 0.0),
                    logit_bias=bias or None,
                    logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs,
                    structured=structured,
                    include_stop_str_in_output=req.include_stop_str_in_output,
                )
        except ValueError as e:
            raise RequestError(400, str(e)) from None
        if params.stop and self.tokenizer is None:
            raise RequestError(400, "stop strings need a tokenizer; this model has none", param="stop")
        opts = req.stream_options
        prompt_texts = []
        if echo and not prefill_only:
            prompt_texts = [
                item if isinstance(item, str) else self.tokenizer.decode(item) if self.tokenizer else ""
                for item in checks.prompt_items(req.prompt)
            ]
        return Prepared(
            chat=chat,
            prompts=prompts,
            params=params,
            n=n,
            stream=req.stream,
            include_usage=bool(opts and opts.include_usage),
            continuous_usage=bool(opts and opts.continuous_usage_stats),
            return_token_ids=req.return_token_ids,
            logprobs=logprobs,
            prefill_only=prefill_only,
            remote=remote,
            echo=echo and not prefill_only,
            echo_only=echo_only and not prefill_only,
            prompt_texts=prompt_texts,
            prompt_logprobs=None if prefill_only else req.prompt_logprobs,
            tools=None if prefill_only else tools,
        )

    async def _structured(
        self, req: rq.CompletionRequest | rq.ChatCompletionRequest, tools: tc.ToolPlan | None
    ) -> StructuredOutput | None:
        """The grammar the output runs under (a structured output, or a forced tool call), compiled here (off the
        event loop) so that a bad one is a 400 before any work."""
        asked = so.structured_output(req)
        if tools is not None and tools.structured is not None:
            asked = ("tool_choice", tools.structured)
        if asked is None:
            return None
        param, spec = asked
        grammars = self.engine.grammars
        if grammars is None:
            raise RequestError(
                400,
                "structured outputs need the model's tokenizer.json and an EOS token; this model has none",
                param=param,
            )
        try:
            await asyncio.to_thread(grammars.compile, spec)
        except ValueError as e:
            raise RequestError(400, str(e), param=param) from None
        return spec

    async def _completion_prompts(self, prompt: Any, add_special_tokens: bool = True) -> list[list[int]]:
        out = []
        for i, item in enumerate(checks.prompt_items(prompt)):
            if isinstance(item, str):
                if self.tokenizer is None:
                    raise RequestError(
                        400, "text prompts need a tokenizer; this model has none; send token ids", param="prompt"
                    )
                ids = await self._encode(item, "prompt", add_special_tokens=add_special_tokens)
            else:
                ids = list(item)
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise RequestError(
                        400, f"prompt {i} has token ids outside [0, {self.vocab_size}): {bad[:5]}", param="prompt"
                    )
            if not ids:
                raise RequestError(400, f"prompt {i} is empty", param="prompt")
            out.append(ids)
        return out

    async def _chat_prompt(self, req: rq.ChatCompletionRequest, tools: tc.ToolPlan | None) -> list[list[int]]:
        if self.tokenizer is None:
            raise RequestError(
                400, "chat needs a tokenizer with a chat template; this model has none", param="messages"
            )
        messages = []
        for msg in req.messages:
            content = msg.content
            if isinstance(content, list):
                content = "".join(part.text for part in content)
            m: dict[str, Any] = {"role": msg.role, "content": content or ""}
            if msg.tool_calls:  # arguments as objects, the way templates (and transformers) take them
                m["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)},
                    }
                    for c in msg.tool_calls
                ]
            if msg.tool_call_id is not None:
                m["tool_call_id"] = msg.tool_call_id
            if msg.name is not None:
                m["name"] = msg.name
            messages.append(m)
        self._refuse_long_text(sum(len(m["content"]) for m in messages), "messages")
        try:
            text = await asyncio.to_thread(
                self.tokenizer.apply_chat_template,
                messages,
                add_generation_prompt=req.add_generation_prompt,
                tools=tools.tools if tools is not None else None,
                **(req.chat_template_kwargs or {}),
            )
        except Exception as e:  # a template error is the request's fault (e.g. roles it refuses)
            raise RequestError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        # NOTE: the template writes the special tokens it wants; adding them again would double BOS.
        ids = await self._encode(text, "messages", add_special_tokens=False)
        if not ids:
            raise RequestError(400, "the messages render to an empty prompt", param="messages")
        return [ids]

    async def _encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        """Tokenize off the event loop (4 MB of text take seconds), after refusing text that cannot fit."""
        self._refuse_long_text(len(text), param)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    def _refuse_long_text(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise RequestError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; a prompt "
                f"of {chars} characters cannot fit (at most {self.longest_token_chars} "
                f"characters make one token)",
                param=param,
                code="context_length_exceeded",
            )

    def _pd_mode(self, raw: dict | None, num_prompts: int) -> tuple[bool, KVTransferParams | None]:
        if raw is None:
            return False, None
        if raw.get(DO_REMOTE_DECODE) is True:
            if self.pd is None or self.pd.kv_address is None:
                raise RequestError(
                    400,
                    f"this worker (role {self.cfg.role}) does not hold KV for remote decode",
                    param="kv_transfer_params",
                )
            return True, None
        if raw.get(DO_REMOTE_PREFILL) is True:
            if self.pd is None or not self.cfg.pulls_kv:
                raise RequestError(
                    400, f"this worker (role {self.cfg.role}) does not pull remote KV", param="kv_transfer_params"
                )
            try:
                params = KVTransferParams.from_json(raw)
            except ValueError as e:
                raise RequestError(400, str(e), param="kv_transfer_params") from None
            if len(params.prompts) != num_prompts:
                raise RequestError(
                    400,
                    f"kv_transfer_params holds {len(params.prompts)} prompts, the request {num_prompts}",
                    param="kv_transfer_params",
                )
            return False, params
        raise RequestError(
            400, f"kv_transfer_params needs {DO_REMOTE_DECODE} or {DO_REMOTE_PREFILL}: true", param="kv_transfer_params"
        )

    # -- admission ------------------------------------------------------------------------------
    async def _admit(self, prep: Prepared) -> tuple[list[Choice], asyncio.Queue]:
        base = responses.new_id("cmpl")
        ids = [[f"{base}-{i}-{j}" for j in range(prep.n)] for i in range(len(prep.prompts))]
        queue: asyncio.Queue = asyncio.Queue()
        choices: list[Choice] = []
        remote_tokens: list[int] = [0] * len(prep.prompts)
        if prep.remote is not None and prep.params.prompt_logprobs is not None:
            assert self.pd is not None  # prompt logprobs need every prompt position computed here: no KV pulled
            for i in range(len(prep.prompts)):
                self.pd.release_unused(prep.remote, i, None)
            prep.remote = None
        if prep.remote is not None:
            assert self.pd is not None
            refused = await self.pd.untrusted(prep.remote)
            if refused is not None:  # nothing to ack there either: its leases expire on their own
                self.metrics.kv_failure(refused.reason)
                if self.cfg.kv_on_failure == "fail":
                    raise RequestError(502, str(refused), type="kv_transfer_error", code=refused.reason)
                log.warning("%s; recomputing the prompt here", refused)
                prep.remote = None
        if prep.remote is not None:
            assert self.pd is not None
            for i, tokens in enumerate(prep.prompts):
                try:
                    remote_tokens[i] = self.pd.remote_tokens(prep.remote, i, tokens)
                except TransferRefused as e:
                    self.pd.release_unused(prep.remote, i, e.reason)
                    if self.cfg.kv_on_failure == "fail":
                        for k in range(len(prep.prompts)):
                            if k != i:
                                self.pd.release_unused(prep.remote, k, None)
                        raise RequestError(502, str(e), type="kv_transfer_error", code=e.reason) from None
                    log.warning("%s; recomputing the prompt here", e)
                    continue
                if remote_tokens[i] == 0:
                    self.pd.release_unused(prep.remote, i, None)
                else:
                    self.pd.register(prep.remote, i, ids[i])
        added: list[str] = []
        try:
            for i, tokens in enumerate(prep.prompts):
                for j, rid in enumerate(ids[i]):
                    params = prep.params
                    if params.seed is not None and prep.n > 1:
                        params = dataclasses.replace(params, seed=params.seed + j)
                    choices.append(Choice(index=len(choices), prompt_index=i, request_id=rid))
                    await self.loop.add(
                        rid, tokens, params, remote_kv_tokens=remote_tokens[i], hold_kv=prep.prefill_only, queue=queue
                    )
                    added.append(rid)
        except BaseException as e:
            for rid in added:
                self.loop.abort(rid)
            if self.pd is not None:  # ack every remote prompt nobody will pull now
                for rid in (r for row in ids for r in row):
                    self.pd.settle(rid, ok=False)
            if isinstance(e, QueueFullError):
                self.metrics.rejected("queue_full")
                raise RequestError(
                    503,
                    f"the server is overloaded ({e}); retry later",
                    type="service_unavailable",
                    code="queue_full",
                    headers={"Retry-After": str(self.cfg.retry_after_s)},
                ) from None
            if isinstance(e, ValueError):
                raise RequestError(400, str(e)) from None
            raise
        return choices, queue

    def _end(self, prep: Prepared, choices: list[Choice]) -> None:
        """After the answer (complete, failed or abandoned): stop what still runs, settle PD state."""
        for ch in choices:
            if ch.final is None:
                self.loop.abort(ch.request_id)
            if self.pd is not None:
                self.pd.settle(ch.request_id, ok=ch.final is not None)

    # -- consuming outputs ----------------------------------------------------------------------
    def _apply(self, prep: Prepared, choice: Choice, out: RequestOutput) -> RequestOutput:
        """Record an output in its choice; returns it as the client sees it."""
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = out.prompt_logprobs
        if prep.echo_only:  # the token that scored the prompt is no part of the answer
            out = dataclasses.replace(
                out, new_token_ids=[], new_text="", logprobs=None, finish_reason="length" if out.finished else None
            )
        choice.text.append(out.new_text)
        choice.token_ids += out.new_token_ids
        if out.logprobs:
            choice.logprobs += out.logprobs
        choice.num_cached_tokens = out.num_cached_tokens
        if out.new_token_ids and self.pd is not None and prep.remote is not None:
            self.pd.settle(choice.request_id)  # decoding: the remote prompt is no longer needed
        if out.finished:
            choice.final = out
            choice.finish_reason = out.finish_reason
        return out

    async def _next(self, queue: asyncio.Queue, by_id: dict[str, Choice]) -> tuple[Choice, RequestOutput]:
        """The next output that carries tokens or ends a choice; StreamError raises RequestError."""
        while True:
            item = await queue.get()
            if isinstance(item, StreamError):
                raise RequestError(item.status, item.message, type=item.type, code=item.code)
            if item.kv_load is not None:
                continue
            if item.finished and item.finish_reason == "abort":
                raise RequestError(
                    503, "the request was aborted by the server", type="service_unavailable", code="aborted"
                )
            return by_id[item.request_id], item

    def _usage(self, prep: Prepared, choices: list[Choice]) -> dict[str, Any]:
        cached = sum(ch.num_cached_tokens for ch in choices if ch.index % prep.n == 0)
        return responses.usage(sum(len(t) for t in prep.prompts), sum(len(ch.token_ids) for ch in choices), cached)

    # -- non-streaming --------------------------------------------------------------------------
    async def _complete(
        self, request: Request, prep: Prepared, choices: list[Choice], queue: asyncio.Queue
    ) -> Response:
        by_id = {ch.request_id: ch for ch in choices}
        created = responses.now()
        delivered = False
        try:

            async def collect() -> None:
                pending = len(choices)
                while pending:
                    ch, out = await self._next(queue, by_id)
                    self._apply(prep, ch, out)
                    pending -= out.finished

            await until_disconnect(request, collect())
            body = self._full_body(prep, choices, created)
            if prep.prefill_only:
                assert self.pd is not None
                held = [(ch.request_id, ch.final, prep.prompts[ch.prompt_index]) for ch in choices]
                if any(out.held_kv is None for _, out, _ in held):
                    raise RequestError(500, "the prefill finished without holding its KV", type="server_error")
                body["kv_transfer_params"] = self.pd.transfer_params(held).to_json()
            delivered = True
            return JSONResponse(body)
        finally:
            self._end(prep, choices)
            if prep.prefill_only and not delivered and self.pd is not None:
                for ch in choices:
                    if ch.final is not None and ch.final.held_kv is not None:
                        self.pd.drop_lease(ch.request_id)

    def _full_body(self, prep: Prepared, choices: list[Choice], created: int) -> dict[str, Any]:
        out_choices = []
        for ch in choices:
            text = "".join(ch.text)
            if prep.chat:
                message, finish = self._chat_message(prep, text, ch.finish_reason)
                c: dict[str, Any] = {
                    "index": ch.index,
                    "message": message,
                    "logprobs": self._chat_logprobs(ch.logprobs) if prep.logprobs is not None else None,
                    "finish_reason": finish,
                }
            else:
                prompt_part = self._echo_logprobs(prep, ch) if prep.echo and prep.logprobs is not None else None
                c = {
                    "index": ch.index,
                    "text": (prep.prompt_texts[ch.prompt_index] if prep.echo else "") + text,
                    "logprobs": self._completion_logprobs(ch.logprobs, 0, prompt_part)
                    if prep.logprobs is not None
                    else None,
                    "finish_reason": ch.finish_reason,
                }
                if prep.prompt_logprobs is not None:
                    c["prompt_logprobs"] = self._vllm_prompt_logprobs(ch.prompt_logprobs)
            if prep.return_token_ids:
                c["token_ids"] = ch.token_ids
                c["prompt_token_ids"] = prep.prompts[ch.prompt_index]
            out_choices.append(c)
        body = {
            "id": responses.new_id("chatcmpl" if prep.chat else "cmpl"),
            "object": "chat.completion" if prep.chat else "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": out_choices,
            "usage": self._usage(prep, choices),
        }
        if prep.chat and prep.prompt_logprobs is not None:  # vLLM: one list for the request's one prompt
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(choices[0].prompt_logprobs)
        return body

    def _chat_message(self, prep: Prepared, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message, with tool_calls when the answer is calls; and the finish reason."""
        if prep.tools is None or prep.tools.mode == tc.NONE:
            return responses.assistant_message(text), finish
        content, calls = tc.parse(prep.tools, text)
        message = responses.assistant_message(content)
        if calls:
            message["tool_calls"] = [c.to_json() for c in calls]
            if finish == "stop" and prep.tools.mode != tc.NAMED:  # NOTE: as OpenAI: a named call ends with stop
                finish = "tool_calls"
        return message, finish

    # -- streaming ------------------------------------------------------------------------------
    async def _stream(self, request: Request, prep: Prepared, choices: list[Choice], queue: asyncio.Queue) -> Response:
        """Headers go out with the first token, so that an error before it (overload, a failed KV
        pull) still gets a real status code and the router may retry elsewhere; a first token that takes
        longer than the heartbeat interval sends them at that interval, with `: keep-alive` comments until it
        comes (an error after that is an error event)."""
        by_id = {ch.request_id: ch for ch in choices}
        if prep.tools is not None and prep.tools.mode != tc.NONE:
            for ch in choices:
                ch.streamer = tc.ToolCallStreamer(prep.tools)
        interval = self.cfg.heartbeat_interval_s
        try:
            fut, came = await until_disconnect(request, heartbeat.wait_or_beat(self._next(queue, by_id), interval))
            first: tuple[Choice, RequestOutput] | asyncio.Future = fut.result() if came else fut
        except BaseException:
            self.state.inflight -= 1
            self._end(prep, choices)
            raise
        closed = False

        def close() -> None:
            nonlocal closed
            if not closed:
                closed = True
                if isinstance(first, asyncio.Future):
                    first.cancel()  # a stream closed before it began: nothing else awaits the first output
                self.state.inflight -= 1
                self._end(prep, choices)

        events = heartbeat.with_heartbeats(self._events(prep, choices, by_id, queue, first, close), interval)
        return EventStreamResponse(events, headers=SSE_HEADERS, on_close=close)

    async def _events(
        self,
        prep: Prepared,
        choices: list[Choice],
        by_id: dict[str, Choice],
        queue: asyncio.Queue,
        first: tuple[Choice, RequestOutput] | asyncio.Future,
        close,
    ) -> AsyncIterator[bytes]:
        """first: the first output, or the future of it (heartbeats run while it is awaited here)."""
        rid = responses.new_id("chatcmpl" if prep.chat else "cmpl")
        created = responses.now()
        build = responses.chat_chunk if prep.chat else responses.completion_chunk
        first_future = first if isinstance(first, asyncio.Future) else None
        try:
            if first_future is not None:
                try:
                    first = await first_future
                except RequestError as e:
                    yield sse(errors.error_body(e.message, e.type, e.param, e.status))
                    yield b"data: [DONE]\n\n"
                    return
            if prep.chat:
                roles = [
                    {
                        "index": ch.index,
                        "delta": responses.assistant_message(""),
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for ch in choices
                ]
                yield sse(build(rid, created, self.model_name, roles, self._cont_usage(prep, choices)))
            pending = len(choices)
            item: tuple[Choice, RequestOutput] | None = first
            while pending:
                if item is None:
                    try:
                        item = await self._next(queue, by_id)
                    except RequestError as e:
                        yield sse(errors.error_body(e.message, e.type, e.param, e.status))
                        yield b"data: [DONE]\n\n"
                        return
                ch, out = item
                item = None
                out = self._apply(prep, ch, out)
                pending -= out.finished
                if not (
                    out.new_text
                    or out.finished
                    or (prep.return_token_ids and out.new_token_ids)
                    or (prep.echo and not ch.echoed)
                ):
                    continue
                delta = self._delta(prep, ch, out)
                if delta is None:
                    continue
                chunk = build(rid, created, self.model_name, [delta], self._cont_usage(prep, choices))
                if prep.chat and prep.prompt_logprobs is not None and ch.index == 0 and out.prompt_logprobs:
                    chunk["prompt_logprobs"] = self._vllm_prompt_logprobs(out.prompt_logprobs)
                yield sse(chunk)
            if prep.include_usage:
                yield sse(build(rid, created, self.model_name, [], self._usage(prep, choices)))
            yield b"data: [DONE]\n\n"
        finally:
            if first_future is not None and not first_future.done():
                first_future.cancel()
            close()

    def _cont_usage(self, prep: Prepared, choices: list[Choice]) -> dict[str, Any] | None:
        return self._usage(prep, choices) if prep.include_usage and prep.continuous_usage else None

    def _delta(self, prep: Prepared, ch: Choice, out: RequestOutput) -> dict[str, Any] | None:
        """One choice's piece of a chunk; None when there is nothing to send yet (a tool call still forming)."""
        lps = out.logprobs or []
        finish = out.finish_reason if out.finished else None
        if prep.chat:
            if ch.streamer is not None:
                delta = _merge(ch.streamer.feed(out.new_text, final=out.finished))
                if not delta and not out.finished and not (prep.return_token_ids and out.new_token_ids):
                    return None
                if finish == "stop" and ch.streamer.called and prep.tools.mode != tc.NAMED:
                    finish = "tool_calls"
            else:
                delta = {"content": out.new_text} if out.new_text or not out.finished else {}
            d: dict[str, Any] = {
                "index": ch.index,
                "delta": delta,
                "logprobs": self._chat_logprobs(lps) if prep.logprobs is not None else None,
                "finish_reason": finish,
            }
        else:
            head = ""
            echo_offset = len(prep.prompt_texts[ch.prompt_index]) if prep.echo else 0
            prompt_part = None
            if prep.echo and not ch.echoed:
                ch.echoed = True
                head = prep.prompt_texts[ch.prompt_index]
                if prep.logprobs is not None:
                    prompt_part = self._echo_logprobs(prep, ch)
            offset = echo_offset + sum(len(t) for t in ch.text[:-1])
            d = {
                "index": ch.index,
                "text": head + out.new_text,
                "logprobs": self._completion_logprobs(lps, offset, prompt_part) if prep.logprobs is not None else None,
                "finish_reason": finish,
            }
            if prep.prompt_logprobs is not None and out.prompt_logprobs:
                d["prompt_logprobs"] = self._vllm_prompt_logprobs(out.prompt_logprobs)
        if prep.return_token_ids:
            d["token_ids"] = out.new_token_ids
        return d

    # -- logprobs -------------------------------------------------------------------------------
    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _completion_logprobs(
        self, lps: list[TokenLogprobs], offset: int, prompt_part: dict[str, list] | None = None
    ) -> dict[str, Any]:
        """OpenAI's legacy logprobs; with echo, the prompt's tokens come first (prompt_part, at offset 0)."""
        tokens, offsets = [], []
        for lp in lps:
            text = self._token_text(lp.token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        out = {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self._token_text(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }
        if prompt_part is not None:
            out = {k: prompt_part[k] + v for k, v in out.items()}
        return out

    def _echo_logprobs(self, prep: Prepared, ch: Choice) -> dict[str, list]:
        """The prompt's part of echoed logprobs: its tokens, their logprobs (None for the first, which nothing
        predicts) and top alternatives with the token itself among them, as OpenAI's echo returns."""
        ids = prep.prompts[ch.prompt_index]
        entries = ch.prompt_logprobs or [None] * len(ids)
        assert len(entries) == len(ids), "prompt logprobs cover the prompt"
        tokens, logprobs, tops, offsets, offset = [], [], [], [], 0
        for token_id, e in zip(ids, entries):
            text = self._token_text(token_id)
            tokens.append(text)
            offsets.append(offset)
            # NOTE: offsets index the echoed text, which shows no special tokens (a BOS takes no room in it).
            offset += len(self.tokenizer.decode([token_id], skip_special_tokens=True)) if self.tokenizer else len(text)
            logprobs.append(None if e is None else e.logprob)
            tops.append(None if e is None else {self._token_text(t): v for t, v in [*e.top, (e.token_id, e.logprob)]})
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _vllm_prompt_logprobs(self, entries: list[TokenLogprobs | None] | None) -> list[dict[str, Any] | None] | None:
        """vLLM's prompt_logprobs: per prompt position, None for the first, else token id -> logprob, rank and
        decoded token, for the prompt token and the top alternatives."""
        if entries is None:
            return None
        out: list[dict[str, Any] | None] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            d = {
                str(t): {"logprob": v, "rank": r + 1, "decoded_token": self._token_text(t)}
                for r, (t, v) in enumerate(e.top)
            }
            d[str(e.token_id)] = {"logprob": e.logprob, "rank": e.rank, "decoded_token": self._token_text(e.token_id)}
            out.append(d)
        return out

    def _chat_logprobs(self, lps: list[TokenLogprobs]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                dict(entry(lp.token_id, lp.logprob), top_logprobs=[entry(t, v) for t, v in lp.top]) for lp in lps
            ]
        }


def _merge(pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """ToolCallStreamer's pieces as one chat delta (content joined; a call's pieces joined by index)."""
    delta: dict[str, Any] = {}
    for piece in pieces:
        if "content" in piece:
            delta["content"] = delta.get("content", "") + piece["content"]
        for call in piece.get("tool_calls", ()):
            calls = delta.setdefault("tool_calls", [])
            if calls and calls[-1]["index"] == call["index"]:
                calls[-1]["function"]["arguments"] += call["function"]["arguments"]
            else:
                calls.append(call)
    return delta


def _longest_token_chars(tokenizer) -> int:
    """Characters of the longest token's text (special tokens included); 1 without a tokenizer."""
    if tokenizer is None:
        return 1
    return max(1, max(len(tokenizer.decode([i], skip_special_tokens=False)) for i in range(tokenizer.vocab_size)))
