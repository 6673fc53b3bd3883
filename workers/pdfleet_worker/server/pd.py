"""Prefill/decode disaggregation in the worker: leases and KV transfer parameters on the prefill side, pulls, acks and
the failure policy on the decode side; the OpenAI handlers call it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import socket
import threading
import time
import uuid

from pdfleet_worker.engine.llm_engine import LLMEngine
from pdfleet_worker.engine.outputs import RequestOutput
from pdfleet_worker.engine.scheduler import KVLoad
from pdfleet_worker.kv_transfer import connector as c
from pdfleet_worker.kv_transfer.blocks import KVPool
from pdfleet_worker.kv_transfer.connector import KVConnector, KVTransferError
from pdfleet_worker.kv_transfer.lease import LeaseTable
from pdfleet_worker.kv_transfer.params import KVTransferParams, RemotePrompt, prompt_hash
from pdfleet_worker.server.engine_loop import EngineLoop, StreamError
from pdfleet_worker.server.worker_config import WorkerConfig

log = logging.getLogger("pdfleet.pd")


class TransferRefused(Exception):
    """A decode request whose KV cannot be used at all (layout or prompt differ); `reason` labels the metric."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass
class _Group:
    """The decode-side sequences that read one remote prompt; the lease is acked when all settled."""

    params: KVTransferParams
    prompt: RemotePrompt
    pending: set[str]
    ok: bool = True


