"""The router of the smaller deployment that query routing sends simple requests to: its served model (probed at
/v1/models), the call that hands it a request, and the relay of its answer; the proxy calls it. No torch.

What comes back is the target's own answer (its `model`, its tokens), marked `x-pdfleet-route: small`. A target that
cannot be reached, or answers anything but 200 before a byte reached the client, returns None: the caller serves
the request with its own pools. The client's Authorization header goes along (the target checks its own keys).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

import httpx
from starlette.responses import Response

from pdfleet_worker.router import sse_events
from pdfleet_worker.router.routing import ROUTED_HEADER
from pdfleet_worker.router.stream_client import Stream, StreamClient, encode_json
from pdfleet_worker.wire import heartbeat
from pdfleet_worker.wire.streaming import SSE_HEADERS, EventStreamResponse

log = logging.getLogger("pdfleet.router")

ROUTE_HEADER = "x-pdfleet-route"


class RouteTarget:
    def __init__(
        self,
        url: str,
        client: httpx.AsyncClient,
        streams: StreamClient,
        probe_interval_s: float,
        heartbeat_interval_s: float,
        read_timeout_s: float,
    ):
        """client: probes and non-streamed calls; streams: streamed ones (read_timeout_s: their longest silence)."""
        self.url = url.rstrip("/")
        self.client, self.streams = client, streams
        self.probe_interval_s = probe_interval_s
        self.heartbeat_interval_s, self.read_timeout_s = heartbeat_interval_s, read_timeout_s
        self.model: str | None = None  # what the target serves (its /v1/models' first id); None: not reachable
        self.last_error = "not probed yet"
        self._task: asyncio.Task | None = None

    @property
    def healthy(self) -> bool:
        return self.model is not None

    async def start(self) -> None:
        await self.probe()
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            await self.probe()

    async def probe(self) -> None:
        # NOTE: /ready, not /v1/models: it is open (the target may require client keys this router has none
        # of) and names the models of the target's default tier.
        try:
            resp = await self.client.get(f"{self.url}/ready", timeout=5.0)
            info = resp.json()
            models = info.get("models") if isinstance(info, dict) else None
            if resp.status_code != 200 or not isinstance(models, list) or not models or not isinstance(models[0], str):
                raise ValueError(f"/ready answered {resp.status_code} without a ready model")
            model = models[0]
        except (httpx.HTTPError, ValueError) as e:
            if self.model is not None:
                log.warning("routing target %s is unavailable: %s", self.url, e)
            self.model, self.last_error = None, f"{type(e).__name__}: {e}"
            return
        if self.model != model:
            log.info("routing target %s serves %s", self.url, model)
        self.model = model

    async def forward(
        self, path: str, body: dict, stream: bool, authorization: str | None, on_end: Callable[[int], None]
    ) -> Response | None:
        """The target's answer, or None (the caller serves the request). on_end(code) runs once when a
        returned stream ends (its final code: 200, an error event's, 502 broken, 499 client gone)."""
        model = self.model
        if model is None:
            return None
        headers = {ROUTED_HEADER: "1"}
        if authorization:
            headers["authorization"] = authorization
        if stream:
            return await self._stream(path, dict(body, model=model), headers, on_end)
        req = self.client.build_request(
            "POST",
            f"{self.url}{path}",
            json=dict(body, model=model),
            headers={"content-type": "application/json", **headers},
        )
        try:
            resp = await self.client.send(req, stream=True)
        except httpx.HTTPError as e:
            return self._unreachable(e)
        try:
            content = await resp.aread()
        except httpx.HTTPError:
            content = None
        finally:
            await resp.aclose()
        if resp.status_code != 200 or content is None:
            log.info("routing target %s answered %d: served here instead", self.url, resp.status_code)
            return None
        on_end(200)
        return Response(
            content,
            status_code=200,
            media_type=resp.headers.get("content-type", "application/json"),
            headers={ROUTE_HEADER: "small"},
        )

    async def _stream(
        self, path: str, body: dict, headers: dict[str, str], on_end: Callable[[int], None]
    ) -> Response | None:
        try:
            resp = await self.streams.open(
                self.url, path, encode_json(body), headers, self.read_timeout_s, self.heartbeat_interval_s
            )
        except httpx.HTTPError as e:
            return self._unreachable(e)
        if resp.status_code != 200 or not resp.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                await resp.aread()
            except httpx.HTTPError:
                pass
            finally:
                resp.close()
            log.info("routing target %s answered %d: served here instead", self.url, resp.status_code)
            return None
        relay = _TargetRelay(resp, on_end)
        return EventStreamResponse(relay.events(), headers={**SSE_HEADERS, ROUTE_HEADER: "small"}, on_close=relay.close)

    def _unreachable(self, e: httpx.HTTPError) -> None:
        log.warning("routing target %s: %s", self.url, e)
        self.model, self.last_error = None, f"{type(e).__name__}: {e}"


class _TargetRelay:
    """The target's SSE bytes, passed on as whole events come (router/sse_events.py), a heartbeat when it is silent;
    a broken stream ends with an error event."""

    def __init__(self, resp: Stream, on_end: Callable[[int], None]):
        self.resp, self.on_end = resp, on_end
        self.code = 499
        self._closed = False

    async def events(self) -> AsyncIterator[bytes]:
        cutter, done, code = sse_events.EventCutter(), False, 200
        try:
            while (data := await self.resp.next()) is not None:
                if not data:  # silent for a heartbeat interval
                    if not cutter.partial:
                        yield heartbeat.KEEP_ALIVE
                    continue
                whole = cutter.cut(data)
                if whole and sse_events.may_end(whole):
                    for event in sse_events.split(whole):
                        if event.startswith(sse_events.DONE):
                            done, self.code = True, code
                        elif event.startswith(sse_events.ERROR):
                            code = _code(event)
                if whole:
                    yield whole
            if not done:
                raise httpx.RemoteProtocolError("the stream ended without [DONE]")
            self.code = code
        except httpx.HTTPError as e:
            self.code = 502
            log.warning("routing target failed mid-stream: %s", e)
            body = {
                "error": {
                    "message": f"the routing target failed mid-stream ({type(e).__name__}); the response is incomplete",
                    "type": "upstream_error",
                    "param": None,
                    "code": 502,
                }
            }
            yield b"data: " + json.dumps(body).encode() + b"\n\n"
        finally:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.resp.close()
        self.on_end(self.code)


def _code(event: bytes) -> int:
    try:
        code = json.loads(event[len(b"data: ") :])["error"].get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return 500
    return code if isinstance(code, int) and 400 <= code < 600 else 500
