"""What vLLM's users send works through the router on pdfleet's worker (issue 27), through the openai SDK against real
router and worker processes (the prefill/decode tier and the colocated one): the exact bodies vLLM's benchmark client
sends, sampling parameters (checked against an engine in this process on the same weights), structured outputs (every
output parses and validates against its schema), echo/prompt logprobs (against transformers), tool calls (forced by
tool_choice and a grammar, as vLLM's required mode; the auto parser on a grammar-made answer; streamed as delta
tool_calls), and 400s naming what is still not supported."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.worker.processes import MODEL
from tests.worker.server.test_limits import assert_error

TIERS = {"pd": MODEL, "colo": "tiny-colo"}  # the router's default (prefill -> decode) tier and a colocated one


def client(pipeline) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{pipeline.router.url}/v1", api_key="unused", max_retries=0, timeout=120)


def sse_events(resp: httpx.Response) -> list[dict]:
    events = []
    for line in resp.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: ") :]))
    assert resp.text.rstrip().endswith("data: [DONE]"), resp.text[-300:]
    return events


@pytest.fixture(scope="module")
def engine(model_dir):
    """The same weights in this process: what the worker must answer, token for token."""
    from pdfleet_worker.config import EngineConfig
    from pdfleet_worker.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=128, num_threads=1))


# -- vLLM's benchmark client ------------------------------------------------------------------------
@pytest.mark.parametrize("tier", TIERS)
def test_the_bodies_vllm_bench_serve_sends_are_served(pipeline, tier):
    """Exactly what vllm/benchmarks/lib/endpoint_request_func.py (vLLM 0.32) posts for --backend openai and
    --backend openai-chat (with --ignore-eos, as its random dataset runs use)."""
    completion = {
        "model": TIERS[tier],
        "prompt": "The quick brown fox jumps over the lazy dog " * 3,
        "repetition_penalty": 1.0,
        "max_tokens": 12,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    chat = {
        "model": TIERS[tier],
        "messages": [{"role": "user", "content": "Tell me about foxes."}],
        "max_completion_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        resp = httpx.post(f"{pipeline.router.url}{path}", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        events = sse_events(resp)
        assert events[-1]["usage"]["completion_tokens"] == 12 and not events[-1]["choices"]
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert finish == ["length"]


# -- sampling parameters ----------------------------------------------------------------------------
def test_sampling_parameters_answer_what_the_engine_computes(pipeline, engine):
    from pdfleet_worker.sampling_params import SamplingParams

    prompt = [5, 77, 301, 12, 9, 640, 18, 255]
    cases = [
        (
            dict(temperature=0, frequency_penalty=1.5, presence_penalty=0.5, logit_bias={"40": 3.0}),
            dict(temperature=0, frequency_penalty=1.5, presence_penalty=0.5, logit_bias={40: 3.0}),
            {},
        ),
        (dict(temperature=0), dict(temperature=0, repetition_penalty=1.7), dict(repetition_penalty=1.7)),
        (
            dict(temperature=0.9, seed=11),
            dict(temperature=0.9, seed=11, top_k=40, min_p=0.02, top_p=0.95),
            dict(top_k=40, min_p=0.02, top_p=0.95),
        ),
    ]
    with client(pipeline) as c:
        for api_kw, engine_kw, extra in cases:
            want = engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True, **engine_kw))[0]
            for model in TIERS.values():
                got = c.completions.create(
                    model=model,
                    prompt=prompt,
                    max_tokens=10,
                    **api_kw,
                    extra_body=dict(ignore_eos=True, return_token_ids=True, **extra),
                )
                assert got.choices[0].model_extra["token_ids"] == want.new_token_ids, (api_kw, extra, model)


def test_logit_bias_min_tokens_and_stop_token_ids(pipeline):
    with client(pipeline) as c:
        for model in TIERS.values():
            forced = c.completions.create(
                model=model,
                prompt="Hello",
                max_tokens=6,
                temperature=0.8,
                seed=1,
                logit_bias={"100": 100},
                extra_body=dict(return_token_ids=True),
            )
            assert forced.choices[0].model_extra["token_ids"] == [100] * 6
            free = c.completions.create(
                model=model, prompt="Hello", max_tokens=6, temperature=0, extra_body=dict(return_token_ids=True)
            )
            first = free.choices[0].model_extra["token_ids"][0]
            stopped = c.completions.create(
                model=model,
                prompt="Hello",
                max_tokens=6,
                temperature=0,
                extra_body=dict(return_token_ids=True, stop_token_ids=[first]),
            )
            assert stopped.choices[0].model_extra["token_ids"] == [first]
            assert stopped.choices[0].finish_reason == "stop"
            held = c.completions.create(
                model=model,
                prompt="Hello",
                max_tokens=6,
                temperature=0,
                extra_body=dict(return_token_ids=True, stop_token_ids=[first], min_tokens=4),
            )
            tokens = held.choices[0].model_extra["token_ids"]
            assert len(tokens) >= 4 and first not in tokens[:4]


# -- structured outputs -----------------------------------------------------------------------------
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "days", "rain", "tags"],
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "rain": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
}


class Forecast(pydantic.BaseModel):
    """What the SDK's parse() turns into a strict json_schema (bounded: a random model fills any string it may)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    city: Literal["Paris", "Rome"]
    days: int = pydantic.Field(ge=1, le=14)
    note: str = pydantic.Field(max_length=8)
    rain: bool


