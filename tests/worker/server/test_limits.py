"""Bad input gets OpenAI error objects (400/404/413), overload gets 503 + Retry-After, disconnects free blocks, and the
worker and router stay healthy afterwards."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from pdfleet_worker import metrics as m
from tests.support.components import free_port
from tests.worker.kv_transfer.test_kv_transfer import sample
from tests.worker.processes import MODEL, Proc, pool_whole, wait_until

GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
# The colocated worker's admission limits (the pipeline fixture's --max-num-seqs and --max-waiting-requests).
COLO_SEQS = COLO_WAITING = 4


def assert_error(resp: httpx.Response, status: int, param: str | None = None, contains: str = "") -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert contains in err["message"], err
    return err


def post_raw(url: str, content: bytes) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions", content=content, headers={"content-type": "application/json"}, timeout=30
    )


def leave_once_running(url: str, body: dict, running: Callable[[], bool], headers: dict | None = None) -> None:
    """A client that gives up on a non-streamed request: sent on a raw connection, which is closed unread
    once `running()` says a worker generates it (synchronized on the worker's state, not a read timeout
    racing the generation, which a fast machine wins)."""
    port = httpx.URL(url).port
    data = json.dumps(body).encode()
    head = [
        "POST /v1/completions HTTP/1.1",
        f"Host: 127.0.0.1:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(data)}",
        *(f"{k}: {v}" for k, v in (headers or {}).items()),
        "",
        "",
    ]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall("\r\n".join(head).encode() + data)
        wait_until(running, timeout=30, what="the request being generated")
        conn.setblocking(False)  # (a socket with a timeout would wait for the answer)
        try:
            answered = conn.recv(200, socket.MSG_PEEK)
        except BlockingIOError:
            answered = None
        assert answered is None, f"the server answered before the client left: {answered!r}"


@contextlib.contextmanager
def saturated(colo: Proc) -> Iterator[list[concurrent.futures.Future]]:
    """The colocated worker full on both counts: COLO_SEQS long streams hold every sequence slot and
    COLO_WAITING 40-token requests fill the waiting queue (checked on /load), so whatever comes next is
    over the limit however fast this machine generates. Yields the waiting requests' futures; on exit the
    long streams' clients leave (their requests are aborted) and the waiting ones run to completion."""
    hold_tokens = 900  # 4 x 903 tokens fit the 256 x 16-token KV pool: no preemption puts one back to waiting
    hold = {
        "model": MODEL,
        "prompt": [5, 6, 7],
        "max_tokens": hold_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    short = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with contextlib.ExitStack() as holds, concurrent.futures.ThreadPoolExecutor(COLO_WAITING) as pool:
        for _ in range(COLO_SEQS):
            resp = holds.enter_context(httpx.stream("POST", f"{colo.url}/v1/completions", json=hold, timeout=60))
            assert resp.status_code == 200
        wait_until(lambda: colo.load()["running"] == COLO_SEQS, what="every sequence slot held")
        waiting = [
            pool.submit(httpx.post, f"{colo.url}/v1/completions", json=short, timeout=120) for _ in range(COLO_WAITING)
        ]
        wait_until(lambda: colo.load()["waiting"] == COLO_WAITING, what="the waiting queue full")
        yield waiting
        load = colo.load()
        assert (load["running"], load["waiting"]) == (COLO_SEQS, COLO_WAITING), f"the holds ended early: {load}"
        holds.close()  # the long streams' clients leave
        for fut in waiting:
            r = fut.result(timeout=120)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40, r.text


@pytest.mark.parametrize("target", ["colo", "router"])
def test_bad_input_gets_openai_error_objects(pipeline, target):
    url = getattr(pipeline, target).url
    post = lambda body: httpx.post(f"{url}/v1/completions", json=body, timeout=30)  # noqa: E731
    assert_error(post_raw(url, b'{"model": "tiny", "prompt": '), 400, contains="not valid JSON")
    assert_error(post_raw(url, b"[1, 2]"), 400, contains="JSON object")
    assert_error(post({**GOOD, "max_tokens": "many"}), 400, "max_tokens")
    assert_error(post({**GOOD, "max_tokens": -4}), 400, "max_tokens")
    assert_error(post({**GOOD, "temperature": "hot"}), 400, "temperature")
    assert_error(post({**GOOD, "n": 1.5}), 400, "n")
    assert_error(post({**GOOD, "stop": 7}), 400, "stop")
    assert_error(post({**GOOD, "frobnicate": True}), 400, "frobnicate", "Unrecognized request argument")
    assert_error(post({k: v for k, v in GOOD.items() if k != "prompt"}), 400, "prompt", "Missing")
    assert_error(post({**GOOD, "prompt": [1] * 2048}), 400, "prompt", "maximum context length")
    assert_error(post({**GOOD, "prompt": [1, 2], "max_tokens": 2047}), 400, "max_tokens", "maximum context length")
    assert_error(post({**GOOD, "prompt": [99999]}), 400, "prompt", "token ids outside")
    assert_error(post({**GOOD, "prompt": []}), 400, "prompt")
    assert_error(post({**GOOD, "use_beam_search": True}), 400, "use_beam_search", "not supported")
    assert_error(post({**GOOD, "presence_penalty": 2.5}), 400, "presence_penalty")
    assert_error(post({**GOOD, "model": "gpt-5"}), 404, "model", "does not exist")
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
        timeout=30,
    )
    assert_error(chat, 400, "messages.0.role")
    assert_error(
        httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=30), 400, "messages"
    )
    huge = b'{"model": "tiny", "prompt": "' + b"x" * 5_000_000 + b'"}'
    assert_error(post_raw(url, huge), 413, contains="limit")
    assert_error(httpx.get(f"{url}/v1/nothing-here", timeout=10), 404)
    # ... and afterwards everything still works.
    assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/ready").status_code == 200
    ok = post(GOOD)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_openai_sdk_sees_typed_errors(pipeline):
    with openai.OpenAI(base_url=f"{pipeline.router.url}/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=[1] * 3000, max_tokens=1)
        assert e.value.body["param"] == "prompt" and "maximum context length" in e.value.message
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])


