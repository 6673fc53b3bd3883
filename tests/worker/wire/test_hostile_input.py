"""Inputs that must get a 4xx OpenAI error, be counted, and cost nothing: hostile JSON, values that would
crash the engine, requests only a decode worker would refuse, unbounded prompt lists, clients that leave
non-streamed requests; OpenAI fields clients send (null as default, store/metadata/..., refusal, models by
id); and no worker address in anything the router returns."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from pdfleet_worker import metrics as m
from pdfleet_worker.router import proxy
from pdfleet_worker.router.app import build_app
from pdfleet_worker.router.router_config import RouterConfig, TierConfig
from pdfleet_worker.wire import errors, json_body, limits
from tests.worker.kv_transfer.test_kv_transfer import sample
from tests.worker.processes import AUTH, MODEL, pool_whole, wait_until, worker_urls
from tests.worker.server.test_limits import assert_error, leave_once_running

GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}

# Bodies JSON parsers take that no server should: each was a 500 on the router, the worker or both.
HOSTILE = {
    "NaN": b'{"model": "tiny", "prompt": "hi", "temperature": NaN}',
    "Infinity": b'{"model": "tiny", "prompt": "hi", "temperature": Infinity}',
    "-Infinity": b'{"model": "tiny", "prompt": "hi", "top_p": -Infinity}',
    "overflow to inf": b'{"model": "tiny", "prompt": "hi", "temperature": 1e400}',
    "lone surrogate in a message": b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
    "lone low surrogate in a prompt": b'{"model": "tiny", "prompt": "x\\uDC00"}',
    "lone surrogate in a key": b'{"model": "tiny", "prompt": "x", "\\ud83d": 1}',
    "surrogate bytes (not UTF-8)": b'{"model": "tiny", "prompt": "a\xed\xa0\x80"}',
    "latin-1 bytes": b'{"model": "tiny", "prompt": "caf\xe9"}',
    "nested 90,000 deep": b'{"model": "tiny", "prompt": "x", "metadata": ' + b"[" * 90_000 + b"]" * 90_000 + b"}",
    "nested 40 deep": b'{"model": "tiny", "prompt": "x", "logit_bias": ' + b'{"a": ' * 40 + b"1" + b"}" * 40 + b"}",
    "5,000-digit integer": b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
}
# Well-formed values that reached the engine and broke it (seed: the engine thread died, the worker with it).
ENGINE_BREAKERS = {
    "seed": {**GOOD, "seed": 2**80, "temperature": 1.0},
    "top_k": {**GOOD, "top_k": 2**80, "temperature": 1.0},
    "stop_token_ids": {**GOOD, "stop_token_ids": [2**80]},
    "prompt": {**GOOD, "prompt": [[2**64]]},
    "stop": {**GOOD, "stop": ["a"] * 10_000},
}


def post_raw(url: str, content: bytes, path: str = "/v1/completions", headers: dict | None = None) -> httpx.Response:
    return httpx.post(
        f"{url}{path}", content=content, headers={"content-type": "application/json", **(headers or {})}, timeout=30
    )


def codes(router_metrics: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in router_metrics.splitlines():
        if line.startswith(m.ROUTER_REQUESTS_TOTAL.name + "{"):
            labels, value = line.rsplit(" ", 1)
            code = labels.split('code="')[1].split('"')[0]
            out[code] = out.get(code, 0) + float(value)
    return out


def no_address(text: str, *procs) -> None:
    assert "127.0.0.1" not in text and "kv_transfer_params" not in text, text
    for proc in procs:
        assert f":{proc.port}" not in text, text


@pytest.mark.parametrize("target", ["router", "colo", "prefill"])
def test_hostile_json_is_a_400_everywhere(pipeline, target):
    proc = getattr(pipeline, target)
    for name, body in HOSTILE.items():
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        err = assert_error(post_raw(proc.url, body, path, proc.headers), 400)
        assert err["code"] == "invalid_json", (name, err)
        no_address(err["message"], *pipeline.workers)
    assert httpx.get(f"{proc.url}/health").status_code == 200


def test_hostile_json_through_the_router_is_counted_and_reaches_no_worker(pipeline):
    r = pipeline.router
    before, prefilled = codes(r.metrics_text()), sample(pipeline.prefill.metrics_text(), m.PROMPT_TOKENS_TOTAL.name)
    for body in HOSTILE.values():
        post_raw(r.url, body)
    # The router counts an answer once it is sent: the last one may still be on its way to the counter.
    wait_until(
        lambda: codes(r.metrics_text()).get("400", 0) - before.get("400", 0) >= len(HOSTILE),
        timeout=5,
        what="the router counting every 400",
    )
    after = codes(r.metrics_text())
    assert after.get("400", 0) - before.get("400", 0) == len(HOSTILE)
    assert {k: v for k, v in after.items() if k != "400"} == {k: v for k, v in before.items() if k != "400"}
    assert sample(pipeline.prefill.metrics_text(), m.PROMPT_TOKENS_TOTAL.name) == prefilled


@pytest.mark.parametrize("target", ["router", "colo"])
def test_values_that_broke_the_engine_are_refused_and_it_keeps_serving(pipeline, target):
    url = getattr(pipeline, target).url
    for field, body in ENGINE_BREAKERS.items():
        err = assert_error(httpx.post(f"{url}/v1/completions", json=body, timeout=30), 400)
        assert err["param"].split(".")[0] == field, err
    assert_error(httpx.post(f"{url}/v1/completions", json={**GOOD, "stop": "x" * 300}, timeout=30), 400, "stop")
    ok = httpx.post(f"{url}/v1/completions", json={**GOOD, "seed": 2**63 - 1, "n": 2, "temperature": 1.0}, timeout=30)
    assert ok.status_code == 200, ok.text
    for w in pipeline.workers:
        assert httpx.get(f"{w.url}/health").status_code == 200, w.name


def test_what_only_the_decode_worker_refused_costs_no_prefill(pipeline):
    """Validated once, before any work: by the router (no tokenizer needed) or by the prefill worker,
    which gets the client's whole request and checks it exactly as the decode worker would."""
    r, pre = pipeline.router, pipeline.prefill
    long_text = " ".join(["hello"] * 500)  # ~1,500 tokens: fits alone, not with 1,000 more
    refused = [
        ({**GOOD, "max_tokens": 100_000}, "max_tokens"),
        ({**GOOD, "prompt": long_text, "max_tokens": 1000}, "max_tokens"),
        ({**GOOD, "prompt": [[5] * 1500], "max_tokens": 1000}, "max_tokens"),
        ({**GOOD, "n": 17}, "n"),
        ({**GOOD, "stream_options": {"include_usage": True}}, "stream_options"),
        ({**GOOD, "logprobs": 21}, "logprobs"),
        ({**GOOD, "prompt": [[5]] * 65}, "prompt"),
        ({**CHAT, "max_completion_tokens": 5000}, "max_tokens"),
        ({**CHAT, "top_logprobs": 3}, "top_logprobs"),
    ]
    prefilled = sample(pre.metrics_text(), m.PROMPT_TOKENS_TOTAL.name)
    for body, param in refused:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        assert_error(httpx.post(f"{r.url}{path}", json=body, timeout=30), 400, param)
    assert sample(pre.metrics_text(), m.PROMPT_TOKENS_TOTAL.name) == prefilled, "a refused request ran a prefill"
    assert pre.load()["leases"] == 0
    ok = httpx.post(f"{r.url}/v1/completions", json={**GOOD, "prompt": long_text, "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200, ok.text
    assert sample(pre.metrics_text(), m.PROMPT_TOKENS_TOTAL.name) > prefilled


def test_text_no_context_could_hold_is_refused_before_tokenizing(pipeline):
    """3.5 MB of text took the worker ~3 s of tokenizing (on its event loop) before the context check. The
    refusal that did not tokenize says so: it counts the prompt's characters (a tokenized prompt's refusal
    counts its tokens); the time each took is printed, not judged."""
    import time

    huge = "hello world " * 300_000
    prefilled = sample(pipeline.prefill.metrics_text(), m.PROMPT_TOKENS_TOTAL.name)
    for url in (pipeline.router.url, pipeline.prefill.url):
        for path, body in (
            ("/v1/completions", {**GOOD, "prompt": huge}),
            ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": huge}]}),
        ):
            t0 = time.monotonic()
            err = assert_error(httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=60), 400)
            print(f"{url}{path}: {len(huge):,} characters refused in {time.monotonic() - t0:.3f} s")
            assert err["code"] == "context_length_exceeded", err
            assert f"a prompt of {len(huge)} characters cannot fit" in err["message"], err
    assert sample(pipeline.prefill.metrics_text(), m.PROMPT_TOKENS_TOTAL.name) == prefilled
    # ... and text that could fit is tokenized before the same check: its refusal counts tokens.
    fits_chars = " ".join(["hello"] * 3000)
    err = assert_error(
        httpx.post(
            f"{pipeline.prefill.url}/v1/completions", json={**GOOD, "prompt": fits_chars}, headers=AUTH, timeout=60
        ),
        400,
    )
    assert err["code"] == "context_length_exceeded" and "but the prompt has" in err["message"], err


def test_prompt_lists_are_bounded_by_max_prompts(pipeline):
    assert pipeline.colo.load()["limits"]["max_prompts"] == limits.DEFAULT_MAX_PROMPTS
    for url in (pipeline.router.url, pipeline.colo.url, pipeline.prefill.url):
        for count in (limits.DEFAULT_MAX_PROMPTS + 1, 5000):
            err = assert_error(
                httpx.post(f"{url}/v1/completions", json={**GOOD, "prompt": ["hi"] * count}, headers=AUTH, timeout=30),
                400,
                "prompt",
                f"at most {limits.DEFAULT_MAX_PROMPTS}",
            )
            assert err["code"] == "too_many_prompts"
    full = httpx.post(
        f"{pipeline.router.url}/v1/completions",
        json={**GOOD, "prompt": [[5, 6]] * limits.DEFAULT_MAX_PROMPTS, "max_tokens": 1},
        timeout=60,
    )
    assert full.status_code == 200 and len(full.json()["choices"]) == limits.DEFAULT_MAX_PROMPTS


def test_max_prompts_flag(model_dir):
    import argparse

    from pdfleet_worker.server import worker_config

    parser = argparse.ArgumentParser()
    worker_config.add_arguments(parser)
    cfg = worker_config.from_args(
        parser.parse_args(
            [
                "--model",
                model_dir,
                "--num-kv-blocks",
                "8",
                "--device",
                "cpu",
                "--max-prompts",
                "3",
                "--max-logprobs",
                "2",
            ]
        )
    )
    assert (cfg.max_prompts, cfg.max_logprobs) == (3, 2)
    with pytest.raises(ValueError, match="max_prompts"):
        worker_config.WorkerConfig(engine=cfg.engine, served_model_name="x", max_prompts=0)


@pytest.mark.parametrize("tier", ["default", "colo"])
def test_a_client_leaving_a_non_streamed_request_aborts_it(pipeline, tier):
    worker = pipeline.decode if tier == "default" else pipeline.colo
    r = pipeline.router
    aborted = sample(worker.metrics_text(), m.REQUEST_SUCCESS_TOTAL.name, finished_reason="abort")
    left = codes(r.metrics_text()).get("499", 0)
    body = {**GOOD, "prompt": "a long story", "max_tokens": 1900, "ignore_eos": True}
    # The client leaves once the worker generates its answer (the router holds the non-streamed request).
    leave_once_running(r.url, body, lambda: worker.load()["running"] == 1, headers={"x-pdfleet-tier": tier})
    wait_until(
        lambda: sample(worker.metrics_text(), m.REQUEST_SUCCESS_TOTAL.name, finished_reason="abort") == aborted + 1,
        timeout=10,
        what="the worker aborting the abandoned request",
    )
    wait_until(lambda: pool_whole(worker) and pool_whole(pipeline.prefill), timeout=10, what="pools whole")
    wait_until(lambda: codes(r.metrics_text()).get("499", 0) == left + 1, timeout=5, what="the router counting 499")


def test_null_means_the_default(pipeline):
    for url in (pipeline.router.url, pipeline.colo.url):
        nulls = {
            "stream": None,
            "n": None,
            "logprobs": None,
            "echo": None,
            "ignore_eos": None,
            "stop": None,
            "temperature": None,
            "top_p": None,
            "seed": None,
            "user": None,
            "stream_options": None,
        }
        resp = httpx.post(f"{url}/v1/completions", json={**GOOD, **nulls}, timeout=30)
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["choices"]) == 1 and resp.json()["choices"][0]["logprobs"] is None
        chat_nulls = {
            "stream": None,
            "n": None,
            "logprobs": None,
            "top_logprobs": None,
            "max_tokens": None,
            "max_completion_tokens": 2,
            "tools": None,
            "tool_choice": None,
            "response_format": None,
        }
        resp = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, **chat_nulls}, timeout=30)
        assert resp.status_code == 200, resp.text
        assert_error(httpx.post(f"{url}/v1/completions", json={**GOOD, "model": None}, timeout=30), 400, "model")


