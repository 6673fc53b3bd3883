"""One client request through the router: tier choice, prefill -> decode orchestration or colocated passthrough, retries before the first byte, SSE relay with an error event when a worker dies mid-stream; the router app calls it."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response

from pdfleet_worker.kv_transfer.params import DO_REMOTE_DECODE
from pdfleet_worker.router.router_config import RouterConfig
from pdfleet_worker.router.router_metrics import RouterMetrics
from pdfleet_worker.router.upstreams import Upstream, Upstreams
from pdfleet_worker.server import protocol as p
from pdfleet_worker.server.protocol import RequestError
from pdfleet_worker.server.streaming import SSE_HEADERS, EventStreamResponse, read_json, sse

log = logging.getLogger("pdfleet.router")

# Failures where the worker cannot have started answering: safe to try another one.
RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.RemoteProtocolError,
             httpx.ReadError, httpx.WriteError)


@dataclasses.dataclass
class Answer:
    """A worker's complete (non-streamed) answer."""

    upstream: Upstream
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Router:
    def __init__(self, cfg: RouterConfig, upstreams: Upstreams, metrics: RouterMetrics, client: httpx.AsyncClient):
        self.cfg = cfg
        self.upstreams = upstreams
        self.metrics = metrics
        self.client = client
        self.active = 0  # client requests not yet fully answered

    # -- entry ----------------------------------------------------------------------------------
    async def handle(self, request: Request, path: str) -> Response:
        self.active += 1
        streaming = False
        try:
            response = await self._handle(request, path)
            streaming = isinstance(response, EventStreamResponse)
            return response
        finally:
            if not streaming:  # a stream's relay decrements when it ends
                self.active -= 1

    async def _handle(self, request: Request, path: str) -> Response:
        start = time.monotonic()
        tier = self.cfg.default_tier
        try:
            body = await read_json(request, self.cfg.max_request_bytes)
            if not isinstance(body, dict):
                raise RequestError(400, "the request body must be a JSON object")
            tier = self._tier(request, body)
            if body.get("kv_transfer_params") is not None:
                raise RequestError(400, "kv_transfer_params is set by the router, not by clients",
                                   param="kv_transfer_params")
            stream = body.get("stream") is True
            headers = {"x-pdfleet-tier": tier}
            if self.cfg.tiers[tier].disaggregated:
                response = await self._disaggregated(path, body, stream, tier, headers, start)
            else:
                response = await self._forward(tier, "both", path, body, stream, headers, start)
        except RequestError as e:
            self.metrics.finished(tier, e.status, start)
            return Response(json.dumps(e.body()), status_code=e.status, media_type="application/json",
                            headers=e.headers)
        return response

    def _tier(self, request: Request, body: dict) -> str:
        named = request.headers.get(self.cfg.tier_header)
        if named is not None:
            if named not in self.cfg.tiers:
                raise RequestError(400, f"unknown tier {named!r} in {self.cfg.tier_header}; tiers: "
                                        f"{', '.join(sorted(self.cfg.tiers))}", param=self.cfg.tier_header)
            return named
        model = body.get("model")
        if isinstance(model, str):
            if model in self.cfg.aliases:
                tier = self.cfg.aliases[model]
                served = self.upstreams.served_model(tier)
                if served is not None:
                    body["model"] = served  # the workers know their own name only
                return tier
            tier = self.upstreams.models().get(model)
            if tier is not None:
                return tier
        return self.cfg.default_tier

    # -- PD: prefill, then decode ---------------------------------------------------------------
    async def _disaggregated(self, path: str, body: dict, stream: bool, tier: str, headers: dict[str, str],
                             start: float) -> Response:
        prefill_body = dict(body, stream=False, n=1, max_tokens=1, kv_transfer_params={DO_REMOTE_DECODE: True})
        for key in ("stream_options", "max_completion_tokens"):
            prefill_body.pop(key, None)
        answer = await self._call(tier, "prefill", path, prefill_body)
        headers["x-pdfleet-prefill"] = answer.upstream.url
        if answer.status != 200:  # the request's own fault (400, 404, ...): the client gets it as is
            return self._relay_answer(answer, tier, headers, start)
        try:
            params = answer.json()["kv_transfer_params"]
        except (ValueError, KeyError, TypeError):
            self.metrics.upstream_error("prefill", "bad_response")
            raise RequestError(502, f"prefill worker {answer.upstream.url} returned no kv_transfer_params",
                               type="upstream_error") from None
        decode_body = dict(body, kv_transfer_params=params)
        return await self._forward(tier, "decode", path, decode_body, stream, headers, start)

    # -- one pool -------------------------------------------------------------------------------
    async def _forward(self, tier: str, role: str, path: str, body: dict, stream: bool, headers: dict[str, str],
                       start: float) -> Response:
        header = "x-pdfleet-decode" if role == "decode" else "x-pdfleet-worker"
        if not stream:
            answer = await self._call(tier, role, path, body)
            headers[header] = answer.upstream.url
            return self._relay_answer(answer, tier, headers, start)
        up, resp = await self._open_stream(tier, role, path, body)
        headers[header] = up.url
        if resp.status_code != 200 or not resp.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                content = await resp.aread()
            finally:
                await resp.aclose()
                up.inflight -= 1
            return self._relay_answer(Answer(up, resp.status_code, dict(resp.headers), content), tier, headers, start)
        relay = _Relay(self, up, resp, tier, start)
        return EventStreamResponse(relay.events(), headers={**SSE_HEADERS, **headers}, on_close=relay.close)

    def _relay_answer(self, answer: Answer, tier: str, headers: dict[str, str], start: float) -> Response:
        self.metrics.finished(tier, answer.status, start)
        keep = {k: v for k, v in answer.headers.items() if k.lower() in ("retry-after",)}
        return Response(answer.body, status_code=answer.status, headers={**keep, **headers},
                        media_type=answer.headers.get("content-type", "application/json"))

    # -- calling workers with retries -------------------------------------------------------------
    async def _call(self, tier: str, role: str, path: str, body: dict) -> Answer:
        """A complete answer from some worker of the pool; connect failures, broken connections
        and 503s are retried on another worker (nothing reached the client yet)."""
        async def attempt(up: Upstream) -> Answer:
            resp = await self.client.send(self._request(up, path, body), stream=True)
            try:
                content = await resp.aread()
            finally:
                await resp.aclose()
            return Answer(up, resp.status_code, dict(resp.headers), content)

        return await self._with_retries(tier, role, attempt)

    async def _open_stream(self, tier: str, role: str, path: str, body: dict) -> tuple[Upstream, httpx.Response]:
        """An open streaming response (headers read); the caller closes it and decrements inflight."""
        async def attempt(up: Upstream):
            resp = await self.client.send(self._request(up, path, body), stream=True)
            if resp.status_code == 503:
                try:
                    content = await resp.aread()
                finally:
                    await resp.aclose()
                return Answer(up, 503, dict(resp.headers), content)
            up.inflight += 1  # held until the relay ends
            return up, resp

        return await self._with_retries(tier, role, attempt)

    async def _with_retries(self, tier: str, role: str, attempt):
        tried: set[str] = set()
        last_503: Answer | None = None
        errors: list[str] = []
        for n in range(1 + self.cfg.max_retries):
            up = self.upstreams.pick(tier, role, tried)
            if up is None:
                break
            tried.add(up.url)
            if n:
                self.metrics.retry(role)
            up.inflight += 1
            try:
                result = await attempt(up)
            except RETRYABLE as e:
                self.metrics.upstream_error(role, "connect" if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout))
                                            else "disconnected")
                self.upstreams.mark_down(up, f"{type(e).__name__}: {e}")
                errors.append(f"{up.url}: {type(e).__name__}")
                continue
            except httpx.TimeoutException as e:
                self.metrics.upstream_error(role, "timeout")
                raise RequestError(504, f"{role} worker {up.url} did not answer within "
                                        f"{self.cfg.upstream_timeout_s:g}s", type="upstream_error") from e
            finally:
                up.inflight -= 1
            if isinstance(result, Answer) and result.status == 503:
                self.metrics.upstream_error(role, "unavailable")
                last_503 = result
                errors.append(f"{up.url}: 503")
                continue
            return result
        if last_503 is not None:
            return last_503  # every worker is overloaded or draining: pass their 503 + Retry-After on
        what = f"no healthy {role} worker in tier {tier!r}" if not errors else \
            f"every {role} worker tried failed ({'; '.join(errors)})"
        raise RequestError(503, what, type="service_unavailable", code="no_worker",
                           headers={"Retry-After": str(self.cfg.retry_after_s)})

    def _request(self, up: Upstream, path: str, body: dict) -> httpx.Request:
        return self.client.build_request("POST", f"{up.url}{path}", json=body,
                                         headers={"content-type": "application/json"})