def test_json_schema_outputs_parse_and_validate(pipeline):
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA, "strict": True}}
    with client(pipeline) as c:
        for model in TIERS.values():
            answer = c.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Weather?"}],
                response_format=fmt,
                max_tokens=120,
                n=3,
                temperature=1.0,
                seed=4,
            )
            for choice in answer.choices:
                assert choice.finish_reason == "stop", choice
                jsonschema.validate(json.loads(choice.message.content), SCHEMA)
            parsed = c.chat.completions.parse(
                model=model,
                messages=[{"role": "user", "content": "Weather?"}],
                response_format=Forecast,
                max_tokens=120,
                seed=5,
            )
            assert isinstance(parsed.choices[0].message.parsed, Forecast)
            with c.chat.completions.stream(
                model=model,
                messages=[{"role": "user", "content": "Weather?"}],
                response_format=Forecast,
                max_tokens=120,
                seed=6,
            ) as stream:
                final = stream.get_final_completion()
            assert isinstance(final.choices[0].message.parsed, Forecast)


def test_json_object_and_vllm_structured_fields(pipeline):
    from pdfleet_worker.model.tokenizer import Tokenizer

    tok = Tokenizer(pipeline_model_dir(pipeline))
    closing = {str(tok.encode(t, add_special_tokens=False)[0]): bias for t, bias in (('"', 6.0), ("}", 8.0))}
    with client(pipeline) as c:
        for model in TIERS.values():
            # NOTE: any JSON object may go on for ever, and random weights do not know when to close one: a bias
            # towards the tokens that close strings and objects ends them within the budget.
            answer = c.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "JSON please"}],
                response_format={"type": "json_object"},
                max_tokens=200,
                temperature=1.0,
                seed=3,
                n=2,
                logit_bias=closing,
            )
            for choice in answer.choices:
                assert choice.finish_reason == "stop"
                assert isinstance(json.loads(choice.message.content), dict)
            for extra, check in [
                (dict(structured_outputs={"json": SCHEMA}), lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
                (dict(guided_json=SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
                (dict(guided_choice=["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
                (
                    dict(structured_outputs={"regex": r"[0-9]{3}-[a-z]{2,4}"}),
                    lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t),
                ),
            ]:
                for stream in (False, True):
                    kw = dict(model=model, prompt="Answer:", max_tokens=120, temperature=1.0, seed=9, extra_body=extra)
                    if stream:
                        text = "".join(e.choices[0].text for e in c.completions.create(stream=True, **kw) if e.choices)
                    else:
                        text = c.completions.create(**kw).choices[0].text
                    assert check(text) is not False, (extra, text)


def test_structured_output_errors_name_the_field(pipeline):
    url = f"{pipeline.router.url}/v1/chat/completions"
    base = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    assert_error(
        httpx.post(
            url,
            json={
                **base,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
            },
            timeout=30,
        ),
        400,
        "response_format.json_schema",
    )
    assert_error(
        httpx.post(url, json={**base, "guided_regex": "[a-", "response_format": {"type": "json_object"}}, timeout=30),
        400,
        "guided_regex",
        "both constrain",
    )
    assert_error(
        httpx.post(url, json={**base, "structured_outputs": {"regex": "[a-"}}, timeout=30),
        400,
        "structured_outputs.regex",
    )
    assert_error(
        httpx.post(url, json={**base, "structured_outputs": {"grammar": "start: x", "choice": ["a"]}}, timeout=30),
        400,
        "structured_outputs",
    )


# -- prompt logprobs --------------------------------------------------------------------------------
def _hf_logprobs(model_dir: str, ids: list[int]):
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def test_echo_with_logprobs_scores_the_prompt_like_transformers(pipeline, model_dir):
    ids = [0, 812, 44, 1001, 7, 3000, 65, 9, 404, 2]
    ref = _hf_logprobs(model_dir, ids)
    with client(pipeline) as c:
        for model in TIERS.values():
            for max_tokens in (0, 3):
                got = c.completions.create(
                    model=model, prompt=ids, echo=True, logprobs=2, max_tokens=max_tokens, temperature=0
                )
                lp = got.choices[0].logprobs
                assert len(lp.token_logprobs) == len(ids) + max_tokens
                assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
                for p in range(1, len(ids)):
                    assert abs(lp.token_logprobs[p] - float(ref[p - 1, ids[p]])) < 1e-4
                    assert max(lp.top_logprobs[p].values()) == pytest.approx(float(ref[p - 1].max()), abs=1e-4)
                assert got.usage.completion_tokens == max_tokens and got.usage.prompt_tokens == len(ids)
                if max_tokens == 0:
                    assert got.choices[0].finish_reason == "length"
            vllm = c.completions.create(
                model=model, prompt=ids, max_tokens=1, temperature=0, extra_body=dict(prompt_logprobs=1)
            )
            entries = vllm.choices[0].model_extra["prompt_logprobs"]
            assert entries[0] is None and len(entries) == len(ids)
            for p in range(1, len(ids)):
                mine = entries[p][str(ids[p])]
                assert abs(mine["logprob"] - float(ref[p - 1, ids[p]])) < 1e-4
                assert mine["rank"] == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1


def test_streamed_echo_sends_the_prompt_first(pipeline):
    with client(pipeline) as c:
        events = list(
            c.completions.create(
                model="tiny-colo",
                prompt="Once upon a time",
                echo=True,
                logprobs=0,
                max_tokens=3,
                temperature=0,
                stream=True,
            )
        )
        text = "".join(e.choices[0].text for e in events if e.choices)
        whole = c.completions.create(
            model="tiny-colo", prompt="Once upon a time", echo=True, max_tokens=3, temperature=0
        )
        assert text == whole.choices[0].text and text.startswith("Once upon a time")
        first = events[0].choices[0].logprobs
        assert first.token_logprobs[0] is None and len(first.tokens) >= 4


# -- tool calls -------------------------------------------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city", "unit"],
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "unit": {"type": "string", "enum": ["C", "F"]},
            },
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["tz"],
            "properties": {"tz": {"type": "string", "maxLength": 5}},
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def test_the_sdk_tool_calling_flow_end_to_end(pipeline):
    """Named function forced, the call run here, its result sent back, the model answers in text."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    with client(pipeline) as c:
        for model in TIERS.values():
            first = c.chat.completions.create(
                model=model,
                messages=messages,
                tools=[WEATHER, TIME],
                max_tokens=60,
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
            )
            msg = first.choices[0].message
            assert msg.content is None and len(msg.tool_calls) == 1
            call = msg.tool_calls[0]
            assert call.type == "function" and call.function.name == "get_weather" and call.id
            args = json.loads(call.function.arguments)
            jsonschema.validate(args, SCHEMAS["get_weather"])
            result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21, **args})}
            second = c.chat.completions.create(
                model=model,
                messages=[*messages, msg.model_dump(exclude_none=True), result],
                tools=[WEATHER, TIME],
                tool_choice="none",
                max_tokens=8,
            )
            assert second.choices[0].message.tool_calls is None and second.choices[0].message.content


def test_required_tool_calls_streamed_as_delta_tool_calls(pipeline):
    with client(pipeline) as c:
        for model in TIERS.values():
            whole = c.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Do things"}],
                tools=[WEATHER, TIME],
                tool_choice="required",
                max_tokens=120,
                seed=2,
                temperature=1.0,
            )
            assert whole.choices[0].finish_reason == "tool_calls"
            for call in whole.choices[0].message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
            with c.chat.completions.stream(
                model=model,
                messages=[{"role": "user", "content": "Do things"}],
                tools=[WEATHER, TIME],
                tool_choice="required",
                max_tokens=120,
                seed=2,
                temperature=1.0,
                parallel_tool_calls=False,
            ) as stream:
                deltas = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
                final = stream.get_final_completion()
            calls = final.choices[0].message.tool_calls
            assert len(calls) == 1 and len(deltas) > 1, "arguments arrive in pieces"
            assert final.choices[0].finish_reason == "tool_calls"
            jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])


def test_auto_mode_renders_the_tools_and_parses_the_models_calls(pipeline):
    """A random model will not call a tool on its own: a regex makes it write the Qwen2.5 call its template
    teaches, and auto mode must turn that text into tool_calls (streamed too)."""
    call = (
        r'<tool_call>\n\{"name": "get_weather", '
        r'"arguments": \{"city": "(Paris|Rome)", "unit": "(C|F)"\}\}\n</tool_call>'
    )
    with client(pipeline) as c:
        for model in TIERS.values():
            kw = dict(
                model=model,
                messages=[{"role": "user", "content": "Weather?"}],
                tools=[WEATHER],
                max_tokens=60,
                extra_body=dict(structured_outputs={"regex": call}, return_token_ids=True),
            )
            answer = c.chat.completions.create(**kw)
            choice = answer.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), SCHEMAS["get_weather"])
            with c.chat.completions.stream(**kw) as stream:
                final = stream.get_final_completion()
            assert final.choices[0].message.tool_calls[0].function.name == "get_weather"
    prompt = httpx.post(
        f"{pipeline.colo.url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Weather?"}],
            "tools": [WEATHER],
            "max_tokens": 1,
            "return_token_ids": True,
        },
        timeout=60,
    ).json()["choices"][0]["prompt_token_ids"]
    from pdfleet_worker.model.tokenizer import Tokenizer

    text = Tokenizer(pipeline_model_dir(pipeline)).decode(prompt, skip_special_tokens=False)
    assert "<tools>" in text and '"name": "get_weather"' in text


def pipeline_model_dir(pipeline) -> str:
    args = pipeline.colo.args
    return args[args.index("--model") + 1]


def test_tool_errors_name_the_field(pipeline):
    url = f"{pipeline.router.url}/v1/chat/completions"
    base = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    assert_error(httpx.post(url, json={**base, "tool_choice": "required"}, timeout=30), 400, "tool_choice")
    assert_error(
        httpx.post(
            url,
            json={**base, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            timeout=30,
        ),
        400,
        "tool_choice",
    )
    assert_error(httpx.post(url, json={**base, "tools": [WEATHER, WEATHER]}, timeout=30), 400, "tools")
    bad_args = [
        {
            "role": "assistant",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "[1]"}}],
        }
    ]
    assert_error(
        httpx.post(url, json={**base, "messages": base["messages"] + bad_args}, timeout=30),
        400,
        "messages.1.tool_calls.0.function.arguments",
    )


# -- what is still refused --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field,value",
    [
        ("use_beam_search", True),
        ("length_penalty", 0.5),
        ("allowed_token_ids", [1, 2]),
        ("bad_words", ["x"]),
        ("skip_special_tokens", False),
        ("truncate_prompt_tokens", 5),
        ("suffix", "x"),
        ("guided_whitespace_pattern", " "),
    ],
)
def test_unsupported_vllm_fields_get_a_400_naming_them(pipeline, field, value):
    for url in (pipeline.router.url, pipeline.colo.url):
        err = assert_error(
            httpx.post(
                f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, field: value}, timeout=30
            ),
            400,
            field,
        )
        assert err["code"] == "unsupported_parameter"
