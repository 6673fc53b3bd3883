"""Runs the LLMEngine on its own thread and hands its outputs to asyncio request streams; the OpenAI handlers and the PD
code call it.

Everything that touches the engine runs on the engine thread, as a command taken between steps:
admission, aborts, KV imports, lease releases. The event loop never waits for a step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from pdfleet_worker.engine.llm_engine import LLMEngine
from pdfleet_worker.engine.outputs import RequestOutput
from pdfleet_worker.engine.scheduler import KVLoad
from pdfleet_worker.engine.stats import EngineStats
from pdfleet_worker.sampling_params import SamplingParams

log = logging.getLogger("pdfleet.engine")

IDLE_WAIT_S = 1.0  # longest sleep of an idle engine thread (it wakes on any command)


@dataclasses.dataclass
class StreamError:
    """Ends a request stream with an error instead of a final output."""

    status: int
    message: str
    type: str = "server_error"
    code: str | None = None
    request_id: str = ""


class RequestStream:
    """The outputs of one engine request, in order, put on a queue (several requests may share
    one: the choices of one HTTP request); its last item is a final output or a StreamError."""

    def __init__(self, request_id: str, queue: asyncio.Queue | None = None):
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | StreamError] = asyncio.Queue() if queue is None else queue
        self.done = False


class EngineLoop:
    """Owns the engine thread. Hooks (set by the server, called on the engine thread):
    on_held(output) for a finished hold_kv request, on_kv_load(request_id, load) for a request that
    waits for remote KV, on_step(iteration_stats) after each step, on_tick() every turn of the loop."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.loop: asyncio.AbstractEventLoop | None = None
        self._cmds: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # event-loop thread only
        self._waiting_kv: dict[str, KVLoad] = {}  # engine thread only
        self._abort_after_kv: set[str] = set()  # engine thread only: aborted while their pull runs
        self._held: set[str] = set()  # engine thread only: finished, KV kept
        self._flush = False  # engine thread only: step once for abort stats
        self._thread: threading.Thread | None = None
        self._stop = False
        self.on_held: Callable[[RequestOutput], None] | None = None
        self.on_kv_load: Callable[[str, KVLoad], None] | None = None
        self.on_step: Callable[[Any], None] | None = None
        self.on_tick: Callable[[], float | None] | None = None  # each turn; returns seconds until the next wanted turn
        self.stats: EngineStats = engine.stats()
        self.error: BaseException | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._thread is None, "engine loop already started"
        self.loop = loop
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._cmds.put(lambda: None)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    # -- commands (any thread) ------------------------------------------------------------------
    def call_soon(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run fn(engine) on the engine thread; fire and forget (errors are logged)."""

        def run() -> None:
            try:
                fn(self.engine)
            except Exception:
                log.exception("engine command failed")

        self._cmds.put(run)

    def call(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future:
        """Run fn(engine) on the engine thread; an asyncio future of its result (event-loop thread)."""
        assert self.loop is not None, "engine loop not started"
        fut = self.loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not fut.done():
                (fut.set_result if ok else fut.set_exception)(value)

        def run() -> None:
            try:
                value, ok = fn(self.engine), True
            except Exception as e:  # handed to the caller
                value, ok = e, False
            self.loop.call_soon_threadsafe(settle, ok, value)

        self._cmds.put(run)
        return fut

    # -- requests (event-loop thread) -----------------------------------------------------------
    async def add(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        *,
        remote_kv_tokens: int = 0,
        hold_kv: bool = False,
        queue: asyncio.Queue | None = None,
    ) -> RequestStream:
        """Admit a request; raises what LLMEngine.add_request raises (ValueError, QueueFullError)."""
        stream = RequestStream(request_id, queue)
        self._streams[request_id] = stream
        try:
            await self.call(
                lambda e: e.add_request(
                    request_id, token_ids, params, remote_kv_tokens=remote_kv_tokens, hold_kv=hold_kv
                )
            )
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    def abort(self, request_id: str, error: StreamError | None = None) -> None:
        """Stop a request (client gone, failed transfer, drain deadline); its stream ends with
        `error` if given. Safe for unknown and finished requests: a finished request that holds KV
        for a transfer is left to its lease (ack or expiry), since a pull may be reading it."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.done:
            stream.done = True
            if error is not None:
                stream.queue.put_nowait(dataclasses.replace(error, request_id=request_id))

        def run(engine: LLMEngine) -> None:
            if request_id in self._held:
                return
            if request_id in self._waiting_kv:
                # NOTE: its pull may be writing into its blocks (connectors receive in place): they are freed
                # when the pull ends (take_kv_load), never under it.
                self._abort_after_kv.add(request_id)
                return
            if engine.abort(request_id):
                self._flush = True

        self.call_soon(run)

    def release_held(self, request_id: str) -> None:
        """Free the KV a finished hold_kv request kept (its lease was acked or expired). Any thread."""

        def run(engine: LLMEngine) -> None:
            self._held.discard(request_id)
            engine.release_held(request_id)

        self.call_soon(run)

    def fail(self, request_id: str, error: StreamError) -> None:
        self.abort(request_id, error)

    def abort_all(self, error: StreamError) -> int:
        ids = [rid for rid, s in self._streams.items() if not s.done]
        for rid in ids:
            self.abort(rid, error)
        return len(ids)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # -- remote KV (engine thread) --------------------------------------------------------------
    def take_kv_load(self, request_id: str) -> KVLoad | None:
        """Engine thread, once the request's pull has ended: claim its KVLoad; None if it was aborted meanwhile
        (the abort, deferred while the pull could write into its blocks, happens now)."""
        load = self._waiting_kv.pop(request_id, None)
        if request_id in self._abort_after_kv:
            self._abort_after_kv.discard(request_id)
            if self.engine.abort(request_id):
                self._flush = True
            return None
        return load

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            stalled = False
            while not self._stop:
                wait = self.on_tick() if self.on_tick is not None else None
                idle = stalled or not self.engine.has_unfinished_requests()
                if idle:
                    self.stats = self.engine.stats()
                    timeout = IDLE_WAIT_S if wait is None else max(0.0, min(IDLE_WAIT_S, wait))
                    ran = self._run_commands(timeout)
                else:
                    ran = self._run_commands(None)
                if self._stop:
                    break
                if ran:
                    stalled = False
                # NOTE: an abort's stats land in the next step; with nothing else to run, one
                # empty step hands them to the metrics now rather than with some later request.
                if (stalled or not self.engine.has_unfinished_requests()) and not self._flush:
                    continue
                self._flush = False
                outputs = self.engine.step()
                it = self.engine.last_iteration_stats
                # NOTE: nothing scheduled and nothing emitted: every request waits for remote KV or
                # for blocks held by leases; only a command (KV arrived, ack, abort) can change that.
                stalled = it.num_scheduled_tokens == 0 and not outputs
                for out in outputs:
                    if out.kv_load is not None:
                        self._waiting_kv[out.request_id] = out.kv_load
                        if self.on_kv_load is not None:
                            self.on_kv_load(out.request_id, out.kv_load)
                    if out.held_kv is not None:
                        assert self.on_held is not None, f"{out.request_id} holds KV but nothing leases it"
                        self._held.add(out.request_id)
                        self.on_held(out)
                if self.on_step is not None:
                    self.on_step(it)
                self.stats = self.engine.stats()
                if outputs:
                    self.loop.call_soon_threadsafe(self._dispatch, outputs)
        except BaseException as e:  # the worker is broken: /health turns red, requests fail
            log.exception("engine thread died")
            self.error = e
            if self.loop is not None and not self.loop.is_closed():
                self.loop.call_soon_threadsafe(self.abort_all, StreamError(500, f"engine failed: {e!r}"))

    def _run_commands(self, timeout: float | None) -> bool:
        """Run queued commands; with a timeout, first wait up to that long for one."""
        try:
            cmd = self._cmds.get_nowait() if timeout is None else self._cmds.get(timeout=timeout)
        except queue.Empty:
            return False
        while True:
            cmd()
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return True

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None or stream.done:
                continue
            if out.finished:
                stream.done = True
                del self._streams[out.request_id]
            stream.queue.put_nowait(out)
