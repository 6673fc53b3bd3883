"""SSE heartbeats: a stream that waits longer than the interval gets `: keep-alive` comments before its first token,
from the worker (queued behind another request) and from the router (a slow prefill hand-off); the openai SDK parses
such streams; a fast error keeps its real status code."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest

from tests.worker.processes import MODEL, router, start_all, wait_until, worker

PROMPT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4, "stream": True}


def raw_stream(url: str, body: dict) -> tuple[int, list[str]]:
    """(status, the stream's non-empty lines in order)."""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
        lines = [line for line in resp.iter_lines() if line]
        return resp.status_code, lines


def before_first_data(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        if line.startswith("data:"):
            break
        out.append(line)
    return out


class _Fake(BaseHTTPRequestHandler):
    """A pdfleet worker's surface, slow on purpose: /load ready; a prefill answer after `delay` seconds; a
    decode stream of two tokens; a 400 for a prompt saying 'bad' (at once)."""

    delay = 0.0
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._json(200, {"ready": True, "model": MODEL, "role": "both"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if body["messages"][0]["content"] == "slow bad":
            time.sleep(self.delay)
            body["messages"][0]["content"] = "bad"
        if body["messages"][0]["content"] == "bad":
            self._json(
                400, {"error": {"message": "bad prompt", "type": "invalid_request_error", "param": None, "code": None}}
            )
            return
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            time.sleep(self.delay)
            self._json(
                200,
                {
                    "id": "x",
                    "choices": [],
                    "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "127.0.0.1"},
                },
            )
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        for text in ("Hi", "!"):
            chunk = {
                "id": "c",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": MODEL,
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
            }
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True


@pytest.fixture(scope="module")
def slow_pd(logdir):
    """A router (heartbeat 0.1 s) over a fake prefill worker that takes 0.6 s and a fake decode worker."""
    handler = type("SlowFake", (_Fake,), {"delay": 0.6})
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), handler) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    r = router(logdir, "--prefill", urls[0], "--decode", urls[1], "--heartbeat-interval", "0.1", name="router-hb")
    try:
        start_all(r)
        yield r
    finally:
        r.stop()
        for s in servers:
            s.shutdown()


def test_router_beats_while_the_prefill_hand_off_runs(slow_pd):
    status, lines = raw_stream(slow_pd.url, PROMPT)
    assert status == 200
    early = before_first_data(lines)
    assert early and all(line == ": keep-alive" for line in early), lines
    assert lines[-1] == "data: [DONE]"
    assert [json.loads(x[6:])["choices"][0]["delta"]["content"] for x in lines if x.startswith("data: {")] == [
        "Hi",
        "!",
    ]


def test_the_openai_sdk_ignores_the_router_heartbeats(slow_pd):
    client = openai.OpenAI(base_url=f"{slow_pd.url}/v1", api_key="none", max_retries=0)
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model=MODEL, messages=PROMPT["messages"], max_tokens=4, stream=True)
        if c.choices
    )
    assert text == "Hi!"


def test_a_fast_error_keeps_its_status_code(slow_pd):
    status, lines = raw_stream(slow_pd.url, {**PROMPT, "messages": [{"role": "user", "content": "bad"}]})
    assert status == 400 and "bad prompt" in lines[0]


def test_an_error_after_the_first_heartbeat_is_an_error_event_counted_with_its_code(slow_pd):
    def count_400() -> float:
        text = httpx.get(f"{slow_pd.url}/metrics").text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("pdfleet_router_requests_total{") and 'code="400"' in line
        )

    before = count_400()
    status, lines = raw_stream(slow_pd.url, {**PROMPT, "messages": [{"role": "user", "content": "slow bad"}]})
    assert status == 200  # committed at the first heartbeat
    early = before_first_data(lines)
    assert early and set(early) == {": keep-alive"}
    event = json.loads(lines[len(early)][len("data: ") :])
    assert event["error"]["message"] == "bad prompt" and lines[-1] == "data: [DONE]"
    wait_until(lambda: count_400() == before + 1, what="the stream counted as a 400")


