"""The worker's FastAPI app: OpenAI routes, /health, /ready, /load, /metrics, error objects, the deployment token on
everything but the probes, background model load and drain; the runner serves it."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from pdfleet_worker import metrics as m
from pdfleet_worker.server.engine_loop import EngineLoop, StreamError
from pdfleet_worker.server.openai_serving import OpenAIServing, ServerState
from pdfleet_worker.server.pd import PD
from pdfleet_worker.server.worker_config import WorkerConfig
from pdfleet_worker.server.worker_metrics import WorkerMetrics
from pdfleet_worker.wire import auth, responses
from pdfleet_worker.wire.errors import RequestError
from pdfleet_worker.wire.streaming import install_error_handlers

log = logging.getLogger("pdfleet.worker")

# Open with a token configured: kubelet's probes and Prometheus carry no token (the NetworkPolicy limits who
# reaches them); /ready then answers readiness only, not /load's body.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


class Worker:
    """One worker process's state: the engine (loaded in the background), PD, metrics, drain."""

    def __init__(self, cfg: WorkerConfig, engine=None, connector=None):
        self.cfg = cfg
        self.state = ServerState()
        self.loop: EngineLoop | None = None
        self.pd: PD | None = None
        self.metrics: WorkerMetrics | None = None
        self.serving: OpenAIServing | None = None
        self.load_error: BaseException | None = None
        self.started_at = time.time()
        self._engine = engine  # tests may hand in a built engine
        self._connector = connector
        self._loaded = asyncio.Event()
        self._load_thread: threading.Thread | None = None
        # ValueError (missing, empty or short file) before anything starts
        self.token = auth.token_file(cfg.auth_token_file, "--auth-token-file") if cfg.auth_token_file else None
        if self.token is None and cfg.role != "both":
            log.warning(
                "no --auth-token-file: this %s worker's OpenAI endpoints, /load and KV endpoint are "
                "unauthenticated (anyone who reaches it may send kv_transfer_params or pull and release "
                "KV leases)",
                cfg.role,
            )

    # -- startup --------------------------------------------------------------------------------
    async def start(self) -> None:
        aio = asyncio.get_running_loop()

        def load() -> None:
            try:
                engine = self._engine or self._build_engine()
                aio.call_soon_threadsafe(self._ready_or_fail, engine)
            except BaseException as e:  # reported by /health and /ready; the process stays up to say so
                log.exception("loading the model failed")
                self.load_error = e

        self._load_thread = threading.Thread(target=load, name="model-load", daemon=True)
        self._load_thread.start()

    def _build_engine(self):
        from pdfleet_worker.engine.llm_engine import LLMEngine

        t0 = time.monotonic()
        engine = LLMEngine(self.cfg.engine)
        log.info(
            "loaded %s in %.1fs: %d KV blocks of %d tokens, max model length %d",
            self.cfg.engine.model,
            time.monotonic() - t0,
            engine.block_manager.num_blocks,
            self.cfg.engine.block_size,
            engine.max_model_len,
        )
        # NOTE: /ready only after a forward pass: a compiled or CUDA model pays its first-call cost here.
        log.info("warm-up forward pass in %.2fs", engine.warm_up())
        return engine

    def _ready_or_fail(self, engine) -> None:
        try:
            self._ready(engine)
        except BaseException as e:
            log.exception("starting the worker failed")
            self.load_error = e

    def _ready(self, engine) -> None:
        from pdfleet_worker.kv_transfer.peers import KVPeers

        loop = EngineLoop(engine)

        def lease_counts() -> tuple[int, int, int]:
            t = self.pd.leases if self.pd is not None else None
            return (0, 0, 0) if t is None else (len(t), t.num_expired, t.num_released)

        metrics = WorkerMetrics(
            self.cfg.served_model_name, self.cfg.role, self.cfg.accelerator, lambda: loop.stats, lease_counts
        )
        if self.cfg.serves_kv or self.cfg.pulls_kv:
            connector = self._connector or kv_connector(self.cfg.kv_connector)(
                "127.0.0.1" if self.cfg.host == "localhost" else self.cfg.host,
                self.cfg.kv_port,
                token=self.token,
                peers=KVPeers.from_spec(self.cfg.kv_peers),
            )
            connector.on_sent = metrics.kv_sent
            connector.on_refused = metrics.kv_failure
            self.pd = PD(self.cfg, loop, connector, metrics)
            self.pd.start()
        loop.on_step = metrics.observe
        loop.start(asyncio.get_running_loop())
        self.loop, self.metrics = loop, metrics
        self.serving = OpenAIServing(self.cfg, loop, self.pd, metrics, self.state)
        self._loaded.set()
        log.info(
            "worker ready: model %s, role %s, accelerator %s",
            self.cfg.served_model_name,
            self.cfg.role,
            self.cfg.accelerator,
        )

    async def stop(self) -> None:
        if self.loop is not None:
            self.loop.abort_all(
                StreamError(503, "the worker is shutting down", type="service_unavailable", code="shutdown")
            )
        if self.pd is not None:
            self.pd.close()
        if self.loop is not None:
            await asyncio.to_thread(self.loop.stop)

    def native_threads(self) -> list[str]:
        """This worker's threads that may be inside torch and are still alive (after stop(): those that did not
        end in time): the model load, the engine thread, the KV connector's."""
        alive = [
            t.name
            for t in (self._load_thread, self.loop.thread if self.loop is not None else None)
            if t is not None and t.is_alive()
        ]
        return alive + (self.pd.connector.running_threads() if self.pd is not None else [])

    # -- state ----------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.load_error is None and (self.loop is None or self.loop.alive)

    @property
    def ready(self) -> bool:
        return self.serving is not None and self.alive and not self.state.draining

    def load_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "ready": self.ready,
            "alive": self.alive,
            "loaded": self.serving is not None,
            "draining": self.state.draining,
            "role": self.cfg.role,
            "model": self.cfg.served_model_name,
            "accelerator": self.cfg.accelerator,
            "inflight": self.state.inflight,
            "heartbeat_interval_s": self.cfg.heartbeat_interval_s,
        }
        if self.cfg.revision is not None:
            info["revision"] = self.cfg.revision
        if self.load_error is not None:
            info["error"] = repr(self.load_error)
        if self.serving is not None:
            info["limits"] = self.serving.limits.to_json()  # the router checks requests against them
        if self.loop is not None:
            s = self.loop.stats
            info.update(
                waiting=s.num_requests_waiting,
                running=s.num_requests_running,
                waiting_for_remote_kv=s.num_requests_waiting_for_remote_kv,
                kv_usage=s.kv_cache_usage,
                prompt_tokens_waiting=s.num_prompt_tokens_waiting,
                free_blocks=s.num_free_blocks,
                total_blocks=s.num_total_blocks,
                held_blocks=s.num_held_blocks,
                holding_requests=s.num_requests_holding_kv,
                block_size=self.cfg.engine.block_size,
                max_model_len=self.loop.engine.max_model_len,
                weights_digest=self.loop.engine.weights_digest,
            )
        if self.pd is not None:
            info["compat_hash"] = self.pd.compat_hash
            if self.pd.leases is not None:
                info["leases"] = len(self.pd.leases)
                info["leases_expired"] = self.pd.leases.num_expired
                info["leases_released"] = self.pd.leases.num_released
            if self.pd.kv_address is not None:
                info["kv_endpoint"] = f"{self.pd.kv_address[0]}:{self.pd.kv_address[1]}"
            info["kv_connector"] = self.pd.connector.name
            info["kv_transfers"] = self.pd.connector.moved()
        return info

    # -- drain ----------------------------------------------------------------------------------
    async def drain(self) -> None:
        """Stop admitting; let in-flight requests finish and KV leases be acked or expire, until
        the drain deadline; then abort what is left (its clients get an error, never silence)."""
        self.state.draining = True
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        log.info("draining: %d requests in flight", self.state.inflight)

        def busy() -> bool:
            leases = self.pd.leases if self.pd is not None else None
            return self.state.inflight > 0 or (leases is not None and len(leases) > 0)

        while busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.state.inflight and self.loop is not None:
            n = self.loop.abort_all(
                StreamError(
                    503,
                    f"the worker shut down before the request finished (drain timeout {self.cfg.drain_timeout_s:g}s)",
                    type="service_unavailable",
                    code="shutdown",
                )
            )
            log.warning("drain deadline passed: aborted %d requests", n)
            end = time.monotonic() + 2.0
            while self.state.inflight and time.monotonic() < end:
                await asyncio.sleep(0.05)
        log.info("drained")


