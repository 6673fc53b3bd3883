"""Issue 24, rule 9: either role serves whole requests while the other is away. The only decode worker killed under four
streaming clients: each stream in flight ends with an error event (never a hang), and every request after it is served
whole by the prefill worker (counted), with the tokens a colocated worker gives, until the decode worker is back. A
decode worker that hangs (SIGSTOP) ends its streams after three missed heartbeats. Real processes."""

from __future__ import annotations

import concurrent.futures
import signal

import httpx
import openai
import pytest

from pdfleet_worker import metrics as m
from tests.worker.kv_transfer.test_kv_transfer import fresh_prompt, sample
from tests.worker.processes import MODEL, router, start_all, wait_until, worker, worker_urls


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=60)


def stream_until_cut(url: str, prompt: list[int], chunks: list) -> BaseException | None:
    """Stream a long answer; returns the error that ended it (None if it finished)."""
    try:
        for chunk in client(url).completions.create(
            model=MODEL, prompt=prompt, max_tokens=1900, temperature=0, stream=True, extra_body={"ignore_eos": True}
        ):
            chunks.append(chunk)
    except openai.APIError as e:
        return e
    return None


def answer(url: str, prompt: list[int], stream: bool) -> tuple[dict, str]:
    """(headers, text) of a greedy 8-token answer."""
    raw = client(url).completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=stream, extra_body={"ignore_eos": True}
    )
    parsed = raw.parse()
    text = "".join(c.choices[0].text for c in parsed if c.choices) if stream else parsed.choices[0].text
    return dict(raw.headers), text


@pytest.fixture
def pd(logdir, model_dir):
    p = worker(logdir, model_dir, "prefill", "--kv-lease", "3s", name="either-prefill")
    d = worker(logdir, model_dir, "decode", "--heartbeat-interval", "0.5s", name="either-decode")
    start_all(p, d)
    r = router(logdir, "--prefill", p.url, "--decode", d.url, name="either-router")
    procs = [p, d, r]
    try:
        start_all(r)
        yield {"prefill": p, "decode": d, "router": r, "procs": procs}
    finally:
        for proc in procs:
            proc.stop()


def test_the_only_decode_worker_killed_under_four_streams(pd, pipeline, logdir, model_dir):
    p, d, r = pd["prefill"], pd["decode"], pd["router"]
    chunks: list[list] = [[] for _ in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream_until_cut, r.url, fresh_prompt(16, seed=110 + i), chunks[i]) for i in range(4)]
        wait_until(lambda: all(len(c) >= 3 for c in chunks), timeout=60, what="four streams decoding")
        d.kill()
        errors = [f.result(timeout=90) for f in streams]
    for i, e in enumerate(errors):
        assert isinstance(e, openai.APIError) and "failed mid-stream" in str(e), (i, e)
        assert 3 <= len(chunks[i]) < 1900
    # The router stays ready (the prefill worker serves alone), and every request is served whole there
    assert httpx.get(f"{r.url}/ready", timeout=5).status_code == 200
    for i in range(6):
        prompt = fresh_prompt(20, seed=120 + i)
        headers, text = answer(r.url, prompt, stream=i % 2 == 1)
        assert headers["x-pdfleet-decode"] == "local", headers
        assert worker_urls(r)[headers["x-pdfleet-prefill"]] == p.url
        assert text == answer(pipeline.colo.url, prompt, stream=False)[1], (
            "the prefill worker's own decode, same tokens"
        )
    text = r.metrics_text()
    assert sample(text, m.ROUTER_PD_FALLBACKS_TOTAL.name, tier="default", reason="no_decode") == 6
    wait_until(
        lambda: sample(r.metrics_text(), m.ROUTER_REQUESTS_TOTAL.name, code="200", tier="default") == 6,
        timeout=5,
        what="the 6 answers counted",
    )
    assert sample(text, m.ROUTER_REQUESTS_TOTAL.name, code="503", tier="default") == 0
    assert sample(r.metrics_text(), m.ROUTER_REQUESTS_TOTAL.name, code="502", tier="default") == 4  # the cut streams
    # The decode worker back on its port: PD again
    back = worker(logdir, model_dir, "decode", name="either-decode-back", port=d.port)
    pd["procs"].append(back)
    start_all(back)
    wait_until(
        lambda: any(w["url"] == back.url and w["healthy"] for w in httpx.get(f"{r.url}/workers").json()["workers"]),
        timeout=30,
        what="the decode worker back in rotation",
    )
    headers, text = answer(r.url, fresh_prompt(20, seed=130), stream=True)
    assert headers["x-pdfleet-decode"] != "local" and headers["x-pdfleet-prefill"] != "local"


def test_a_hung_decode_worker_ends_its_streams_with_an_error_event(pd):
    d, r = pd["decode"], pd["router"]
    chunks: list = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(stream_until_cut, r.url, fresh_prompt(16, seed=140), chunks)
        wait_until(lambda: len(chunks) >= 3, timeout=60, what="the stream decoding")
        d.signal(signal.SIGSTOP)  # alive, silent: no FIN reaches the router
        try:
            error = fut.result(timeout=90)
        finally:
            d.signal(signal.SIGCONT)
    # three missed heartbeats (0.5 s each), not the router's 600 s upstream timeout
    assert isinstance(error, openai.APIError) and "failed mid-stream (ReadTimeout)" in str(error), error
    assert sample(r.metrics_text(), m.ROUTER_UPSTREAM_ERRORS_TOTAL.name, upstream_role="decode", reason="timeout") == 1


def test_a_504_names_the_timeout_the_call_ran_under():
    """A stream's header wait times out at its worker's silence bound: the 504 says that bound, not the pool's."""
    from pdfleet_worker.router import proxy

    request = httpx.Request("POST", "http://w:1/v1/completions", extensions={"timeout": {"read": 0.3}})
    assert proxy._read_timeout(httpx.ReadTimeout("late", request=request), 600.0) == 0.3
    assert proxy._read_timeout(httpx.ReadTimeout("late"), 600.0) == 600.0, "no request on it: the configured one"


def test_a_streams_read_timeout_is_three_of_its_workers_heartbeats_and_other_calls_keep_the_pools():
    from types import SimpleNamespace

    from pdfleet_worker.router import proxy
    from pdfleet_worker.router.upstreams import Upstream

    fake = SimpleNamespace(client=httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=2.0)))
    beating = Upstream("http://w:1", "default", "decode", load={"heartbeat_interval_s": 0.5})
    silent = Upstream("http://w:2", "default", "decode", load={"heartbeat_interval_s": 0})
    vllm = Upstream("http://w:3", "default", "decode", engine="vllm", load={"heartbeat_interval_s": 0.5})
    assert (proxy.silence_limit(beating), proxy.silence_limit(silent), proxy.silence_limit(vllm)) == (1.5, None, None)
    # streams (router/stream_client.py): the worker's own bound, never more than --upstream-timeout
    assert [proxy.stream_read_timeout(600.0, up) for up in (beating, silent, vllm)] == [1.5, 600.0, 600.0]
    assert proxy.stream_read_timeout(1.0, beating) == 1.0
    plain = proxy.Router._request(fake, beating, "/v1/completions", {})
    assert plain.extensions["timeout"]["read"] == 600.0, "a call without a silence bound keeps the pool's timeout"
