"""Query routing between two real deployments: a big router (the session pipeline's prefill/decode workers) sends
requests its rules and classifier judge simple to a small deployment's router (a colocated worker serving another name),
counts each route, and serves here whatever the small one cannot take."""

from __future__ import annotations

import json
import subprocess

import httpx
import openai
import pytest

from tests.worker.processes import MODEL, PDFLEET, authenticated, router, start_all, worker

SMALL = "tiny-small"
CLASSIFIER = "pdfleet_worker.router.classifiers:short_question"


@pytest.fixture(scope="module")
def pair(logdir, model_dir, token_file, pipeline):
    small_worker = worker(logdir, model_dir, "both", "--max-n", "1", name="small-worker")
    small_worker.args[small_worker.args.index("--served-model-name") + 1] = SMALL
    start_all(small_worker)
    small = router(logdir, "--workers", small_worker.url, name="small-router")
    start_all(small)
    big = authenticated(
        router(
            logdir,
            "--prefill",
            pipeline.prefill.url,
            "--decode",
            pipeline.decode.url,
            "--route-to",
            small.url,
            "--route-max-prompt-chars",
            "200",
            "--route-max-tokens",
            "16",
            "--route-exclude-pattern",
            r"(?i)\bpassword\b",
            "--route-classifier",
            CLASSIFIER,
            "--route-confidence-floor",
            "0.8",
            name="big-router",
        ),
        token_file,
    )
    try:
        start_all(big)
        yield big, small, small_worker
    finally:
        for p in (big, small, small_worker):
            p.stop()


def chat(url: str, content: str, max_tokens: int | None = 8, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def routed(router_url: str) -> dict[tuple[str, str], float]:
    out = {}
    for line in httpx.get(f"{router_url}/metrics").text.splitlines():
        if line.startswith("pdfleet_router_routed_requests_total{"):
            labels = dict(kv.split("=") for kv in line[line.index("{") + 1 : line.index("}")].split(","))
            out[(labels["route"].strip('"'), labels["reason"].strip('"'))] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.parametrize(
    "content, max_tokens, route, reason, model",
    [
        ("What is two plus two?", 8, "small", "classifier", SMALL),
        ("Please explain why the sky is blue and compare it with sunsets", 8, "default", "classifier_low", MODEL),
        ("What is my password?", 8, "default", "excluded", MODEL),
        ("What is two plus two?", 64, "default", "max_tokens", MODEL),
        ("What is two plus two?", None, "default", "no_max_tokens", MODEL),
        ("word " * 60, 8, "default", "prompt_chars", MODEL),
    ],
)
def test_each_request_goes_where_the_rules_say_and_is_counted(pair, content, max_tokens, route, reason, model):
    big, _, _ = pair
    before = routed(big.url).get((route, reason), 0)
    answer = chat(big.url, content, max_tokens)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-pdfleet-route"] == route
    assert answer.json()["model"] == model
    assert routed(big.url)[(route, reason)] == before + 1


def test_a_routed_stream_parses_with_the_openai_sdk(pair):
    big, _, _ = pair
    client = openai.OpenAI(base_url=f"{big.url}/v1", api_key="none", max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi!"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert {c.model for c in chunks} == {SMALL}
    assert chunks[-1].usage.completion_tokens == 4


def test_a_request_the_small_model_refuses_is_served_here(pair):
    big, small, _ = pair
    # n=2 is within the big deployment's limits, not the small worker's (--max-n 1): it answers 400
    before = routed(big.url).get(("default", "target_refused"), 0)
    answer = chat(big.url, "Hi", 4, n=2)
    assert answer.status_code == 200 and answer.json()["model"] == MODEL
    assert len(answer.json()["choices"]) == 2 and answer.headers["x-pdfleet-route"] == "default"
    assert routed(big.url)[("default", "target_refused")] == before + 1


def test_a_request_routed_once_is_not_routed_again(pair):
    big, _, _ = pair
    answer = httpx.post(
        f"{big.url}/v1/chat/completions",
        headers={"x-pdfleet-routed": "1"},
        timeout=60,
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    )
    assert answer.json()["model"] == MODEL
    assert routed(big.url)[("default", "already_routed")] >= 1


def test_a_target_that_is_down_sends_everything_to_the_big_model(logdir, pipeline, token_file):
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    r = authenticated(
        router(
            logdir,
            "--prefill",
            pipeline.prefill.url,
            "--decode",
            pipeline.decode.url,
            "--route-to",
            dead,
            "--route-max-tokens",
            "16",
            name="router-dead-target",
        ),
        token_file,
    )
    try:
        start_all(r)
        answer = chat(r.url, "Hi", 4)
        assert answer.status_code == 200 and answer.json()["model"] == MODEL
        assert routed(r.url)[("default", "target_unavailable")] == 1
    finally:
        r.stop()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--route-to", "http://x:1", "--route-pattern", "("], "is not a valid regular expression"),
        (["--route-to", "http://x:1"], "--route-to needs a rule"),
        (["--route-max-tokens", "4"], "need --route-to"),
        (["--route-to", "http://x:1", "--route-max-prompt-tokens", "4"], "--route-tokenizer"),
        (["--route-to", "http://x:1", "--route-classifier", "no_such_module:f"], "cannot import no_such_module"),
        (["--route-to", "http://x:1", "--route-max-tokens", "4", "--route-confidence-floor", "2"], "confidence-floor"),
    ],
)
def test_bad_routing_flags_are_refused_at_start(flags, message):
    out = subprocess.run(
        PDFLEET + ["router", "--workers", "http://127.0.0.1:1", *flags], capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_prompt_tokens_are_counted_with_the_model_tokenizer(logdir, model_dir, pipeline, token_file, pair):
    _, small, _ = pair
    r = authenticated(
        router(
            logdir,
            "--prefill",
            pipeline.prefill.url,
            "--decode",
            pipeline.decode.url,
            "--route-to",
            small.url,
            "--route-max-prompt-tokens",
            "20",
            "--route-tokenizer",
            model_dir,
            name="router-tokens",
        ),
        token_file,
    )
    try:
        start_all(r)
        assert chat(r.url, "hello", None).json()["model"] == SMALL
        assert chat(r.url, "hello " * 40, None).json()["model"] == MODEL
        assert {k: v for k, v in routed(r.url).items() if v} == {("small", "rules"): 1, ("default", "prompt_tokens"): 1}
        assert routed(r.url)[("default", "classifier_error")] == 0  # every series exists from the start
    finally:
        r.stop()


def test_the_ready_answer_names_the_model(pair):
    _, small, _ = pair
    assert json.loads(httpx.get(f"{small.url}/ready").text)["models"] == [SMALL]