def test_heartbeats_are_counted_as_no_first_token(slow_pd):
    raw_stream(slow_pd.url, PROMPT)
    text = httpx.get(f"{slow_pd.url}/metrics").text
    # the first token came after the 0.6 s prefill: no observation under 0.5 s, although keep-alives were sent
    counts = {
        line.split('le="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pdfleet_router_time_to_first_token_seconds_bucket")
    }
    assert counts and counts["0.5"] == 0 < counts["+Inf"]


@pytest.fixture(scope="module")
def queued_worker(logdir, model_dir):
    """A colocated worker that runs one sequence at a time and beats every 100 ms, behind a router that beats
    only every 30 s (so the comments seen come from the worker, relayed).
    NOTE: the router ends a stream its worker leaves silent for three beats; at 20 ms beats that was 60 ms, which a
    worker's event loop on a loaded 2-core machine overran once in a full suite (a 504 before the first event)."""
    w = worker(logdir, model_dir, "both", "--max-num-seqs", "1", "--heartbeat-interval", "0.1", name="hb-worker")
    start_all(w)
    r = router(logdir, "--workers", w.url, "--heartbeat-interval", "30", name="router-hb-worker")
    try:
        start_all(r)
        yield w, r
    finally:
        r.stop()
        w.stop()


class _Hold:
    """A long generation (1,900 tokens, streamed: seconds of work at any plausible speed) that holds the
    worker's only sequence slot until release(): its client leaves, the worker aborts it, the queue moves."""

    def __init__(self, url: str):
        body = {"model": MODEL, "prompt": "x " * 50, "max_tokens": 1900, "ignore_eos": True, "stream": True}
        self._release = threading.Event()
        self.ended = threading.Event()  # the hold's stream ended (released, or generated whole)

        def run() -> None:
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
                    for _ in resp.iter_lines():
                        if self._release.is_set():
                            break
            finally:
                self.ended.set()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._release.set()
        self._thread.join(timeout=60)


def queued_stream(url: str, body: dict, hold: _Hold) -> tuple[int, list[str]]:
    """(status, the stream's non-empty lines) of a stream sent while `hold` runs; the hold is released once the
    stream's first line came (synchronized on the stream, not on how fast the hold generates)."""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
        lines = (line for line in resp.iter_lines() if line)
        first = [next(lines)]
        assert not hold.ended.is_set(), "the hold ended before the queued stream's first line"
        hold.release()
        return resp.status_code, first + list(lines)


def test_worker_beats_while_a_stream_is_queued(queued_worker):
    w, r = queued_worker
    for url in (w.url, r.url):  # the worker's own stream, then the same relayed by the router
        hold = _Hold(w.url)
        wait_until(lambda: w.load().get("running") == 1, what="the long request running")
        status, lines = queued_stream(url, PROMPT, hold)
        assert status == 200
        early = before_first_data(lines)
        assert early and all(line == ": keep-alive" for line in early), lines[:5]
        assert lines[-1] == "data: [DONE]"


def test_the_openai_sdk_parses_a_queued_stream(queued_worker):
    w, r = queued_worker
    hold = _Hold(w.url)
    wait_until(lambda: w.load().get("running") == 1, what="the long request running")
    client = openai.OpenAI(base_url=f"{r.url}/v1", api_key="none", max_retries=0)
    # Returns with the headers, which a queued stream's worker sends at the first heartbeat.
    stream = client.chat.completions.create(
        model=MODEL, messages=PROMPT["messages"], max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    wait_until(lambda: w.load().get("waiting") == 1, what="the stream queued behind the long request")
    time.sleep(0.5)  # five heartbeat intervals of comments for the SDK to skip (the hold lasts seconds)
    assert not hold.ended.is_set(), "the hold ended before it was released"
    hold.release()
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert all(c.model == MODEL for c in chunks)
