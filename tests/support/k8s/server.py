"""Serving an emulator from a background thread on a free loopback port (:class:`EmulatorThread`, for sync
tests, kopf's KopfRunner and kubectl subprocesses), a kubeconfig for it, and ``python -m
tests.support.k8s_emulator`` to serve one by hand."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Iterable
from typing import Any

import kmock
import yaml

from tests.support.k8s.emulator import KubernetesApiEmulator

CALL_TIMEOUT_S = 60


class EmulatorThread:
    """Serve a :class:`KubernetesApiEmulator` on a free loopback port from a background thread."""

    def __init__(
        self, emulator: KubernetesApiEmulator | None = None, *, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self._kwargs = {"emulator": emulator, "host": host, "port": port}
        self.emulator: KubernetesApiEmulator | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.url = ""
        self.port = 0
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    def start(self) -> EmulatorThread:
        self._thread = threading.Thread(target=self._run, name="k8s-emulator", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the Kubernetes API emulator did not start in 30 s")
        if self._error is not None:
            raise RuntimeError("the Kubernetes API emulator failed to start") from self._error
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported to start() or visible at stop()
            self._error = exc
            self._ready.set()
        finally:
            loop.close()

    async def _serve(self) -> None:
        emulator = self._kwargs["emulator"] or KubernetesApiEmulator()
        self.emulator = emulator
        self._stop = asyncio.Event()
        server = kmock.Server(emulator, host=self._kwargs["host"], port=self._kwargs["port"] or None)
        async with emulator, server:
            self.port = server.port
            self.url = f"http://{self._kwargs['host']}:{server.port}"
            self._ready.set()
            await self._stop.wait()
            emulator.close_watches()
            await asyncio.sleep(0)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on the emulator's loop (state is only touched there) and return its result."""
        assert self.loop is not None
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:
                future.set_exception(exc)

        self.loop.call_soon_threadsafe(run)
        # NOTE: 60 s, and where the loop's thread is if it does not come: in a loaded full suite a call from
        # tests/gen/chart/test_install.py waited out 30 s twice (passing alone and beside six busy processes);
        # the stack says what held the loop next time
        try:
            return future.result(timeout=CALL_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"the emulator's loop did not run {getattr(fn, '__qualname__', fn)} in {CALL_TIMEOUT_S} s; its "
                "thread is at:\n" + self._thread_stack()
            ) from None

    def _thread_stack(self) -> str:
        """Where the emulator's thread is now (what keeps its loop from a call: a diagnosis, not a fix)."""
        import sys
        import traceback

        frame = sys._current_frames().get(self._thread.ident) if self._thread is not None else None
        return "".join(traceback.format_stack(frame)) if frame is not None else "(no such thread)"

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None and self._thread is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(30)

    def __enter__(self) -> EmulatorThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def write_kubeconfig(path: Any, server_url: str, *, namespace: str = "default", token: str = "emulator-token") -> Any:
    """Write a kubeconfig for the emulator (a token user: kopf and clients need some credentials; the default
    token is the tests' administrator, one from ``KubernetesApiEmulator.service_account`` is authorized by RBAC)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "preferences": {},
        "clusters": [{"name": "emulator", "cluster": {"server": server_url}}],
        "users": [{"name": "emulator", "user": {"token": token}}],
        "contexts": [
            {"name": "emulator", "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace}}
        ],
        "current-context": "emulator",
    }
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(config, f)
    return path


def main(argv: Iterable[str] | None = None) -> None:
    """``python -m tests.support.k8s_emulator [--port N] [--kubeconfig PATH]``: serve until Ctrl+C."""
    import argparse
    import time

    parser = argparse.ArgumentParser(description="Serve the test Kubernetes API emulator.")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--kubeconfig", default="emulator.kubeconfig")
    args = parser.parse_args(list(argv) if argv is not None else None)
    with EmulatorThread(port=args.port) as server:
        write_kubeconfig(args.kubeconfig, server.url)
        print(f"serving {server.url}; export KUBECONFIG={args.kubeconfig}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
