"""One client request through the router: validation against the tier's limits before any work, tier choice, prefill ->
decode orchestration in the tier engine's own protocol (handoff.py) or colocated passthrough, retries before the first
byte, SSE relay with an error event when a worker dies mid-stream, cancellation when the client leaves; what reaches the
client never names a worker's address. The router app calls it."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import re
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response

from pdfleet_worker.router import engines, handoff, pairing, routing, sse_events
from pdfleet_worker.router.route_target import ROUTE_HEADER, RouteTarget
from pdfleet_worker.router.router_config import RouterConfig
from pdfleet_worker.router.router_metrics import (
    NO_PAIR,
    NO_PREFILL,
    OUTCOME,
    PREFILL_POOL,
    SHORT_PROMPT,
    Outcome,
    RouterMetrics,
)
from pdfleet_worker.router.stream_client import Stream, StreamClient, encode_json
from pdfleet_worker.router.upstreams import Upstream, Upstreams
from pdfleet_worker.wire import checks, heartbeat, limits
from pdfleet_worker.wire import request_types as rq
from pdfleet_worker.wire.errors import RequestError, error_body, shown
from pdfleet_worker.wire.streaming import (
    SSE_HEADERS,
    ClientGone,
    EventStreamResponse,
    internal_error_response,
    read_json,
    sse,
    until_disconnect,
)

log = logging.getLogger("pdfleet.router")

CHAT_PATH = "/v1/chat/completions"
# Failures where the worker cannot have started answering: safe to try another one.
RETRYABLE = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
)
Match = Callable[[Upstream], bool]  # which workers of a pool a call may use (pairing)


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
    def __init__(
        self,
        cfg: RouterConfig,
        upstreams: Upstreams,
        metrics: RouterMetrics,
        client: httpx.AsyncClient,
        rules: routing.Routing | None = None,
        target: RouteTarget | None = None,
        streams: StreamClient | None = None,
    ):
        """client: non-streamed calls; streams: streamed ones (the app shares one with the routing target)."""
        self.cfg = cfg
        self.rules, self.target = rules, target  # query routing (both or neither)
        if rules is not None:  # every route's series from the start (rate() over a series that appears later misses it)
            for route, reasons in routing.REASONS.items():
                for reason in reasons:
                    metrics.routed(route, reason, 0)
        self.upstreams = upstreams
        self.metrics = metrics
        self.client = client
        self.streams = streams if streams is not None else StreamClient(cfg.connect_timeout_s)
        self.active = 0  # client requests not yet fully answered
        self._id_key = os.urandom(16)
        self._limits_kept: dict[str, tuple[list[dict], limits.Limits | None]] = {}  # tier -> (loads, strictest)

    def worker_id(self, url: str) -> str:
        """What clients see of a worker (response headers): stable while this router runs, and no
        address; /workers maps it back for an operator."""
        return hmac.new(self._id_key, url.encode(), hashlib.sha256).hexdigest()[:12]

    # -- entry ----------------------------------------------------------------------------------
    async def handle(self, request: Request, path: str) -> Response:
        """Never raises: every answer is an OpenAI error object or the worker's; the app's counting
        middleware reads the tier and a stream's final code from the request's Outcome."""
        outcome: Outcome = request.scope.setdefault(OUTCOME, Outcome(self.cfg.default_tier))
        self.active += 1
        streaming = False
        try:
            body = await read_json(request, self.cfg.max_request_bytes)
            if not isinstance(body, dict):
                raise RequestError(400, "the request body must be a JSON object")
            outcome.tier = self._tier(request, body)
            if body.get("kv_transfer_params") is not None:
                raise RequestError(
                    400, "kv_transfer_params is set by the router, not by clients", param="kv_transfer_params"
                )
            stream = self._validate(outcome.tier, body, path == CHAT_PATH)
            # NOTE: the body is read, so the next receive() is the disconnect: a client that leaves while a
            # worker computes (prefill, queue, a whole non-streamed answer) cancels that call, and the worker,
            # seeing its connection close, aborts the request.
            answer = self._answer(request, outcome, path, body, stream)
            if stream and self.cfg.heartbeat_interval_s > 0:
                answer = self._beating(outcome, answer)
            response = await until_disconnect(request, answer)
            streaming = isinstance(response, EventStreamResponse)
            return response
        except RequestError as e:
            return Response(
                json.dumps(e.body()), status_code=e.status, media_type="application/json", headers=e.headers
            )
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; counted as the client's abort
        except Exception as e:  # a bug: counted as a 500 like any other answer, its details logged only
            return internal_error_response(request.method, path, e)
        finally:
            if not streaming:  # a stream's relay decrements when it ends
                self.active -= 1

    def _tier(self, request: Request, body: dict) -> str:
        named = request.headers.get(self.cfg.tier_header)
        if named is not None:
            if named not in self.cfg.tiers:
                raise RequestError(
                    400,
                    f"unknown tier {shown(named)} in {self.cfg.tier_header}; tiers: "
                    f"{', '.join(sorted(self.cfg.tiers))}",
                    param=self.cfg.tier_header,
                )
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

    def _validate(self, tier: str, body: dict, chat: bool) -> bool:
        """The worker's own checks (protocol.check) against the strictest limits the tier's workers
        report, before any worker is called; returns whether the client asked for a stream.
        NOTE: a tier with a vLLM worker, or whose workers have not reported yet, is left to its workers
        (they accept what they accept); the prefill worker checks the whole request before its prefill."""
        strictest = self._tier_limits(tier)
        if strictest is None:
            return body.get("stream") is True
        req = rq.parse(rq.ChatCompletionRequest if chat else rq.CompletionRequest, body)
        checks.check(req, strictest)
        return req.stream

    def _tier_limits(self, tier: str) -> limits.Limits | None:
        """The strictest limits the tier's workers report; None if none has reported or one is not pdfleet's.
        Kept until a probe replaces a worker's load (a new dict each time) or the tier's workers change: between
        probes every request would compute the same (a PD tier's two pools cost a short prompt's route more)."""
        ups = self.upstreams.of_tier(tier)
        loads = [up.load for up in ups]
        kept = self._limits_kept.get(tier)
        if kept is not None and len(kept[0]) == len(loads) and all(a is b for a, b in zip(kept[0], loads)):
            return kept[1]
        reported = [ld["limits"] for ld in loads if isinstance(ld.get("limits"), dict)]
        strictest = None
        if reported and all(getattr(up, "engine", engines.PDFLEET) == engines.PDFLEET for up in ups):
            strictest = limits.Limits.strictest([limits.Limits.from_json(raw) for raw in reported])
        # NOTE: the loads themselves are kept, not their ids: a freed dict's id may come back for another
        self._limits_kept[tier] = (loads, strictest)
        return strictest

    # -- query routing and heartbeats -------------------------------------------------------------
    async def _answer(self, request: Request, outcome: Outcome, path: str, body: dict, stream: bool) -> Response:
        """The smaller model's answer when query routing judges the request simple, else this deployment's."""
        if self.rules is not None and self.target is not None:
            decision = await self._judge(request, path, body)
            if decision.route == routing.SMALL:

                def ended(code: int) -> None:
                    outcome.code = code
                    if stream:
                        self.active -= 1  # the routed stream is over (handle() leaves streams to their close)

                answer = await self.target.forward(path, body, stream, request.headers.get("authorization"), ended)
                if answer is not None:
                    self.metrics.routed(routing.SMALL, decision.reason)
                    return answer
                decision = routing.Decision(routing.DEFAULT, "target_refused")
            self.metrics.routed(routing.DEFAULT, decision.reason)
            response = await self._route(outcome, path, body, stream)
            response.headers[ROUTE_HEADER] = routing.DEFAULT
            return response
        return await self._route(outcome, path, body, stream)

    async def _judge(self, request: Request, path: str, body: dict) -> routing.Decision:
        assert self.rules is not None and self.target is not None
        if request.headers.get(routing.ROUTED_HEADER):
            return routing.Decision(routing.DEFAULT, "already_routed")  # another router routed it here
        judged = self.rules.request(path, body)
        if isinstance(judged, routing.Decision):
            return judged
        if not self.target.healthy:
            return routing.Decision(routing.DEFAULT, "target_unavailable")
        if self.rules.classifier is None:
            return routing.Decision(routing.SMALL, "rules")
        try:
            # NOTE: on a thread: a classifier may run a model; the event loop keeps serving meanwhile.
            answer = await asyncio.wait_for(
                asyncio.to_thread(self.rules.classifier, judged), self.cfg.route_classifier_timeout_s
            )
        except Exception as e:  # its bug or its timeout: the big model serves
            log.warning("routing classifier %s failed: %s: %s", self.cfg.route_classifier, type(e).__name__, e)
            return routing.Decision(routing.DEFAULT, "classifier_error")
        return self.rules.judge(answer)

    async def _beating(self, outcome: Outcome, answer) -> Response:
        """A stream's answer if it comes within one heartbeat interval (its real status code); else a 200 stream
        of `: keep-alive` comments until it comes, then its events (an error answer becomes an error event)."""
        interval = self.cfg.heartbeat_interval_s
        fut, came = await heartbeat.wait_or_beat(answer, interval)
        if came:
            return fut.result()
        state = {"inner": None, "settled": False}

        def settle() -> None:  # once, however the stream ends: the inner stream's close, else our own count
            if state["settled"]:
                return
            state["settled"] = True
            if not fut.done():
                fut.cancel()
            inner = state["inner"]
            if inner is None and fut.done() and not fut.cancelled() and fut.exception() is None:
                inner = fut.result()
            if isinstance(inner, EventStreamResponse) and inner.on_close is not None:
                inner.on_close()
            else:
                self.active -= 1
                if outcome.code is None:
                    outcome.code = 499

        async def events() -> AsyncIterator[bytes]:
            try:
                async for beat in heartbeat.beat_until(fut, interval):
                    yield beat
                try:
                    resp = fut.result()
                except RequestError as e:
                    outcome.code = e.status
                    yield sse(e.body())
                    yield b"data: [DONE]\n\n"
                    return
                except Exception as e:  # a bug: the details go to the log only, as for any 500
                    incident = uuid.uuid4().hex[:12]
                    log.error("unhandled error while a stream waited (incident %s)", incident, exc_info=e)
                    outcome.code = 500
                    yield sse(error_body(f"internal server error (incident {incident})", "server_error", code=500))
                    yield b"data: [DONE]\n\n"
                    return
                if isinstance(resp, EventStreamResponse):
                    state["inner"] = resp
                    try:
                        async for event in resp.events:
                            yield event
                    finally:
                        await resp.events.aclose()
                    return
                # a complete answer after the wait: its error object (or a 200 body) as one event
                outcome.code = resp.status_code
                yield b"data: " + resp.body + b"\n\n"
                yield b"data: [DONE]\n\n"
            finally:
                settle()

        return EventStreamResponse(events(), headers={**SSE_HEADERS, "x-pdfleet-tier": outcome.tier}, on_close=settle)

    async def _route(self, outcome: Outcome, path: str, body: dict, stream: bool) -> Response:
        tier = outcome.tier
        headers = {"x-pdfleet-tier": tier}
        if not self.cfg.tiers[tier].disaggregated:
            return await self._forward(outcome, "both", path, body, stream, headers)
        if self._short(path, body) and self.upstreams.has_healthy(tier, "decode"):
            # Disaggregate only where it pays: a short prompt costs a decode worker less than the hand-off costs
            # the request (the threshold comes from the operator's cost model, decide/pd_threshold.py).
            # NOTE: decided here, first, with no more work than it needs: this route must cost what a colocated
            # request costs (bench/pd.py, short prompts); the pools' lists of _disaggregated are the hand-off's.
            self.metrics.pd_route(tier, SHORT_PROMPT)
            headers["x-pdfleet-prefill"] = "local"
            return await self._forward(outcome, "decode", path, body, stream, headers)
        return await self._disaggregated(outcome, path, body, stream, headers)

    # -- PD: prefill, then decode ---------------------------------------------------------------
    async def _disaggregated(
        self, outcome: Outcome, path: str, body: dict, stream: bool, headers: dict[str, str]
    ) -> Response:
        """The tier's engine's own hand-off (router/handoff.py): prefill with kv_transfer_params asking it to
        hold the KV, then the client's request to a decode worker with the params the prefill answered. (A short
        prompt never comes here: _route sends it to a decode worker.)"""
        tier = outcome.tier
        engine = self.cfg.tiers[tier].pd_engine
        prefills, decodes = self.upstreams.healthy(tier, "prefill"), self.upstreams.healthy(tier, "decode")
        if not prefills and decodes:
            # Decoders as temporary prefillers: with no prefill worker in rotation (its pool replaced by a rollout
            # or a rollback, every replica loading the model) the decode worker computes the prompt itself, as a
            # colocated worker would: slower first tokens, not 503s. Counted.
            return await self._local_prefill(outcome, path, body, stream, headers, NO_PREFILL)
        if prefills and not decodes and engine == engines.PDFLEET:
            # Prefillers as temporary decoders, the same the other way round: no decode worker in rotation (the only
            # one died and restarts, its pool rolls): a prefill worker serves the whole request.
            return await self._local_decode(outcome, path, body, stream, headers)
        # Pairs by revision and KV layout (router/pairing.py): a rollout's old prefill never hands KV to a new decode.
        pairs = pairing.plan([up.load for up in prefills], [up.load for up in decodes])
        if not pairs.paired:
            return await self._local_prefill(outcome, path, body, stream, headers, NO_PAIR)
        self.metrics.pd_route(tier, PREFILL_POOL)
        # NOTE: one X-Request-Id on both calls, as vLLM's proxy sends: each worker's logs name the same request.
        ids = {"x-request-id": f"pdfleet-{uuid.uuid4().hex}"} if engine == engines.VLLM else {}
        answer = await self._call(
            tier, "prefill", path, handoff.prefill_body(engine, body), ids, match=lambda up: pairs.allows(up.load)
        )
        headers["x-pdfleet-prefill"] = self.worker_id(answer.upstream.url)
        if (
            answer.status != 200
        ):  # the request's own fault (400, 404, ...), or every prefill worker busy: the client gets it
            outcome.served_by(answer.upstream.load.get("revision"), shed=answer.status == 503)
            return self._relay_answer(answer, headers)
        try:
            hand = handoff.from_prefill(engine, answer.json())
        except ValueError as e:  # not JSON, or no usable kv_transfer_params
            self.metrics.upstream_error("prefill", "bad_response")
            log.warning("%s prefill worker %s: %s", engine, answer.upstream.url, e)
            raise RequestError(
                502, "the prefill worker returned no kv_transfer_params", type="upstream_error"
            ) from None
        if hand.params is None:
            # The answer stays right (the decode worker computes the prompt), but PD bought nothing: count it.
            self.metrics.upstream_error("prefill", "no_kv_transfer_params")
            log.warning(
                "%s prefill worker %s returned no kv_transfer_params (is its KV connector configured?); "
                "the decode worker computes the prompt",
                engine,
                answer.upstream.url,
            )
        prefilled = answer.upstream.load
        try:
            # NOTE: a decode worker of the prefill worker's revision and layout if one is still in rotation, else any
            # (it refuses KV of other weights and computes the prompt itself, counted as weights_mismatch there).
            return await self._forward(
                outcome,
                "decode",
                path,
                handoff.decode_body(body, hand),
                stream,
                headers,
                also_redact=hand.hosts,
                extra_headers=ids,
                match=lambda up: pairing.same(prefilled, up.load),
            )
        except RequestError as e:
            if e.code != "no_worker" or engine != engines.PDFLEET or not self.upstreams.has_healthy(tier, "prefill"):
                raise
        # Every decode worker left between the prefill and the decode call (the lease expires on its own).
        return await self._local_decode(outcome, path, body, stream, headers)

    def _short(self, path: str, body: dict) -> bool:
        """Fewer prompt tokens than --pd-min-prompt-tokens (never, when it is 0 or the prompt cannot be measured)."""
        if self.cfg.pd_min_prompt_tokens <= 0:
            return False
        counter = self.rules.count_tokens if self.rules is not None else None
        n = routing.prompt_length(path, body, counter)
        return n is not None and n < self.cfg.pd_min_prompt_tokens

    async def _local_prefill(
        self, outcome: Outcome, path: str, body: dict, stream: bool, headers: dict[str, str], reason: str
    ) -> Response:
        self.metrics.local_prefill(outcome.tier, reason)
        headers["x-pdfleet-prefill"] = "local"
        return await self._forward(outcome, "decode", path, body, stream, headers)

    async def _local_decode(
        self, outcome: Outcome, path: str, body: dict, stream: bool, headers: dict[str, str]
    ) -> Response:
        self.metrics.local_decode(outcome.tier)
        headers["x-pdfleet-decode"] = "local"
        return await self._forward(outcome, "prefill", path, body, stream, headers, header="x-pdfleet-prefill")

    # -- one pool -------------------------------------------------------------------------------
    async def _forward(
        self,
        outcome: Outcome,
        role: str,
        path: str,
        body: dict,
        stream: bool,
        headers: dict[str, str],
        also_redact: tuple[str, ...] = (),
        extra_headers: dict[str, str] | None = None,
        match: Match | None = None,
        header: str | None = None,
    ) -> Response:
        """The answer of a worker of `role` (preferring those `match` holds for), relayed; `header` names the
        response header that carries its id."""
        header = header or ("x-pdfleet-decode" if role == "decode" else "x-pdfleet-worker")
        if not stream:
            answer = await self._call(outcome.tier, role, path, body, extra_headers, match=match, prefer=True)
            headers[header] = self.worker_id(answer.upstream.url)
            outcome.served_by(answer.upstream.load.get("revision"), shed=answer.status == 503)
            if role == "decode" and answer.status == 200:
                answer = _scrubbed(answer)
            return self._relay_answer(answer, headers, also_redact)
        up, resp = await self._open_stream(outcome.tier, role, path, body, extra_headers, match=match)
        headers[header] = self.worker_id(up.url)
        outcome.served_by(up.load.get("revision"), shed=resp.status_code == 503)
        if resp.status_code != 200 or not resp.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                content = await resp.aread()
            finally:
                resp.close()
                up.inflight -= 1
            return self._relay_answer(Answer(up, resp.status_code, dict(resp.headers), content), headers, also_redact)
        relay = _Relay(self, up, resp, outcome, also_redact)
        return EventStreamResponse(relay.events(), headers={**SSE_HEADERS, **headers}, on_close=relay.close)

    def _relay_answer(self, answer: Answer, headers: dict[str, str], also_redact: Iterable[str] = ()) -> Response:
        keep = {k: v for k, v in answer.headers.items() if k.lower() in ("retry-after",)}
        if answer.status == 200:
            return Response(
                answer.body,
                status_code=200,
                headers={**keep, **headers},
                media_type=answer.headers.get("content-type", "application/json"),
            )
        body = self.relayed_error(answer.body, answer.upstream, answer.status, also_redact)
        return Response(
            json.dumps(body), status_code=answer.status, headers={**keep, **headers}, media_type="application/json"
        )

    def relayed_error(self, raw: bytes, up: Upstream, status: int, also_redact: Iterable[str] = ()) -> dict[str, Any]:
        """A worker's error object as the client may see it: its four fields, addresses redacted."""
        try:
            err = json.loads(raw)["error"]
            fields = {k: err.get(k) for k in ("message", "type", "param", "code")}
            assert isinstance(fields["message"], str)
        except (ValueError, KeyError, TypeError, AttributeError, AssertionError):
            log.warning("%s worker %s answered %d without an error object: %r", up.role, up.url, status, raw[:200])
            return error_body(f"the {up.role} worker answered {status}", "upstream_error")
        known = [u.url for u in self.upstreams.all.values()] + list(also_redact)
        clean = {
            k: v if isinstance(v, (int, type(None))) or k == "message" else redact(str(v), known)
            for k, v in fields.items()
        }
        clean["message"] = redact(fields["message"], known)
        if clean["message"] != fields["message"]:
            log.info("%s worker %s: %s", up.role, up.url, fields["message"])
        return {"error": clean}

    # -- calling workers with retries -------------------------------------------------------------
    async def _call(
        self,
        tier: str,
        role: str,
        path: str,
        body: dict,
        extra_headers: dict[str, str] | None = None,
        match: Match | None = None,
        prefer: bool = False,
    ) -> Answer:
        """A complete answer from some worker of the pool (those `match` holds for only, or first with `prefer`);
        connect failures, broken connections and 503s are retried on another worker (nothing reached the client yet)."""

        async def attempt(up: Upstream) -> Answer:
            resp = await self.client.send(
                self._request(up, path, body, extra_headers), stream=True, auth=self.upstreams.auth(up)
            )
            try:
                content = await resp.aread()
            finally:
                await resp.aclose()
            return Answer(up, resp.status_code, dict(resp.headers), content)

        return await self._with_retries(tier, role, attempt, match, prefer)

    async def _open_stream(
        self,
        tier: str,
        role: str,
        path: str,
        body: dict,
        extra_headers: dict[str, str] | None = None,
        match: Match | None = None,
    ) -> tuple[Upstream, Stream]:
        """An open streaming response (headers read; workers `match` holds for first); the caller closes it and
        decrements inflight. Its body arrives with a heartbeat due every --heartbeat-interval of silence."""
        content = encode_json(body)

        async def attempt(up: Upstream):
            resp = await self.streams.open(
                up.url,
                path,
                content,
                extra_headers,
                read_timeout_s=stream_read_timeout(self.cfg.upstream_timeout_s, up),
                heartbeat_s=self.cfg.heartbeat_interval_s,
                auth=self.upstreams.auth(up),
            )
            if resp.status_code in (401, 503):
                try:
                    answer = await resp.aread()
                finally:
                    resp.close()
                return Answer(up, resp.status_code, dict(resp.headers), answer)
            up.inflight += 1  # held until the relay ends
            return up, resp

        return await self._with_retries(tier, role, attempt, match, prefer=True)

    async def _with_retries(self, tier: str, role: str, attempt, match: Match | None = None, prefer: bool = False):
        """`match`: only workers it holds for; with `prefer`, those first, then the others."""
        tried: set[str] = set()
        last_503: Answer | None = None
        errors: list[str] = []
        late: dict[str, Upstream] = {}  # its connect timed out once: worth one more try when no other is left
        for n in range(1 + self.cfg.max_retries):
            up = self.upstreams.pick(tier, role, tried, match)
            if up is None and match is not None and prefer:
                up = self.upstreams.pick(tier, role, tried)
            if up is None and late:
                _, up = late.popitem()
            if up is None:
                break
            tried.add(up.url)
            if n:
                self.metrics.retry(role)
            up.inflight += 1
            try:
                result = await attempt(up)
            except RETRYABLE as e:
                self.metrics.upstream_error(
                    role, "connect" if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)) else "disconnected"
                )
                errors.append(type(e).__name__)
                if isinstance(e, httpx.ConnectTimeout) and up.url not in late and errors.count("ConnectTimeout") == 1:
                    # NOTE: a refused connect means nobody listens; a late one, a loaded host (a full accept
                    # queue, or this router's own loop running late on shared cores) more often than a dead one.
                    # The request never reached the worker: it stays in rotation (the probes judge it, as they
                    # judge late answers) and gets one more try if no other worker is left.
                    log.warning("%s worker %s: connect timed out after %gs", role, up.url, self.cfg.connect_timeout_s)
                    late[up.url] = up
                    continue
                self.upstreams.mark_down(up, f"{type(e).__name__}: {e}")
                continue
            except httpx.TimeoutException as e:
                self.metrics.upstream_error(role, "timeout")
                waited = _read_timeout(e, self.cfg.upstream_timeout_s)
                log.warning("%s worker %s did not answer within %gs", role, up.url, waited)
                raise RequestError(
                    504, f"the {role} worker did not answer within {waited:g}s", type="upstream_error"
                ) from e
            finally:
                up.inflight -= 1
            if isinstance(result, Answer) and result.status == 401:
                # The worker refused our deployment token: a misconfiguration, never the client's to see as its own.
                self.metrics.upstream_error(role, "unauthorized")
                self.upstreams.mark_down(up, "401: the worker refused this router's deployment token")
                errors.append("401")
                continue
            if isinstance(result, Answer) and result.status == 503:
                self.metrics.upstream_error(role, "unavailable")
                last_503 = result
                errors.append("503")
                continue
            return result
        if last_503 is not None:
            return last_503  # every worker is overloaded or draining: pass their 503 + Retry-After on
        what = (
            f"no healthy {role} worker in tier {tier!r}"
            if not errors
            else f"every {role} worker tried failed ({len(errors)}: {', '.join(errors)})"
        )
        raise RequestError(
            503,
            what,
            type="service_unavailable",
            code="no_worker",
            headers={"Retry-After": str(self.cfg.retry_after_s)},
        )

    def _request(
        self, up: Upstream, path: str, body: dict, extra_headers: dict[str, str] | None = None
    ) -> httpx.Request:
        """A non-streamed call, with the pool's timeouts (--upstream-timeout, --connect-timeout)."""
        return self.client.build_request(
            "POST", f"{up.url}{path}", json=body, headers={"content-type": "application/json", **(extra_headers or {})}
        )