def test_fields_clients_commonly_send(pipeline):
    harmless = {
        "store": False,
        "metadata": {"team": "search", "run": "7"},
        "service_tier": "auto",
        "user": "u-1",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
    }
    refused = {
        "reasoning_effort": "low",
        "audio": {"voice": "x"},
        "modalities": ["text", "audio"],
        "prediction": {"type": "content"},
        "functions": [{"name": "f"}],
        "web_search_options": {},
    }
    for url in (pipeline.router.url, pipeline.colo.url):
        chat = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                **CHAT,
                **harmless,
                "parallel_tool_calls": True,
                "stream": True,
                "stream_options": {"include_usage": True, "include_obfuscation": False},
            },
            timeout=30,
        )
        assert chat.status_code == 200, chat.text
        done = httpx.post(f"{url}/v1/completions", json={**GOOD, **harmless, "store": None}, timeout=30)
        assert done.status_code == 200, done.text
        top_p_0 = httpx.post(f"{url}/v1/completions", json={**GOOD, "top_p": 0, "temperature": 1.5}, timeout=30)
        greedy = httpx.post(f"{url}/v1/completions", json=GOOD, timeout=30)
        assert top_p_0.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"], "top_p 0: the top token"
        for name, value in refused.items():
            err = assert_error(
                httpx.post(f"{url}/v1/chat/completions", json={**CHAT, name: value}, timeout=30),
                400,
                name,
                "not supported",
            )
            assert err["code"] == "unsupported_parameter"
        assert_error(httpx.post(f"{url}/v1/completions", json={**GOOD, "suffix": "x"}, timeout=30), 400, "suffix")
        too_many = {f"k{i}": "v" for i in range(17)}
        assert_error(
            httpx.post(f"{url}/v1/completions", json={**GOOD, "metadata": too_many}, timeout=30), 400, "metadata"
        )
        assert_error(
            httpx.post(f"{url}/v1/completions", json={**GOOD, "service_tier": "gold"}, timeout=30), 400, "service_tier"
        )
        assert_error(
            httpx.post(f"{url}/v1/completions", json={**GOOD, "frobnicate": 1}, timeout=30),
            400,
            "frobnicate",
            "Unrecognized",
        )


