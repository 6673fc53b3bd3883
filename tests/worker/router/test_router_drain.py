"""A router told to stop (its node drained, a rollout) loses no request: issue 24, rule 8, with real processes.

On SIGTERM the router says 503 on /ready at once (the Service takes it out), keeps answering what still
arrives for --drain-accept seconds (endpoint removal lags the signal), lets the streams it carries finish,
then exits 0."""

from __future__ import annotations

import json
import signal
import threading

import httpx

from tests.worker.processes import MODEL, router, start_all, wait_until


def test_a_draining_router_finishes_its_streams_and_answers_what_still_arrives(logdir, pipeline) -> None:
    r = router(
        logdir, "--workers", pipeline.colo.url, "--drain-accept", "3", "--drain-timeout", "120", name="router-drain"
    )
    start_all(r)
    streamed: list[str] = []
    first = threading.Event()
    done: dict[str, object] = {}

    def long_stream() -> None:
        # (1,800 tokens: what the tiny model's context holds after the prompt; the other serving tests' long stream)
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1800, "stream": True, "temperature": 0}
        with httpx.stream("POST", f"{r.url}/v1/completions", json=body, timeout=120) as resp:
            done["status"] = resp.status_code
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    streamed.append(json.loads(line[6:])["choices"][0]["text"])
                    first.set()
                elif line == "data: [DONE]":
                    done["done"] = True

    t = threading.Thread(target=long_stream)
    t.start()
    try:
        assert first.wait(60), "the long stream started"
        r.signal(signal.SIGTERM)
        assert not done.get("done"), "the stream was in flight when the router was told to stop"
        wait_until(
            lambda: httpx.get(f"{r.url}/ready", timeout=2).status_code == 503,
            timeout=10,
            what="/ready 503 once draining",
        )
        # What the Service still sends during the accept window is answered, not refused.
        answers = [
            httpx.post(
                f"{r.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4}, timeout=60
            ).status_code
            for _ in range(3)
        ]
        assert answers == [200, 200, 200]
        t.join(120)
        assert done.get("status") == 200 and done.get("done"), "the stream in flight finished"
        assert len(streamed) >= 1 and not t.is_alive()
        r.proc.wait(timeout=60)
        assert r.proc.returncode == 0, r.log()
    finally:
        t.join(1)
        r.stop()


def test_with_nothing_in_flight_a_draining_router_still_answers_during_its_accept_window(logdir, pipeline) -> None:
    """With no stream to wait for, a router without --drain-accept would exit at once and refuse what a Service
    still sends it; with it, it answers for the window, then exits 0."""
    r = router(logdir, "--workers", pipeline.colo.url, "--drain-accept", "10", name="router-accept")
    start_all(r)
    try:
        r.signal(signal.SIGTERM)
        wait_until(
            lambda: httpx.get(f"{r.url}/ready", timeout=2).status_code == 503,
            timeout=10,
            what="/ready 503 once draining",
        )
        answer = httpx.post(
            f"{r.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4}, timeout=60
        )
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] is not None
        r.proc.wait(timeout=60)
        assert r.proc.returncode == 0, r.log()
    finally:
        r.stop()