def test_overload_answers_503_with_retry_after_and_recovers(pipeline):
    colo = pipeline.colo
    rejected0 = sample(colo.metrics_text(), m.ADMISSION_REJECTIONS_TOTAL.name, reason="queue_full")

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*(client.post(f"{colo.url}/v1/completions", json=body) for _ in range(8)))

    with saturated(colo):
        results = asyncio.run(burst())
        # Counted before the answer is sent.
        assert sample(colo.metrics_text(), m.ADMISSION_REJECTIONS_TOTAL.name, reason="queue_full") == rejected0 + 8
    # Every one of the burst is over the limit: refused, and told when to retry; the admitted ones finished
    # (saturated() checks their 40 tokens).
    for r in results:
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert_error(r, 503, contains="overloaded")
        assert r.json()["error"]["code"] == "queue_full"
    wait_until(lambda: pool_whole(colo), what="pool whole after the burst")
    assert httpx.post(f"{colo.url}/v1/completions", json=GOOD, timeout=30).status_code == 200


def test_client_disconnect_aborts_and_frees_blocks(pipeline):
    colo = pipeline.colo
    aborted0 = sample(colo.metrics_text(), m.REQUEST_SUCCESS_TOTAL.name, finished_reason="abort")
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 1800, "temperature": 0, "ignore_eos": True}
    # Streaming: read a little, then hang up.
    with httpx.stream("POST", f"{colo.url}/v1/completions", json=dict(body, stream=True), timeout=30) as resp:
        it = resp.iter_lines()
        assert next(it).startswith("data: ")
        assert colo.load()["running"] == 1
        # The engine loop runs off the event loop: /health is answered while the generation goes on (the
        # stream is still running after it, its next event a token); the time it took is printed, not judged.
        t0 = time.monotonic()
        assert httpx.get(f"{colo.url}/health", timeout=30).status_code == 200
        print(f"/health answered in {time.monotonic() - t0:.3f} s during a generation")
        assert colo.load()["running"] == 1
        assert next(line for line in it if line).startswith("data: {")
    wait_until(lambda: pool_whole(colo), timeout=10, what="blocks freed after the stream's client left")
    wait_until(
        lambda: sample(colo.metrics_text(), m.REQUEST_SUCCESS_TOTAL.name, finished_reason="abort") == aborted0 + 1,
        timeout=10,
        what="the stream counted as aborted",
    )
    # Non-streaming: the client gives up before the answer.
    leave_once_running(colo.url, body, lambda: colo.load()["running"] == 1)
    wait_until(lambda: pool_whole(colo), timeout=10, what="blocks freed after the client left")
    wait_until(
        lambda: sample(colo.metrics_text(), m.REQUEST_SUCCESS_TOTAL.name, finished_reason="abort") == aborted0 + 2,
        timeout=10,
        what="the non-streamed request counted as aborted",
    )