def test_chat_messages_carry_refusal_and_sdk_round_trips_them(pipeline):
    with openai.OpenAI(base_url=f"{pipeline.router.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        messages = [{"role": "user", "content": "Hi"}]
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=2)
        assert raw.http_response.json()["choices"][0]["message"]["refusal"] is None
        answer = raw.parse().choices[0].message
        # The SDK's own message object goes back in as the next turn (refusal, annotations, tool_calls: null).
        again = client.chat.completions.create(
            model=MODEL, messages=[*messages, answer.model_dump(), {"role": "user", "content": "More"}], max_tokens=2
        )
        assert again.choices[0].message.refusal is None
        first = next(iter(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True)))
        assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.refusal is None


def test_models_list_has_created_and_each_model_can_be_fetched(pipeline):
    for proc, names in ((pipeline.router, [MODEL, "tiny-colo"]), (pipeline.colo, [MODEL])):
        listed = httpx.get(f"{proc.url}/v1/models").json()["data"]
        assert [c["id"] for c in listed] == names
        for card in listed:
            assert card["object"] == "model" and isinstance(card["created"], int) and card["owned_by"] == "pdfleet"
            one = httpx.get(f"{proc.url}/v1/models/{card['id']}")
            assert one.status_code == 200 and one.json() == card
        err = assert_error(httpx.get(f"{proc.url}/v1/models/gpt-5"), 404, "model", "does not exist")
        assert err["code"] == "model_not_found"
    with openai.OpenAI(base_url=f"{pipeline.router.url}/v1", api_key="unused", max_retries=0) as client:
        assert client.models.retrieve(MODEL).id == MODEL
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("org/no-such-model")