class PD:
    """Both halves; a prefill worker uses the first, a decode worker the second, `both` either."""

    def __init__(self, cfg: WorkerConfig, loop: EngineLoop, connector: KVConnector, metrics):
        self.cfg = cfg
        self.loop = loop
        self.connector = connector
        self.metrics = metrics
        self.compat_hash = loop.engine.kv_layout().compat_hash
        # The block tensors themselves: served from (prefill) and pulled into (decode) without copies.
        self.pool = KVPool.of_caches(loop.engine.model_runner.caches)
        self.weights = loop.engine.weights_digest
        self.engine_id = f"{cfg.served_model_name}-{uuid.uuid4().hex[:12]}"
        self.leases: LeaseTable | None = None
        self.kv_address: tuple[str, int] | None = None
        self._groups: dict[str, _Group] = {}  # decode request id -> its group
        self._lock = threading.Lock()
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-pull")

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self.cfg.serves_kv:
            self.leases = LeaseTable(self.cfg.kv_lease_s, self.loop.release_held)
            self.loop.on_held = self._on_held
            self.loop.on_tick = self._tick
            bind = self.cfg.host if self.cfg.host not in ("localhost",) else "127.0.0.1"
            host, port = self.connector.serve(self.leases, self.pool, self.compat_hash)
            self.kv_address = (advertised_host(self.cfg, bind), port)
            log.info(
                "KV endpoint on %s:%d (advertised %s:%d), compat hash %s",
                host,
                port,
                *self.kv_address,
                self.compat_hash,
            )
        if self.cfg.pulls_kv:
            self.loop.on_kv_load = self._on_kv_load

    def close(self) -> None:
        if self.leases is not None:
            self.leases.release_all()
        self.connector.close()
        self._threads.shutdown(wait=False, cancel_futures=True)

    # -- prefill side (engine thread) -----------------------------------------------------------
    def _on_held(self, out: RequestOutput) -> None:
        assert self.leases is not None and out.held_kv is not None
        self.leases.add(out.request_id, out.held_kv.block_ids, out.held_kv.num_tokens)

    def _tick(self) -> float | None:
        assert self.leases is not None
        expired = self.leases.expire()
        for rid in expired:
            log.warning("KV lease of %s expired without an ack; blocks freed", rid)
        nxt = self.leases.next_expiry()
        return None if nxt is None else max(0.0, nxt - time.monotonic())

    def transfer_params(self, held: list[tuple[str, RequestOutput, list[int]]]) -> KVTransferParams:
        """For a finished prefill: (engine request id, its final output, prompt token ids) per prompt."""
        assert self.kv_address is not None, "this worker serves no KV"
        prompts = [
            RemotePrompt(rid, list(out.held_kv.block_ids), out.held_kv.num_tokens, prompt_hash(tokens))
            for rid, out, tokens in held
        ]
        return KVTransferParams(
            engine_id=self.engine_id,
            host=self.kv_address[0],
            port=self.kv_address[1],
            connector=self.connector.name,
            compat_hash=self.compat_hash,
            block_size=self.cfg.engine.block_size,
            lease_seconds=self.cfg.kv_lease_s,
            prompts=prompts,
            weights=self.weights,
            revision=self.cfg.revision,
        )

    def drop_lease(self, request_id: str) -> None:
        """The prefill response never reached its caller: nobody will pull, free now."""
        if self.leases is not None:
            self.leases.release(request_id, counted="dropped")

    # -- decode side ----------------------------------------------------------------------------
    async def untrusted(self, params: KVTransferParams) -> TransferRefused | None:
        """Refused when the params name a KV endpoint outside --kv-peers: it is never contacted (no pull, no ack,
        no token sent there), whoever wrote the params. Resolving a peer's name happens off the event loop."""
        if await asyncio.to_thread(self.connector.trusts, params.host, params.port):
            return None
        return TransferRefused(
            c.UNTRUSTED_PEER,
            f"KV endpoint {params.host}:{params.port} of prefill engine {params.engine_id} is not "
            f"among this worker's --kv-peers ({self.connector.peers}); not contacted",
        )

    def remote_tokens(self, params: KVTransferParams, index: int, token_ids: list[int]) -> int:
        """How many leading tokens of this prompt to take from the prefill worker; raises TransferRefused."""
        prompt = params.prompts[index]
        if params.connector not in self.connector.pulls_from:
            raise TransferRefused(
                c.UNSUPPORTED,
                f"KV connector {params.connector!r} is not available on this worker "
                f"(it has {self.connector.name!r}, which pulls from "
                f"{', '.join(sorted(self.connector.pulls_from))})",
            )
        if params.compat_hash != self.compat_hash and params.weights is not None and params.weights != self.weights:
            raise TransferRefused(
                c.WEIGHTS_MISMATCH,
                f"KV computed by other weights: prefill engine {params.engine_id} serves weights "
                f"{params.weights} (revision {params.revision or 'unset'}), this decode engine "
                f"{self.weights} (revision {self.cfg.revision or 'unset'}); KV refused",
            )
        if params.compat_hash != self.compat_hash:
            raise TransferRefused(
                c.INCOMPATIBLE,
                f"KV layout mismatch: prefill engine {params.engine_id} has compat hash "
                f"{params.compat_hash}, this decode engine has {self.compat_hash} (model, dtype, "
                f"KV dtype, layers, KV heads, head dim or block size differ); KV refused",
            )
        if prompt.prompt_hash != prompt_hash(token_ids):
            raise TransferRefused(
                c.PROMPT_MISMATCH,
                f"prompt {index} tokenizes differently here than on prefill engine {params.engine_id} "
                f"(prompt hash {prompt.prompt_hash} vs {prompt_hash(token_ids)}); KV refused",
            )
        # NOTE: the last prompt token is always computed here: its logits pick the first token.
        return max(0, min(prompt.num_tokens, len(token_ids) - 1))

    def register(self, params: KVTransferParams, index: int, request_ids: list[str]) -> None:
        """The decode request ids that read prompt `index`; its lease is acked once all of them settled."""
        group = _Group(params, params.prompts[index], set(request_ids))
        with self._lock:
            for rid in request_ids:
                self._groups[rid] = group

    def release_unused(self, params: KVTransferParams, index: int, reason: str | None) -> None:
        """Ack a prompt no sequence here will pull (refused or nothing to pull)."""
        if reason is not None:
            self.metrics.kv_failure(reason)
        self._release(params, params.prompts[index], ok=reason is None)

    def settle(self, request_id: str, ok: bool = True) -> None:
        """This sequence needs its remote prompt no more (pulled, failed, cached, finished or gone). Any thread."""
        with self._lock:
            group = self._groups.pop(request_id, None)
            if group is None:
                return
            group.pending.discard(request_id)
            group.ok = group.ok and ok
            last = not group.pending
        if last:
            self._threads.submit(self._release, group.params, group.prompt, group.ok)

    def _release(self, params: KVTransferParams, prompt: RemotePrompt, ok: bool) -> None:
        try:
            self.connector.release(params, prompt, ok, self.cfg.kv_transfer_timeout_s)
        except KVTransferError as e:
            # The lease expires on the prefill worker anyway; nothing is lost.
            log.warning(
                "ack of %s to %s:%d failed (%s); its lease will expire", prompt.request_id, params.host, params.port, e
            )

    def _on_kv_load(self, request_id: str, load: KVLoad) -> None:
        """Engine thread: a decode request got its blocks; pull into them off the engine thread."""
        with self._lock:
            group = self._groups.get(request_id)
        if group is None:  # admitted with remote tokens but unregistered: a bug, not a client error
            log.error("KV load for %s without transfer parameters; recomputing", request_id)
            self.loop.call_soon(
                lambda e: self._finish(e, request_id, None, KVTransferError(c.BAD_RESPONSE, "no params"))
            )
            return
        try:
            self._threads.submit(self._pull, request_id, load, group)
        except RuntimeError:  # closing: the pull pool takes nothing more
            self.loop.call_soon(
                lambda e: self._finish(e, request_id, None, KVTransferError(c.CONNECT, "worker closing"))
            )

    def _pull(self, request_id: str, load: KVLoad, group: _Group) -> None:
        bs = self.cfg.engine.block_size
        assert load.first_token % bs == 0, f"{request_id}: KV load starts mid-block at token {load.first_token}"
        start = time.monotonic()
        pulled, error = None, None
        try:
            # NOTE: written straight into the request's blocks, off the engine thread: the engine loop keeps
            # them (an abort waits for _finish) until this pull has ended.
            pulled = self.connector.pull(
                group.params,
                group.prompt,
                load.first_token // bs,
                load.block_ids,
                self.compat_hash,
                self.cfg.kv_transfer_timeout_s,
                into=self.pool,
            )
            self.metrics.kv_pulled(pulled.nbytes, time.monotonic() - start)
        except KVTransferError as e:
            error = e
        except Exception as e:  # a bug in the transport must still end the request
            log.exception("KV pull of %s crashed", request_id)
            error = KVTransferError(c.BAD_RESPONSE, f"KV pull crashed: {e!r}")
        self.loop.call_soon(lambda e: self._finish(e, request_id, pulled, error))

    def _finish(self, engine: LLMEngine, request_id: str, pulled, error: KVTransferError | None) -> None:
        """Engine thread: import what arrived, or apply the failure policy."""
        load = self.loop.take_kv_load(request_id)
        if load is None:  # aborted while pulling: its blocks are not ours to write
            self.settle(request_id, ok=False)
            return
        if error is None:
            try:
                if not pulled.in_place:
                    engine.import_kv(load.block_ids, pulled.layers)
                engine.remote_kv_done(request_id, True)
                self.settle(request_id, ok=True)
                return
            except ValueError as e:
                error = KVTransferError(c.BAD_RESPONSE, f"KV does not fit this engine: {e}")
        self.metrics.kv_failure(error.reason)
        self.settle(request_id, ok=False)
        if self.cfg.kv_on_failure == "recompute":
            log.warning("KV pull for %s failed (%s: %s); recomputing the prompt here", request_id, error.reason, error)
            engine.remote_kv_done(request_id, False)
        else:
            log.warning("KV pull for %s failed (%s: %s); failing the request", request_id, error.reason, error)
            message = f"KV transfer from the prefill worker failed ({error.reason}): {error}"
            self.loop.loop.call_soon_threadsafe(
                self.loop.fail, request_id, StreamError(502, message, type="kv_transfer_error", code=error.reason)
            )


def advertised_host(cfg: WorkerConfig, bind: str) -> str:
    """The address decode workers use to reach this worker's KV endpoint."""
    if cfg.kv_host:
        return cfg.kv_host
    if os.environ.get("POD_IP"):
        return os.environ["POD_IP"]
    if bind not in ("0.0.0.0", "::", ""):
        return bind
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
