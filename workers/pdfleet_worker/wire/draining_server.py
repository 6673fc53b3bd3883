"""uvicorn with a drain: the first SIGTERM/SIGINT runs the app's drain coroutine, then the usual graceful shutdown, and
the process exits 0; the worker and router runners use it. No torch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading

import uvicorn

log = logging.getLogger("pdfleet.server")


def exit_on_signal_until_serving() -> None:
    """SIGTERM/SIGINT while the process is still importing and configuring: nothing runs, nothing to drain, so
    exit 0 at once instead of dying by the signal (a replica scaled down while it starts would read as killed).
    uvicorn's handlers (DrainingServer) replace these once it serves."""

    def leave(sig, frame) -> None:
        os._exit(0)  # NOTE: not SystemExit: it would unwind through a half-done import of torch

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, leave)


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT runs `drain()` before the usual shutdown and
    the process then exits 0; a second signal exits at once."""

    def __init__(self, config: uvicorn.Config, drain):
        super().__init__(config)
        self._drain = drain
        self._draining = False
        self._aio: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._aio = asyncio.get_running_loop()
        await super().startup(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        # NOTE: uvicorn re-raises the captured signal after shutdown (exit status -15); a worker
        # that drained cleanly exits 0 instead, so Kubernetes does not report a crash.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        if self._draining or self._aio is None:
            self.should_exit = True
            self.force_exit = self._draining
            return
        self._draining = True
        log.info("signal %s: draining", signal.Signals(sig).name)
        self._aio.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        finally:
            self.should_exit = True