# A pdfleet worker's stream is silent for at most one heartbeat interval: its keep-alives come from its event loop,
# whatever its engine thread is doing. This many intervals of silence mean it hangs or cannot be reached (SIGSTOP, a
# partition that sent no FIN): the client gets an error event instead of waiting out --upstream-timeout.
SILENT_BEATS = 3


def silence_limit(up: Upstream) -> float | None:
    """How long a stream of this worker may stay silent; None: no bound of its own (vLLM sends no keep-alives, a
    pdfleet worker with heartbeats off may stay silent while a request queues)."""
    interval = up.load.get("heartbeat_interval_s")
    if up.engine != engines.PDFLEET or not isinstance(interval, (int, float)) or interval <= 0:
        return None
    return SILENT_BEATS * float(interval)


def _read_timeout(e: httpx.TimeoutException, default: float) -> float:
    """The read timeout the timed-out call ran under: a stream's is its worker's silence bound (three heartbeats),
    not --upstream-timeout, and a 504 that named the latter sent whoever read it after the wrong setting."""
    try:
        return float(e.request.extensions["timeout"]["read"])
    except (RuntimeError, KeyError, TypeError, ValueError):  # RuntimeError: no request on the exception
        return default


def stream_read_timeout(upstream_timeout_s: float, up: Upstream) -> float:
    """The longest silence a stream of this worker is allowed: its own bound, never more than --upstream-timeout."""
    limit = silence_limit(up)
    return upstream_timeout_s if limit is None else min(limit, upstream_timeout_s)


