"""The router's SSE relay (proxy._Relay) over a scripted worker stream: bytes pass untouched however the socket cuts
them, only [DONE] and error events are looked into (an error event's addresses redacted, its code kept), TTFT waits
for the first data event, a heartbeat never splits an event, and a stream that breaks ends with an error event and
[DONE], counted, its worker out of rotation."""

from __future__ import annotations

import json

import httpx
import pytest

from pdfleet_worker import metrics as m
from pdfleet_worker.router import proxy
from pdfleet_worker.router.router_config import RouterConfig, TierConfig
from pdfleet_worker.router.router_metrics import Outcome, RouterMetrics
from pdfleet_worker.router.upstreams import Upstream, Upstreams
from pdfleet_worker.wire.heartbeat import KEEP_ALIVE
from tests.worker.kv_transfer.test_kv_transfer import sample

WORKER = "http://10.1.2.3:8001"
CLIENT = httpx.AsyncClient()  # unused by the relay; one for all (each new one loads the CA bundle)


def token(text: str, i: int = 0) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
    return b"data: " + json.dumps({"id": f"cmpl-{i}", "choices": [choice]}).encode() + b"\n\n"


class Script:
    """A worker stream: next() hands out the pieces given (b'' is a heartbeat due), then None, or raises."""

    def __init__(self, pieces: list[bytes], error: Exception | None = None):
        self.pieces, self.error, self.closed = list(pieces), error, False

    async def next(self) -> bytes | None:
        if self.pieces:
            return self.pieces.pop(0)
        if self.error is not None:
            raise self.error
        return None

    def close(self) -> None:
        self.closed = True


def relay_of(pieces: list[bytes], error: Exception | None = None):
    cfg = RouterConfig(tiers={"default": TierConfig("default", workers=[WORKER])}, default_tier="default")
    ups = Upstreams(cfg, CLIENT)
    up = ups.all[("default", "both", WORKER)] = Upstream(WORKER, "default", "both", healthy=True)
    router = proxy.Router(cfg, ups, RouterMetrics(["default"], lambda: []), CLIENT)
    router.active = up.inflight = 1  # as _forward leaves them for the relay
    outcome = Outcome("default")
    return proxy._Relay(router, up, Script(pieces, error), outcome), router, up, outcome


async def relayed(relay) -> list[bytes]:
    return [event async for event in relay.events()]


def cuts(data: bytes) -> list[list[bytes]]:
    return [[data[:i], data[i:]] for i in range(1, len(data))] + [[data[i : i + 1] for i in range(len(data))]]


async def test_events_pass_untouched_however_they_are_cut_and_the_answer_counts_as_served():
    stream = token(" a", 0) + token(" b", 1) + b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\n'
    stream += b"data: [DONE]\n\n"
    for pieces in cuts(stream):
        relay, router, up, outcome = relay_of(pieces)
        out = await relayed(relay)
        assert b"".join(out) == stream
        assert all(e.endswith(b"\n\n") for e in out), "only whole events leave"
        assert (outcome.code, relay.done, up.inflight, router.active, up.healthy) == (200, True, 0, 0, True)
        assert relay.resp.closed


async def test_text_that_looks_like_done_or_an_error_is_a_token_like_any_other():
    tricky = token('data: [DONE]\n\ndata: {"error": 1}', 0) + token(" x", 1) + b"data: [DONE]\n\n"
    for pieces in ([tricky], cuts(tricky)[40]):
        relay, _, _, outcome = relay_of(pieces)
        assert b"".join(await relayed(relay)) == tricky and outcome.code == 200


async def test_an_error_event_is_redacted_and_its_code_is_the_streams():
    err = {"error": {"message": f"KV pull from {WORKER} failed", "type": "upstream_error", "param": None, "code": 503}}
    stream = token(" a") + b"data: " + json.dumps(err).encode() + b"\n\n" + b"data: [DONE]\n\n"
    relay, _, _, outcome = relay_of([stream])
    out = b"".join(await relayed(relay))
    assert WORKER not in out.decode() and "10.1.2.3" not in out.decode() and b"<worker>" in out
    assert out.startswith(token(" a")) and out.endswith(b"data: [DONE]\n\n")
    assert outcome.code == 503


async def test_ttft_waits_for_the_first_data_event_and_heartbeats_never_split_one():
    event = token(" a")
    pieces = [b": keep-alive\n\n", b"", event[:10], b"", event[10:], b"data: [DONE]\n\n"]
    relay, router, _, _ = relay_of(pieces)
    seen = []
    async for out in relay.events():
        ttft = sample(router.metrics.exposition().decode(), m.ROUTER_TIME_TO_FIRST_TOKEN.name + "_count")
        seen.append((out, ttft))
    assert seen == [(b": keep-alive\n\n", 0), (KEEP_ALIVE, 0), (event, 1), (b"data: [DONE]\n\n", 1)]


@pytest.mark.parametrize(
    "error, reason",
    [
        (None, "stream_broken"),  # ended without [DONE]
        (httpx.RemoteProtocolError("peer closed connection"), "stream_broken"),
        (httpx.ReadTimeout("no bytes from the worker for 1.5s"), "timeout"),
    ],
)
async def test_a_broken_stream_ends_with_an_error_event_and_done_and_takes_the_worker_out(error, reason):
    relay, router, up, outcome = relay_of([token(" a")], error)
    out = await relayed(relay)
    assert out[0] == token(" a") and out[-1] == b"data: [DONE]\n\n"
    assert json.loads(out[1][len(b"data: ") :])["error"]["code"] == 502 and b"failed mid-stream" in out[1]
    assert (outcome.code, up.healthy, up.inflight, router.active) == (502, False, 0, 0)
    text = router.metrics.exposition().decode()
    assert sample(text, m.ROUTER_UPSTREAM_ERRORS_TOTAL.name, upstream_role="both", reason=reason) == 1


async def test_a_relay_closed_before_it_ran_settles_once_as_the_clients_abort():
    relay, router, up, outcome = relay_of([token(" a")])
    relay.close()
    relay.close()
    assert (outcome.code, up.inflight, router.active, relay.resp.closed) == (499, 0, 0, True)
