"""The router's FastAPI app: OpenAI routes proxied to workers, /v1/models, /health, /ready, /workers, /metrics, client
API keys on /v1/* and the deployment token on /workers, every client answer counted; the router runner serves it."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from pdfleet_worker import metrics as m
from pdfleet_worker.router import routing
from pdfleet_worker.router.proxy import Router
from pdfleet_worker.router.route_target import RouteTarget
from pdfleet_worker.router.router_config import RouterConfig
from pdfleet_worker.router.router_metrics import CountResponses, RouterMetrics
from pdfleet_worker.router.stream_client import KEEPALIVE_EXPIRY_S, StreamClient
from pdfleet_worker.router.upstreams import Upstreams
from pdfleet_worker.wire import auth, responses
from pdfleet_worker.wire.streaming import install_error_handlers

log = logging.getLogger("pdfleet.router")


def upstream_client(cfg: RouterConfig) -> httpx.AsyncClient:
    """The pool for non-streamed calls and probes. NOTE: no read timeout on the pool: a long generation streams for
    minutes; the proxy bounds each wait with upstream_timeout instead. Idle connections expire before uvicorn's
    keep-alive (5 s on vLLM's server) closes them, as the stream client's do: httpx's own default is those same
    5 s, and a request sent on a connection the worker closed that instant failed with ReadError (the only decode
    worker then out of rotation: a 503 in tests/worker/router/test_vllm_pd.py under a loaded suite)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(cfg.upstream_timeout_s, connect=cfg.connect_timeout_s),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_EXPIRY_S),
    )


def build_app(cfg: RouterConfig) -> FastAPI:
    """ValueError when a secret file cannot be used (missing, empty, a token too short)."""
    state: dict[str, Any] = {}
    token = auth.token_file(cfg.auth_token_file, "--auth-token-file") if cfg.auth_token_file else None
    keys = (
        auth.SecretFile(cfg.api_key_file, "--api-key-file", optional=cfg.api_key_file_optional)
        if cfg.api_key_file
        else None
    )
    rules = None
    if cfg.route_to is not None:  # ValueError: a classifier that does not load, a tokenizer that cannot be read
        rules = routing.Routing(
            cfg.route_rules,
            routing.load_classifier(cfg.route_classifier) if cfg.route_classifier else None,
            cfg.route_confidence_floor,
            routing.tokenizer_counter(cfg.route_tokenizer) if cfg.route_tokenizer else None,
        )
    if token is None and any(t.disaggregated and t.pd_engine == "pdfleet" for t in cfg.tiers.values()):
        log.warning(
            "no --auth-token-file: prefill/decode workers that require the deployment token will refuse "
            "this router (401); without one they run unauthenticated"
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = upstream_client(cfg)
        upstreams = Upstreams(cfg, client, token)
        metrics = RouterMetrics(
            list(cfg.tiers),
            lambda: [(u.tier, u.role, u.healthy) for u in upstreams.all.values()],
            lambda: {str(u.load["revision"]) for u in upstreams.all.values() if u.load.get("revision")},
        )
        streams = StreamClient(cfg.connect_timeout_s)  # streamed calls: every token passes through it
        target = (
            RouteTarget(
                cfg.route_to, client, streams, cfg.health_interval_s, cfg.heartbeat_interval_s, cfg.upstream_timeout_s
            )
            if cfg.route_to is not None
            else None
        )
        state.update(
            client=client,
            upstreams=upstreams,
            metrics=metrics,
            router=Router(cfg, upstreams, metrics, client, rules, target, streams=streams),
        )
        await upstreams.start()
        if target is not None:
            await target.start()
        yield
        if target is not None:
            await target.stop()
        await upstreams.stop()
        await streams.aclose()
        await client.aclose()

    app = FastAPI(title="pdfleet router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    # NOTE: added before CountResponses, so inside it: a 401 is a counted answer like any other.
    if keys is not None:
        app.add_middleware(
            auth.RequireBearer, secret=keys, protected=lambda path: path.startswith("/v1/"), what="an API key"
        )
    if token is not None:
        app.add_middleware(
            auth.RequireBearer, secret=token, protected=lambda path: path == "/workers", what="the deployment token"
        )
    app.add_middleware(CountResponses, metrics=lambda: state.get("metrics"), default_tier=cfg.default_tier)
    started = responses.now()

    async def drain() -> None:
        """SIGTERM: answer /ready 503 so the Service stops sending, keep answering what still arrives for
        --drain-accept seconds (endpoint removal lags the signal), let open requests finish (within the router's
        drain timeout), then shut down."""
        state["draining"] = True
        start = time.monotonic()
        deadline = start + cfg.drain_timeout_s
        accept_until = start + min(cfg.drain_accept_s, cfg.drain_timeout_s)
        while (state["router"].active or time.monotonic() < accept_until) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    app.state.drain = drain

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await state["router"].handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await state["router"].handle(request, "/v1/chat/completions")

    def cards() -> dict[str, dict[str, Any]]:
        served = state["upstreams"].models()
        names = {**served, **{alias: tier for alias, tier in cfg.aliases.items() if alias not in served}}
        return {name: responses.model_card(name, started, tier=tier) for name, tier in names.items()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": list(cards().values())}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        known = cards()
        if model_id not in known:
            raise responses.model_not_found(model_id, list(known))
        return known[model_id]

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        ups: Upstreams = state["upstreams"]
        tiers = {name: ups.servable(name) for name in cfg.tiers}
        ok = tiers[cfg.default_tier] and not state.get("draining", False)
        # models: what the default tier serves (a routing router reads it: /v1/models may need a client key)
        served = ups.served_model(cfg.default_tier)
        return JSONResponse(
            {"ready": ok, "tiers": tiers, "models": [served] if served else []}, status_code=200 if ok else 503
        )

    @app.get("/workers")
    async def workers() -> dict[str, Any]:
        router: Router = state["router"]  # `id`: what response headers call the worker
        return {
            "workers": [{**up.describe(), "id": router.worker_id(up.url)} for up in state["upstreams"].all.values()]
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state["metrics"].exposition(), headers={"Content-Type": m.CONTENT_TYPE})

    install_error_handlers(app)
    return app