def test_router_headers_and_errors_name_no_worker_address(pipeline):
    r = pipeline.router
    ids = worker_urls(r)
    resp = httpx.post(f"{r.url}/v1/completions", json=GOOD, timeout=30)
    assert ids[resp.headers["x-pdfleet-prefill"]] == pipeline.prefill.url
    assert ids[resp.headers["x-pdfleet-decode"]] == pipeline.decode.url
    colo = httpx.post(f"{r.url}/v1/completions", json=GOOD, headers={"x-pdfleet-tier": "colo"}, timeout=30)
    assert ids[colo.headers["x-pdfleet-worker"]] == pipeline.colo.url
    with httpx.stream("POST", f"{r.url}/v1/completions", json={**GOOD, "stream": True}, timeout=30) as streamed:
        streamed.read()
    for answer in (resp, colo, streamed):
        no_address(json.dumps(dict(answer.headers)), *pipeline.workers)
    # A worker's own error (its message has room for anything) comes back without addresses too.
    refused = httpx.post(f"{r.url}/v1/completions", json={**GOOD, "prompt": [[99999]]}, timeout=30)
    assert_error(refused, 400, "prompt", "token ids outside")
    no_address(refused.text + json.dumps(dict(refused.headers)), *pipeline.workers)


def test_redact_removes_addresses_and_keeps_the_rest():
    known = ["http://prefill-0.pool.svc:8000", "kv.internal"]
    text = (
        "KV transfer from the prefill worker failed (connect): connecting to 10.1.2.3:9000 refused; "
        "http://prefill-0.pool.svc:8000/v1 and prefill-0.pool.svc, kv.internal, [fd00::5]:8000, fd00::5, "
        "https://x.example/y; prompt 3 has 12 tokens"
    )
    out = proxy.redact(text, known)
    for leak in ("10.1.2.3", "9000", "prefill-0", "kv.internal", "fd00", "x.example"):
        assert leak not in out, (leak, out)
    assert out.startswith("KV transfer from the prefill worker failed (connect): connecting to <worker> refused")
    assert out.endswith("prompt 3 has 12 tokens")

    from types import SimpleNamespace

    cfg = RouterConfig(
        tiers={"default": TierConfig("default", workers=["http://10.0.0.9:8000"])}, default_tier="default"
    )
    up = SimpleNamespace(url="http://10.0.0.9:8000", role="decode")
    router = proxy.Router(cfg, SimpleNamespace(all={("default", "both", up.url): up}), None, None)
    raw = json.dumps(
        {
            "error": {
                "message": "KV pull from kv-0.internal:9100 broke (worker http://10.0.0.9:8000)",
                "type": "kv_transfer_error",
                "param": None,
                "code": "peer_closed",
                "debug": {"kv_transfer_params": {"remote_host": "10.0.0.7"}},
            }
        }
    ).encode()
    assert router.relayed_error(raw, up, 502, ["kv-0.internal"]) == {
        "error": {
            "message": "KV pull from <worker>:9100 broke (worker <worker>)",
            "type": "kv_transfer_error",
            "param": None,
            "code": "peer_closed",
        }
    }
    assert (
        router.relayed_error(b"<html>10.0.0.9</html>", up, 502)["error"]["message"] == "the decode worker answered 502"
    )


