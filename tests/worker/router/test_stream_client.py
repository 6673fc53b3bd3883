"""The router's stream client (router/stream_client.py) against raw asyncio servers on loopback that play a worker:
kept-alive connections reused, a connection the worker closed as the request went out retried once on a new one,
failures as the httpx errors the proxy classifies, heartbeats on silence, the read timeout, the deployment token's
401 flow, flow control, and a client that leaves closing the connection (the worker then aborts). Nothing is timed:
each test waits for states the server reports."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdfleet_worker.router import stream_client
from pdfleet_worker.router.stream_client import StreamClient
from tests.support.components import free_port

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(head, body) of one request; EOF raises IncompleteReadError."""
    head = await reader.readuntil(b"\r\n\r\n")
    lengths = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
    length = lengths[0]
    return head, await reader.readexactly(length)


class Worker:
    """A loopback server whose `answer(n, head, body, writer)` plays the worker for the n-th request of a
    connection; records connections and requests."""

    def __init__(self, answer):
        self.answer = answer
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.closed = asyncio.Event()  # a client connection ended (EOF seen)

    async def __aenter__(self) -> Worker:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            n = 0
            while True:
                try:
                    head, body = await read_request(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.closed.set()
                    return
                self.requests.append((head, body))
                if await self.answer(n, head, body, reader, writer) is False:
                    return
                n += 1
        finally:
            writer.close()


async def sse_answer(n, head, body, reader, writer) -> None:
    writer.write(HEAD + chunk(b"data: " + body + b"\n\n") + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await writer.drain()


async def test_streams_reuse_one_kept_alive_connection_and_send_the_body_and_headers():
    client = StreamClient(connect_timeout_s=5)
    async with Worker(sse_answer) as w:
        for i in range(3):
            stream = await client.open(w.url, "/v1/completions", b'{"n":%d}' % i, {"x-request-id": "r1"})
            assert stream.status_code == 200 and stream.headers["content-type"] == "text/event-stream"
            assert await stream.aread() == b'data: {"n":%d}\n\ndata: [DONE]\n\n' % i
            stream.close()
        assert (w.connections, client.connections_opened) == (1, 1)
        head, body = w.requests[0]
        assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n") and body == b'{"n":0}'
        assert b"x-request-id: r1\r\n" in head and b"content-type: application/json\r\n" in head
    await client.aclose()


async def test_a_kept_alive_connection_the_worker_closed_as_we_sent_is_retried_once_on_a_new_one():
    async def close_the_second(n, head, body, reader, writer):
        if n == 1:  # the race with a worker's keep-alive timeout: the request came, the connection closes unanswered
            return False
        await sse_answer(n, head, body, reader, writer)

    client = StreamClient(connect_timeout_s=5)
    async with Worker(close_the_second) as w:
        first = await client.open(w.url, "/v1/completions", b"1")
        await first.aread()
        first.close()
        second = await client.open(w.url, "/v1/completions", b"2")
        assert await second.aread() == b"data: 2\n\ndata: [DONE]\n\n"
        second.close()
        assert w.connections == 2 and len(w.requests) == 3
    await client.aclose()


async def test_a_new_connection_closed_unanswered_is_the_workers_fault():
    async def hang_up(n, head, body, reader, writer):
        return False

    client = StreamClient(connect_timeout_s=5)
    async with Worker(hang_up) as w:
        with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
            await client.open(w.url, "/v1/completions", b"{}")
        assert w.connections == 1, "a connection that was never answered is not retried"


async def test_a_worker_that_dies_mid_stream_is_a_protocol_error_after_what_it_sent():
    async def die(n, head, body, reader, writer):
        writer.write(HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        return False

    client = StreamClient(connect_timeout_s=5)
    async with Worker(die) as w:
        stream = await client.open(w.url, "/v1/completions", b"{}")
        assert await stream.next() == b"data: 1\n\n"
        with pytest.raises(httpx.RemoteProtocolError, match="complete message body"):
            await stream.next()
        stream.close()


async def test_silence_past_the_read_timeout_is_a_read_timeout_and_heartbeats_come_before_it():
    release = asyncio.Event()

    async def pause(n, head, body, reader, writer):
        writer.write(HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        await release.wait()
        writer.write(chunk(b"data: 2\n\n") + b"0\r\n\r\n")
        await writer.drain()

    client = StreamClient(connect_timeout_s=5)
    async with Worker(pause) as w:
        stream = await client.open(w.url, "/v1/completions", b"{}", read_timeout_s=60, heartbeat_s=0.05)
        assert await stream.next() == b"data: 1\n\n"
        assert await stream.next() == b"", "a heartbeat is due while the worker is silent"
        assert await stream.next() == b""
        release.set()
        got = [await stream.next()]
        while got[-1] == b"":  # heartbeats may still be due until the bytes come
            got.append(await stream.next())
        assert got[-1] == b"data: 2\n\n" and await stream.next() is None
        stream.close()

        release.clear()
        silent = await client.open(w.url, "/v1/completions", b"{}", read_timeout_s=0.1)
        assert await silent.next() == b"data: 1\n\n"
        with pytest.raises(httpx.ReadTimeout, match="no bytes from the worker for 0.1s"):
            await silent.next()
        silent.close()
        release.set()


async def test_a_client_that_leaves_closes_the_connection_so_the_worker_aborts():
    async def endless(n, head, body, reader, writer):
        writer.write(HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        await reader.read()  # until the router closes the connection
        w.closed.set()
        return False

    client = StreamClient(connect_timeout_s=5)
    async with Worker(endless) as w:
        stream = await client.open(w.url, "/v1/completions", b"{}")
        assert await stream.next() == b"data: 1\n\n"
        stream.close()
        stream.close()  # idempotent
        await asyncio.wait_for(w.closed.wait(), 30)
        assert client._idle.get(("http", "127.0.0.1", int(w.url.rsplit(":", 1)[1])), []) == []


async def test_the_auth_flow_retries_a_401_with_the_next_token():
    class TwoTokens(httpx.Auth):
        def auth_flow(self, request):
            for token in ("new", "old"):
                request.headers["Authorization"] = f"Bearer {token}"
                response = yield request
                if response.status_code != 401:
                    return

    async def old_token_only(n, head, body, reader, writer):
        if b"Bearer old" not in head:
            writer.write(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 2\r\n\r\nno")
            await writer.drain()
            return
        await sse_answer(n, head, body, reader, writer)

    client = StreamClient(connect_timeout_s=5)
    async with Worker(old_token_only) as w:
        stream = await client.open(w.url, "/v1/completions", b"{}", auth=TwoTokens())
        assert stream.status_code == 200 and await stream.aread() == b"data: {}\n\ndata: [DONE]\n\n"
        stream.close()
        assert [b"Bearer new" in h for h, _ in w.requests] == [True, False] and w.connections == 1
    await client.aclose()


async def test_a_worker_nobody_listens_for_is_a_connect_error():
    port = free_port()  # nothing listens there; below the ephemeral range, a connect cannot reach itself
    with pytest.raises(httpx.ConnectError):
        await StreamClient(connect_timeout_s=5).open(f"http://127.0.0.1:{port}", "/v1/completions", b"{}")


async def test_a_reader_that_falls_behind_stops_the_socket_and_loses_nothing():
    payload = bytes(range(256)) * 4096  # 1 MiB, 4x the high-water mark

    async def flood(n, head, body, reader, writer):
        writer.write(HEAD)
        for i in range(0, len(payload), 16384):
            writer.write(chunk(payload[i : i + 16384]))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    client = StreamClient(connect_timeout_s=5)
    async with Worker(flood) as w:
        stream = await client.open(w.url, "/v1/completions", b"{}")
        conn = stream._conn
        while not conn.paused:  # nobody reads: the socket stops being read past the high-water mark
            await asyncio.sleep(0.01)
        assert conn.reader.buffered <= stream_client.HIGH_WATER + (1 << 17)
        assert await stream.aread() == payload
        stream.close()
    await client.aclose()


async def test_a_header_that_would_split_the_request_is_refused_before_anything_is_sent():
    async with Worker(sse_answer) as w:
        with pytest.raises(ValueError, match="line break"):
            await StreamClient(connect_timeout_s=5).open(w.url, "/v1/completions", b"{}", {"x-id": "a\r\nx-evil: 1"})
        assert w.connections == 0


def test_the_pool_for_calls_and_probes_lets_idle_connections_go_before_a_workers_keep_alive_does():
    """httpx's default keep-alive expiry is uvicorn's 5 s: a non-streamed call could go out on a connection vLLM's
    server was closing that instant (ReadError, the only decode worker out of rotation, a 503)."""
    from pdfleet_worker.router.app import upstream_client
    from pdfleet_worker.router.router_config import RouterConfig, TierConfig

    cfg = RouterConfig(tiers={"default": TierConfig("default", workers=["http://127.0.0.1:9"])}, default_tier="default")
    client = upstream_client(cfg)
    try:
        assert client._transport._pool._keepalive_expiry == stream_client.KEEPALIVE_EXPIRY_S < 5
    finally:
        asyncio.run(client.aclose())
