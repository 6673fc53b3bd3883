"""The router's HTTP/1.1 client for streamed worker answers: kept-alive connections per worker, each response decoded in
the socket's callback (response_reader.py), one timer per stream for its read timeout and its heartbeats; the proxy
opens every stream through it. Non-streamed calls and probes use httpx. No torch.

NOTE: why not httpx here: the router relays every token of every stream, and httpx spends most of the router's CPU
per token on its layers (httpcore's h11 state machine, anyio cancel scopes and a pause/resume of the socket per read,
sniffio), and a heartbeat around its iterator needs a task and a queue hop per event. This client's path per token is
one callback that decodes the chunk and wakes the reader. bench/router.py measures both (docs in bench/README.md).
Failures are httpx's exception types, so callers classify them once: ConnectError / ConnectTimeout (nothing sent),
RemoteProtocolError / ReadError (the worker closed or broke the connection), ReadTimeout (silent too long).
NOTE: it connects to workers directly: HTTP(S)_PROXY in the router's environment is not applied to streams (workers
are addresses inside the deployment's network; a proxy between router and worker is not a supported setup).
"""

from __future__ import annotations

import asyncio
import json
import ssl
from typing import Any
from urllib.parse import urlsplit

import httpx

from pdfleet_worker.router.response_reader import ProtocolError, ResponseReader

# NOTE: under uvicorn's keep-alive timeout (5 s, vLLM's and pdfleet's workers): a connection the worker is about to
# close is not reused.
KEEPALIVE_EXPIRY_S = 4.0
MAX_IDLE_PER_WORKER = 64
HIGH_WATER = 1 << 18  # decoded bytes waiting for the reader before the socket stops being read
Origin = tuple[str, str, int]  # scheme, host, port


