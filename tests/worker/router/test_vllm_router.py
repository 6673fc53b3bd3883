"""pdfleet's router in front of a real vLLM CPU server (`make vllm`): health, models and load from vLLM's own endpoints,
and completions, chat and streaming with usage through the router with the `openai` SDK equal to what vLLM answers
directly."""

from __future__ import annotations

import httpx
import pytest

from pdfleet_worker.router import engines, workers_file
from tests.support.vllm import VllmServer
from tests.worker.processes import MODEL, Proc, router, start_all, wait_until

openai = pytest.importorskip("openai")

PROMPTS = ["The quick brown fox", "Once upon a time", "1 2 3 4 5", "hello world"]
MESSAGES = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three"}],
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def vllm(model_dir, logdir):
    server = VllmServer(model_dir, logdir, MODEL).start()
    print(f"vLLM healthy {server.startup_s:.1f}s after start")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def vllm_router(vllm, logdir):
    r = router(logdir, "--workers", f"vllm@{vllm.url}", name="router-vllm")
    start_all(r)
    try:
        yield r
    finally:
        r.stop()


def client(url: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_router_probes_vllm_with_its_own_endpoints(vllm, vllm_router):
    assert [m.id for m in client(vllm_router.url).models.list().data] == [MODEL]
    (w,) = httpx.get(f"{vllm_router.url}/workers", timeout=5).json()["workers"]
    assert (w["engine"], w["healthy"], w["url"], w["role"]) == ("vllm", True, vllm.url, "both")
    # The picker's load comes from vLLM's /metrics: idle, every key present.
    assert {k: w["load"][k] for k in ("model", "models", "waiting", "running", "kv_usage")} == {
        "model": MODEL,
        "models": [MODEL],
        "waiting": 0,
        "running": 0,
        "kv_usage": 0.0,
    }


def test_greedy_completions_and_chat_equal_vllm_direct(vllm, vllm_router):
    direct, routed = client(vllm.url), client(vllm_router.url)
    for prompt in PROMPTS:
        want = direct.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        got = routed.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert (got.choices[0].text, got.choices[0].finish_reason) == (
            want.choices[0].text,
            want.choices[0].finish_reason,
        )
        assert got.usage == want.usage and got.usage.completion_tokens == MAX_TOKENS
    for messages in MESSAGES:
        want = direct.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        got = routed.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.choices[0].message.role == "assistant" and got.usage == want.usage


def test_streaming_with_usage_through_the_router(vllm, vllm_router):
    direct, routed = client(vllm.url), client(vllm_router.url)
    prompt = PROMPTS[0]
    want = direct.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(
        routed.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.choices[0].text
    assert [c.usage for c in chunks if c.usage] == [want.usage], "exactly one usage chunk, the last"
    assert chunks[-1].usage is not None and not chunks[-1].choices

    messages = MESSAGES[1]
    want = direct.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(
        routed.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.choices[0].message.content
    assert [c.usage for c in chunks if c.usage] == [want.usage]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [want.choices[0].finish_reason]


def test_engine_flag_and_workers_file_name_vllm_workers(vllm, logdir, tmp_path):
    """What `pdfleet up` and the operator render: a workers file whose bare URLs take the router's --engine,
    and the plain `--workers URL` a new user tries first (pdfleet's /load probe: out of rotation, 503)."""
    path = tmp_path / "workers.json"
    workers_file.write(path, {"workers": [vllm.url]})
    by_file = router(logdir, "--workers-file", str(path), "--engine", engines.VLLM, name="router-vllm-file")
    plain = router(logdir, "--workers", vllm.url, name="router-plain")
    by_file.start(), plain.start()
    try:
        start_all(by_file)
        got = client(by_file.url).completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0)
        assert got.usage.completion_tokens == 4
        wait_until(lambda: _workers(plain), timeout=30, what="the plain router's first probe")
        (w,) = _workers(plain)
        assert (w["engine"], w["healthy"]) == ("pdfleet", False)
        assert "not ready" in w["last_error"], w
        r = httpx.post(
            f"{plain.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4}, timeout=10
        )
        assert r.status_code == 503 and "no healthy both worker" in r.text
    finally:
        for p in (by_file, plain):
            assert p.stop() == 0, p.log()


def _workers(r: Proc) -> list[dict]:
    """The router's workers once each has been probed (healthy, or out of rotation with a reason)."""
    try:
        listed = httpx.get(f"{r.url}/workers", timeout=2).json()["workers"]
    except httpx.HTTPError:
        return []
    return listed if listed and all(w["healthy"] or w["last_error"] for w in listed) else []
