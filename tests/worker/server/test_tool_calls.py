"""Tool calls without processes (issue 27): the chat templates render tools and earlier calls in Qwen2.5's and Llama
3.1's formats and say which they use; the two parsers read the calls those formats write (and leave anything else as
content); the streamer's delta tool_calls add up to the parsed calls whatever the chunking; forced modes ask for the
grammars vLLM's do."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdfleet_worker.model import chat_templates as ct
from pdfleet_worker.model.tokenizer import Tokenizer
from pdfleet_worker.server import tool_calls as tc
from pdfleet_worker.wire import request_types as rq
from pdfleet_worker.wire.errors import RequestError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
]


def _tokenizer(tmp_path, template: str) -> Tokenizer:
    (tmp_path / "tokenizer.json").write_text(
        json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": {"[UNK]": 0}, "unk_token": "[UNK]"}})
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>"}))
    return Tokenizer(str(tmp_path))


@pytest.mark.parametrize(
    "template,fmt,call_text",
    [
        (
            ct.CHATML_TOOLS,
            ct.HERMES,
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        ),
        (ct.LLAMA31_TOOLS, ct.LLAMA3_JSON, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ],
)
def test_templates_render_tools_and_calls_in_their_format(tmp_path, template, fmt, call_text):
    assert ct.tool_format(template) == fmt
    text = _tokenizer(tmp_path, template).apply_chat_template(HISTORY, tools=[WEATHER])
    assert json.dumps(WEATHER, ensure_ascii=False) in text, "tools reach the prompt as plain JSON"
    assert call_text in text and "sunny, 21 C" in text and "Be brief." in text
    plain = _tokenizer(tmp_path, template).apply_chat_template(HISTORY[1:2])
    assert "get_weather" not in plain


def test_without_tools_chatml_renders_as_before(tmp_path):
    text = _tokenizer(tmp_path, ct.CHATML_TOOLS).apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    )
    assert (
        text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert ct.tool_format("{{ messages }}") is None


AUTO_CASES = [
    (
        ct.HERMES,
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
        "Let me look.",
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})],
    ),
    (ct.HERMES, "No call here, only <tool talk>.", "No call here, only <tool talk>.", []),
    (ct.HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', None, None),  # cut short: content
    (
        ct.LLAMA3_JSON,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    (
        ct.LLAMA3_JSON,
        '{"name": "a", "parameters": {"x": "}{"}}; {"name": "b", "parameters": {}}',
        None,
        [("a", {"x": "}{"}), ("b", {})],
    ),
    (ct.LLAMA3_JSON, "Paris is sunny {really}.", "Paris is sunny {really}.", []),
]


@pytest.mark.parametrize("parser,text,content,calls", AUTO_CASES)
def test_auto_parsers_and_streamer_agree(parser, text, content, calls):
    plan = tc.ToolPlan(tc.AUTO, [WEATHER], parser=parser)
    got_content, got_calls = tc.parse(plan, text)
    if calls is None:  # an unfinished call is no call
        assert got_calls == [] and got_content == text
        return
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    for step in (1, 2, 5, 17, len(text)):
        streamed_content, streamed = _stream(plan, text, step)
        assert [(n, json.loads(a)) for n, a in streamed] == calls
        if content is not None:
            assert streamed_content.strip() == content


def _stream(plan: tc.ToolPlan, text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    s = tc.ToolCallStreamer(plan)
    pieces = []
    for i in range(0, len(text), step):
        pieces += s.feed(text[i : i + step])
    pieces += s.feed("", final=True)
    content, calls = "", {}
    for piece in pieces:
        content += piece.get("content", "")
        for call in piece.get("tool_calls", ()):
            if "id" in call:
                assert call["index"] not in calls and call["type"] == "function" and call["id"].startswith("call_")
                calls[call["index"]] = [call["function"]["name"], ""]
            calls[call["index"]][1] += call["function"]["arguments"]
    return content, [tuple(calls[k]) for k in sorted(calls)]


def _request(**kw) -> rq.ChatCompletionRequest:
    return rq.parse(rq.ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], **kw})


def test_forced_modes_ask_for_vllms_grammars():
    time_fn = {"type": "function", "function": {"name": "get_time"}}
    named = tc.plan(
        _request(tools=[WEATHER, time_fn], tool_choice={"type": "function", "function": {"name": "get_weather"}}), None
    )
    assert named.mode == tc.NAMED and json.loads(named.structured.spec) == WEATHER["function"]["parameters"]
    required = tc.plan(_request(tools=[WEATHER, time_fn], tool_choice="required", parallel_tool_calls=False), None)
    schema = json.loads(required.structured.spec)
    good = [{"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "nope", "parameters": {}}], good * 2, [{"name": "get_weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert tc.parse(required, json.dumps(good))[1] == [tc.Call("get_time", "{}")]
    assert tc.plan(_request(tools=[WEATHER], tool_choice="none"), None).mode == tc.NONE


def test_auto_needs_a_template_that_takes_tools():
    with pytest.raises(RequestError) as e:
        tc.plan(_request(tools=[WEATHER]), "{{ messages }}")
    assert e.value.param == "tool_choice"
    assert tc.plan(_request(tools=[WEATHER]), ct.LLAMA31_TOOLS).parser == ct.LLAMA3_JSON