def encode_json(body: Any) -> bytes:
    """A request body as httpx's `json=` encodes it."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


class StreamClient:
    def __init__(self, connect_timeout_s: float, ssl_context: ssl.SSLContext | None = None):
        self.connect_timeout_s = connect_timeout_s
        self._ssl = ssl_context
        self._idle: dict[Origin, list[_Connection]] = {}
        self.connections_opened = 0

    async def open(
        self,
        url: str,
        path: str,
        body: bytes,
        headers: dict[str, str] | None = None,
        read_timeout_s: float = 600.0,
        heartbeat_s: float = 0.0,
        auth: httpx.Auth | None = None,
    ) -> Stream:
        """POST `body` (JSON) to url + path: the answer once its head has come (status and headers), its body to be
        read with next() or aread(); the caller closes it. `read_timeout_s`: the longest silence while waiting for
        bytes; `heartbeat_s`: next() returns b'' after that long without bytes (0: never); `auth`: an httpx.Auth whose
        flow reads only the status (the deployment token: a 401 tries the previous token)."""
        headers = dict(headers or {})
        if auth is None:
            return await self._send(url, path, body, headers, read_timeout_s, heartbeat_s)
        flow = auth.auth_flow(httpx.Request("POST", url + path, headers=headers))
        request = next(flow)
        while True:
            sent = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
            stream = await self._send(url, path, body, sent, read_timeout_s, heartbeat_s)
            try:
                request = flow.send(stream)  # type: ignore[arg-type]  # the flow reads .status_code
            except StopIteration:
                return stream
            try:
                await stream.aread()
            finally:
                stream.close()

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.transport.close()
        self._idle.clear()

    # -- one request -------------------------------------------------------------------------------------
    async def _send(
        self, url: str, path: str, body: bytes, headers: dict[str, str], read_timeout_s: float, heartbeat_s: float
    ) -> Stream:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise httpx.UnsupportedProtocol(f"not an http(s) URL: {url!r}")
        origin = (parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
        host = parts.netloc.rpartition("@")[2]
        lines = [f"POST {parts.path.rstrip('/')}{path} HTTP/1.1", f"host: {host}", f"content-length: {len(body)}"]
        lines += ["content-type: application/json", "accept: text/event-stream, */*", "accept-encoding: identity"]
        lines += [f"{k}: {v}" for k, v in headers.items() if k.lower() not in ("content-type", "content-length")]
        if any("\r" in line or "\n" in line for line in lines):
            raise ValueError(f"a line break in the request line or a header to {host}: {lines!r}")
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
        for attempt in range(2):
            conn = self._take_idle(origin) if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = await self._connect(origin)
            stream = Stream(self, conn, read_timeout_s, heartbeat_s)
            conn.start(request)
            try:
                await stream.wait_head()
                return stream
            except (httpx.RemoteProtocolError, httpx.ReadError):
                stream.close()
                if reused and not conn.got_bytes:
                    continue  # the worker closed this kept-alive connection as we sent: once more on a new one
                raise
            except BaseException:
                stream.close()
                raise
        raise AssertionError("unreachable: the second attempt uses a new connection")

    async def _connect(self, origin: Origin) -> _Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        if scheme == "https" and self._ssl is None:
            self._ssl = httpx.create_ssl_context()  # httpx's trust store, loaded once
        context = self._ssl if scheme == "https" else None
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(self, origin),
                    host,
                    port,
                    ssl=context,
                    server_hostname=host if context else None,
                ),
                self.connect_timeout_s,
            )
        except TimeoutError as e:
            raise httpx.ConnectTimeout(f"no connection to {host}:{port} within {self.connect_timeout_s:g}s") from e
        except (OSError, ssl.SSLError) as e:
            raise httpx.ConnectError(str(e) or type(e).__name__) from e
        self.connections_opened += 1
        return conn

    # -- the pool ----------------------------------------------------------------------------------------
    def _take_idle(self, origin: Origin) -> _Connection | None:
        conns = self._idle.get(origin)
        now = asyncio.get_running_loop().time()
        while conns:
            conn = conns.pop()
            if not conn.closed and now - conn.idle_since < KEEPALIVE_EXPIRY_S:
                return conn
            conn.transport.close()
        return None

    def release(self, conn: _Connection) -> None:
        """A connection whose response was read whole: kept for the next request to its worker."""
        conns = self._idle.setdefault(conn.origin, [])
        if conn.closed or len(conns) >= MAX_IDLE_PER_WORKER:
            conn.transport.close()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        conns.append(conn)

    def forget(self, conn: _Connection) -> None:
        conns = self._idle.get(conn.origin)
        if conns and conn in conns:
            conns.remove(conn)


class _Connection(asyncio.Protocol):
    """One TCP connection to a worker: the response in flight is decoded as bytes come; the waiting reader is woken."""

    def __init__(self, client: StreamClient, origin: Origin):
        self.client, self.origin = client, origin
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set by connection_made
        self.reader: ResponseReader | None = None
        self.waiter: asyncio.Future[bool] | None = None
        self.error: httpx.HTTPError | None = None
        self.closed = self.paused = self.got_bytes = False
        self.last_rx = self.idle_since = 0.0

    def start(self, request: bytes) -> None:
        self.reader, self.error, self.got_bytes = ResponseReader(), None, False
        self.last_rx = self.loop.time()
        if self.paused:
            self.transport.resume_reading()
            self.paused = False
        self.transport.write(request)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        if reader is None or reader.complete:  # bytes nobody asked for: the connection is not reusable
            self.transport.close()
            return
        self.last_rx = self.loop.time()
        self.got_bytes = True
        try:
            reader.feed(data)
        except ProtocolError as e:
            self.fail(httpx.RemoteProtocolError(str(e)))
            self.transport.close()
            return
        if reader.buffered > HIGH_WATER and not self.paused:
            self.transport.pause_reading()
            self.paused = True
        self.wake()

    def eof_received(self) -> bool:
        reader = self.reader
        if reader is not None and not reader.complete:
            try:
                reader.eof()
            except ProtocolError as e:
                self.fail(httpx.RemoteProtocolError(str(e)))
            self.wake()
        return False  # the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.client.forget(self)
        reader = self.reader
        if reader is not None and not reader.complete and self.error is None:
            if exc is not None:
                self.fail(httpx.ReadError(f"{type(exc).__name__}: {exc}"))
            else:
                self.fail(httpx.RemoteProtocolError("the worker closed the connection"))
        self.wake()

    def fail(self, error: httpx.HTTPError) -> None:
        if self.error is None:
            self.error = error

    def wake(self, beat: bool = False) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(beat)


class Stream:
    """One worker's answer being read: status and headers, then body bytes as they come."""

    def __init__(self, client: StreamClient, conn: _Connection, read_timeout_s: float, heartbeat_s: float):
        self._client, self._conn = client, conn
        self.read_timeout_s, self.heartbeat_s = read_timeout_s, heartbeat_s
        self.status_code = 0
        self.headers: dict[str, str] = {}
        self.is_closed = False
        self._beats = False  # heartbeats start with the body
        self._wait_since = self._last_beat = 0.0
        self._timer: asyncio.TimerHandle | None = None

    async def wait_head(self) -> None:
        conn = self._conn
        reader = conn.reader
        assert reader is not None
        while reader.head is None:
            if conn.error is not None:
                raise conn.error
            if conn.closed:
                raise httpx.RemoteProtocolError("the worker closed the connection")
            await self._wait()
        self.status_code, self.headers = reader.head.status, reader.head.headers
        self._beats = self.heartbeat_s > 0
        self._last_beat = conn.loop.time()

    async def next(self) -> bytes | None:
        """The body bytes that came since the last call (waiting for some); b'' when a heartbeat is due instead
        (heartbeat_s without bytes); None at the end of the body. httpx.HTTPError if the worker fails or stays
        silent for read_timeout_s."""
        conn = self._conn
        reader = conn.reader
        assert reader is not None and not self.is_closed, "next() on a closed stream"
        while True:
            if reader.body:
                data = reader.take()
                if conn.paused:
                    conn.transport.resume_reading()
                    conn.paused = False
                return data
            if conn.error is not None:
                raise conn.error
            if reader.complete:
                return None
            if conn.closed:
                raise httpx.RemoteProtocolError("the worker closed the connection")
            if await self._wait():
                return b""

    async def aread(self) -> bytes:
        """The rest of the body (no heartbeats)."""
        self._beats = False
        parts = []
        while (data := await self.next()) is not None:
            parts.append(data)
        return b"".join(parts)

    def close(self) -> None:
        """Idempotent: a connection whose response was read whole goes back to the pool, any other is closed (the
        worker sees its client leave and aborts the request)."""
        if self.is_closed:
            return
        self.is_closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        conn = self._conn
        reader, conn.reader = conn.reader, None
        if reader is not None and reader.reusable and conn.error is None and not conn.closed:
            self._client.release(conn)
        else:
            conn.transport.close()

    # -- waiting: one future per wait, one timer per stream ------------------------------------------------
    async def _wait(self) -> bool:
        """Until the connection has news; True when a heartbeat is due instead."""
        conn = self._conn
        waiter = conn.waiter = conn.loop.create_future()
        self._wait_since = now = conn.loop.time()
        due = self._due()
        if self._timer is None or self._timer.when() > due:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = conn.loop.call_at(max(due, now + 0.001), self._tick)
        try:
            return await waiter
        finally:
            conn.waiter = None

    def _due(self) -> float:
        """When the wait in progress times out or its heartbeat is due, whichever comes first."""
        conn = self._conn
        due = max(conn.last_rx, self._wait_since) + self.read_timeout_s
        if self._beats:
            due = min(due, max(conn.last_rx, self._last_beat) + self.heartbeat_s)
        return due

    def _tick(self) -> None:
        """NOTE: the timer moves when it fires, not per byte (bytes that came meanwhile move the deadline it finds),
        so a busy stream costs one timer per interval; a wait re-arms it only when it is due earlier than armed
        (heartbeats start with the body). While nobody waits (the reader is sending to a slow client) it is left
        unarmed."""
        conn = self._conn
        self._timer = None
        if self.is_closed or conn.waiter is None or conn.waiter.done():
            return
        now = conn.loop.time()
        if now - max(conn.last_rx, self._wait_since) >= self.read_timeout_s:
            conn.fail(httpx.ReadTimeout(f"no bytes from the worker for {self.read_timeout_s:g}s"))
            conn.wake()
            return
        if self._beats and now - max(conn.last_rx, self._last_beat) >= self.heartbeat_s:
            self._last_beat = now
            conn.wake(beat=True)
        self._timer = conn.loop.call_at(max(self._due(), now + 0.001), self._tick)