def _error_code(event: bytes) -> int:
    try:
        code = json.loads(event[len(b"data: "):])["error"].get("code")
    except (ValueError, KeyError, AttributeError):
        return 500
    return code if isinstance(code, int) and 400 <= code < 600 else 500


class _Relay:
    """Forwards a worker's SSE events whole; a broken worker becomes an error event and leaves
    rotation. close() settles the bookkeeping once, whether or not events() ever ran."""

    def __init__(self, router: Router, up: Upstream, resp: httpx.Response, tier: str, start: float):
        self.router, self.up, self.resp, self.tier, self.start = router, up, resp, tier, start
        self.code = 499  # until the stream ends otherwise, the client went away
        self._closed = False

    async def events(self) -> AsyncIterator[bytes]:
        up, metrics = self.up, self.router.metrics
        first, done, buf, code = True, False, b"", 200
        try:
            async for chunk in self.resp.aiter_raw():
                buf += chunk
                while (i := buf.find(b"\n\n")) >= 0:
                    event, buf = buf[:i + 2], buf[i + 2:]
                    if first:
                        metrics.first_token(self.tier, self.start)
                        first = False
                    if event.startswith(b"data: [DONE]"):
                        # The answer is whole once [DONE] is relayed: a client that closes right after it
                        # was served, not dropped (499 would count a served request as a client abort).
                        done, self.code = True, code
                    elif event.startswith(b'data: {"error"'):
                        code = _error_code(event)
                    yield event
            if not done:
                raise httpx.RemoteProtocolError("the stream ended without [DONE]")
            self.code = code
        except httpx.HTTPError as e:
            self.code = 502
            metrics.upstream_error(up.role, "timeout" if isinstance(e, httpx.TimeoutException) else "stream_broken")
            self.router.upstreams.mark_down(up, f"failed mid-stream: {type(e).__name__}: {e}")
            log.warning("%s worker %s failed mid-stream: %s", up.role, up.url, e)
            yield sse(p.error_body(f"the {up.role} worker {up.url} failed mid-stream ({type(e).__name__}: {e}); "
                                   f"the response is incomplete", "upstream_error", code=502))
        finally:
            await self.resp.aclose()
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.up.inflight -= 1
        self.router.active -= 1
        if not self.resp.is_closed:
            asyncio.ensure_future(self.resp.aclose())
        self.router.metrics.finished(self.tier, self.code, self.start)