def test_router_counts_every_answer_including_its_own_bugs(monkeypatch):
    """In-process router (its one worker is unreachable): a bug in the proxy, unknown paths and methods,
    /v1/models and the router's own 503 are all counted with their codes; probes and scrapes are not."""
    cfg = RouterConfig(
        tiers={"default": TierConfig("default", workers=["http://127.0.0.1:9"])},
        default_tier="default",
        discovery="static",
        health_interval_s=60,
        discovery_interval_s=60,
    )

    def bug(self, *args, **kwargs):
        raise RuntimeError("boom at http://10.9.8.7:8000 with kv_transfer_params={'remote_host': '10.9.8.7'}")

    with TestClient(build_app(cfg), raise_server_exceptions=False) as client:
        answers = [
            client.post("/v1/completions", json=GOOD),  # 503: no worker
            client.post("/v1/completions", content=b'{"prompt": NaN}'),  # 400
            client.get("/v1/completions"),  # 405
            client.get("/v1/nothing"),  # 404
            client.get("/v1/models"),  # 200
            client.get("/v1/models/none"),
        ]  # 404
        monkeypatch.setattr(proxy.Router, "_tier", bug)
        crashed = client.post("/v1/completions", json=GOOD)
        answers.append(crashed)
        for probe in ("/health", "/ready", "/metrics", "/workers"):
            client.get(probe)
        counted = codes(client.get("/metrics").text)
    assert crashed.status_code == 500 and crashed.json()["error"]["type"] == "server_error"
    assert "10.9.8.7" not in crashed.text and "boom" not in crashed.text
    want: dict[str, float] = {}
    for a in answers:
        want[str(a.status_code)] = want.get(str(a.status_code), 0) + 1
    assert {k: v for k, v in counted.items() if v} == want, (counted, want)
    assert [a.status_code for a in answers] == [503, 400, 405, 404, 200, 404, 500]


def test_decoder_limits_unit():
    with pytest.raises(errors.RequestError, match="deeper than"):
        json_body.decode_json(b"[" * (json_body.MAX_JSON_DEPTH + 1) + b"]" * (json_body.MAX_JSON_DEPTH + 1))
    assert json_body.decode_json(b"[" * json_body.MAX_JSON_DEPTH + b"]" * json_body.MAX_JSON_DEPTH) is not None
    assert json_body.decode_json(b'{"a": "\\ud83d\\ude00", "b": [1e308, -0.0]}') == {
        "a": "\U0001f600",
        "b": [1e308, -0.0],
    }
    assert json_body.decode_json('{"a": "café ☕"}'.encode()) == {"a": "café ☕"}