def test_router_client_disconnect_reaches_the_decode_worker(pipeline):
    body = {
        "model": MODEL,
        "prompt": "a long story",
        "max_tokens": 1800,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{pipeline.router.url}/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()  # NOTE: keep it: a dropped iterator closes the response
        assert next(lines).startswith("data: ")
        assert pipeline.decode.load()["running"] == 1
    wait_until(
        lambda: pool_whole(pipeline.decode) and pool_whole(pipeline.prefill),
        timeout=10,
        what="decode and prefill pools whole after the client left the router",
    )
    assert httpx.get(f"{pipeline.router.url}/ready").status_code == 200


def test_router_answers_503_when_no_worker_is_reachable(logdir):
    from tests.worker.processes import router

    dead = f"http://127.0.0.1:{free_port()}"  # nobody listens there (and below the ephemeral range: no self-connect)
    r = router(logdir, "--workers", dead, name="router-empty")
    r.start()
    try:
        wait_until(lambda: _health(r), what="router up")
        assert httpx.get(f"{r.url}/ready").status_code == 503
        resp = httpx.post(f"{r.url}/v1/completions", json=GOOD, timeout=10)
        assert_error(resp, 503, contains="no healthy both worker")
        assert resp.headers["retry-after"] == "1"
        # The router counts an answer once it is sent.
        wait_until(
            lambda: sample(r.metrics_text(), m.ROUTER_REQUESTS_TOTAL.name, code="503", tier="default") == 1,
            timeout=5,
            what="the router counting its 503",
        )
    finally:
        assert r.stop() == 0


def _health(p) -> bool:
    try:
        return httpx.get(f"{p.url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_overload_through_the_router_is_counted_as_shedding_apart_from_failures(pipeline):
    """Every worker of the tier answering 503 + Retry-After is the router's designed load shedding: counted with
    shed="true" in the per-revision series rollback analysis reads without it."""
    r = pipeline.router
    name = m.ROUTER_REVISION_REQUESTS_TOTAL.name
    shed0 = sample(r.metrics_text(), name, revision="none", code="503", shed="true")
    failed0 = sample(r.metrics_text(), name, revision="none", code="503", shed="false")

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": "tiny-colo", "prompt": [5, 6, 7], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*(client.post(f"{r.url}/v1/completions", json=body) for _ in range(8)))

    with saturated(pipeline.colo):  # the tier's one worker full: each request of the burst is shed
        codes = [x.status_code for x in asyncio.run(burst())]
    assert codes == [503] * 8, codes
    # The router counts an answer once it is sent.
    wait_until(
        lambda: sample(r.metrics_text(), name, revision="none", code="503", shed="true") == shed0 + 8,
        timeout=5,
        what="the router counting the shed requests",
    )
    assert sample(r.metrics_text(), name, revision="none", code="503", shed="false") == failed0
    wait_until(lambda: pool_whole(pipeline.colo), what="pool whole after the burst")