def _scrubbed(answer: Answer) -> Answer:
    """A decode worker's 200 without kv_transfer_params of its own (they would name its KV side channel)."""
    if b'"kv_transfer_params"' not in answer.body:
        return answer
    try:
        body = answer.json()
    except ValueError:
        return answer
    if not handoff.scrub_decode_answer(body):
        return answer
    return dataclasses.replace(answer, body=json.dumps(body).encode())


_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>),;]+")
_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?::\d{1,5})?(?![\w.])")
_IPV6 = re.compile(r"\[[0-9A-Fa-f:.]+\](?::\d{1,5})?|(?<![\w:])[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7}(?![\w:])")
REDACTED = "<worker>"


def redact(text: str, known: Iterable[str] = ()) -> str:
    """`text` without worker addresses: the URLs and hosts given, any URL, any IPv4 or IPv6 address."""
    for item in sorted({k for k in known if k}, key=len, reverse=True):
        text = text.replace(item, REDACTED)
        host = httpx.URL(item).host if "://" in item else ""
        if host:
            text = text.replace(host, REDACTED)
    return _IPV6.sub(REDACTED, _IPV4.sub(REDACTED, _URL.sub(REDACTED, text)))


def _error_code(error: dict) -> int:
    code = error.get("code")
    return code if isinstance(code, int) and 400 <= code < 600 else 500