def build_app(worker: Worker) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await worker.start()
        yield
        await worker.stop()

    app = FastAPI(title="pdfleet worker", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker
    if worker.token is not None:
        app.add_middleware(
            auth.RequireBearer,
            secret=worker.token,
            protected=lambda path: path not in OPEN_PATHS,
            what="the deployment token",
        )

    def serving() -> OpenAIServing:
        if worker.load_error is not None:
            raise RequestError(503, f"the model failed to load: {worker.load_error!r}", type="service_unavailable")
        if worker.serving is None:
            raise RequestError(
                503,
                "the model is still loading",
                type="service_unavailable",
                code="loading",
                headers={"Retry-After": str(worker.cfg.retry_after_s)},
            )
        return worker.serving

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving().completions(request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serving().chat(request)

    def card() -> dict[str, Any]:
        max_len = worker.loop.engine.max_model_len if worker.loop is not None else None
        return responses.model_card(
            worker.cfg.served_model_name, int(worker.started_at), root=worker.cfg.engine.model, max_model_len=max_len
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != worker.cfg.served_model_name:
            raise responses.model_not_found(model_id, [worker.cfg.served_model_name])
        return card()

    @app.get("/health")
    async def health() -> Response:
        if not worker.alive:
            return JSONResponse(
                {"status": "failed", "error": repr(worker.load_error or worker.loop.error)}, status_code=500
            )
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        info = worker.load_info()
        if worker.token is not None:  # open to probes: readiness only (the rest is /load's, behind the token)
            info = {k: info[k] for k in ("ready", "alive", "loaded", "draining")}
        return JSONResponse(info, status_code=200 if info["ready"] else 503)

    @app.get("/load")
    async def load() -> Response:
        info = worker.load_info()
        return JSONResponse(info, status_code=200 if info["ready"] else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if worker.metrics is None:
            return Response("# the model is still loading\n", status_code=503, media_type="text/plain")
        return Response(worker.metrics.exposition(), headers={"Content-Type": m.CONTENT_TYPE})

    install_error_handlers(app)
    return app


def kv_connector(name: str):
    """The connector class `--kv-connector` names; NIXL's import error (naming its package) surfaces at start."""
    if name == "nixl":
        from pdfleet_worker.kv_transfer.nixl import NixlKVConnector

        return NixlKVConnector
    from pdfleet_worker.kv_transfer.tcp import TcpKVConnector

    return TcpKVConnector