class _Relay:
    """Forwards a worker's SSE events as they come, bytes untouched, several at once when they come together
    (router/sse_events.py): only a piece that may hold [DONE] or an error event is split (an error event is rewritten
    with addresses redacted). A broken worker becomes an error event and leaves rotation; a heartbeat goes out when
    the worker is silent for --heartbeat-interval. close() settles the bookkeeping once, whether or not events() ever
    ran."""

    def __init__(self, router: Router, up: Upstream, resp: Stream, outcome: Outcome, also_redact: tuple[str, ...] = ()):
        self.router, self.up, self.resp, self.outcome, self.also_redact = router, up, resp, outcome, also_redact
        self.code = 499  # until the stream ends otherwise, the client went away
        self.done = False  # [DONE] relayed
        self._status = 200  # the stream's code so far (an error event's code once one passed)
        self._first = True  # no data event relayed yet (TTFT)
        self._closed = False

    async def events(self) -> AsyncIterator[bytes]:
        up, metrics, resp = self.up, self.router.metrics, self.resp
        cutter = sse_events.EventCutter()
        try:
            while (data := await resp.next()) is not None:
                if not data:  # silent for a heartbeat interval
                    if not cutter.partial:  # never inside an event
                        yield heartbeat.KEEP_ALIVE
                    continue
                whole = cutter.cut(data)
                if not whole:
                    continue
                if self._first and sse_events.has_data(whole):
                    metrics.first_token(self.outcome.tier, self.outcome.start)  # TTFT: a worker's heartbeat is none
                    self._first = False
                if sse_events.may_end(whole):
                    whole = self._ends(whole)
                yield whole
            if not self.done:
                raise httpx.RemoteProtocolError("the stream ended without [DONE]")
            self.code = self._status
        except httpx.HTTPError as e:
            self.code = 502
            metrics.upstream_error(up.role, "timeout" if isinstance(e, httpx.TimeoutException) else "stream_broken")
            self.router.upstreams.mark_down(up, f"failed mid-stream: {type(e).__name__}: {e}")
            log.warning("%s worker %s failed mid-stream: %s", up.role, up.url, e)
            yield sse(
                error_body(
                    f"the {up.role} worker failed mid-stream ({type(e).__name__}); the response is incomplete",
                    "upstream_error",
                    code=502,
                )
            )
            yield b"data: [DONE]\n\n"  # as a worker ends its own error events
        finally:
            self.resp.close()
            self.close()

    def _ends(self, whole: bytes) -> bytes:
        """Complete events, one by one: [DONE] settles the code, an error event is redacted and sets it."""
        out = []
        for event in sse_events.split(whole):
            if event.startswith(sse_events.DONE):
                # The answer is whole once [DONE] is relayed: a client that closes right after it was served, not
                # dropped (499 would count a served request as a client abort).
                self.done, self.code = True, self._status
            elif event.startswith(sse_events.ERROR):
                body = self.router.relayed_error(event[len(b"data: ") :].strip(), self.up, 500, self.also_redact)
                self._status = _error_code(body["error"])
                event = sse(body)
            out.append(event)
        return b"".join(out)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.up.inflight -= 1
        self.router.active -= 1
        self.resp.close()
        self.outcome.code = self.code
