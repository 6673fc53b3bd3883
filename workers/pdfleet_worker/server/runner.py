"""`pdfleet worker`: builds the config, serves the app with uvicorn and turns SIGTERM into a drain; the CLI calls
run()."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import uvicorn

from pdfleet_worker.server.app import Worker, build_app
from pdfleet_worker.server.worker_config import WorkerConfig, from_args
from pdfleet_worker.wire.draining_server import DrainingServer

log = logging.getLogger("pdfleet.worker")


def serve(cfg: WorkerConfig, log_level: str = "info") -> int:
    try:
        worker = Worker(cfg)
    except ValueError as e:  # an unusable --auth-token-file
        raise SystemExit(f"pdfleet worker: {e}")
    app = build_app(worker)
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=log_level,
        access_log=log_level == "debug",
        timeout_graceful_shutdown=5,
        lifespan="on",
        timeout_keep_alive=30,
    )
    server = DrainingServer(config, worker.drain)
    server.run()
    code = 0 if worker.load_error is None else 1
    running = worker.native_threads()
    if running:
        exit_now(code, running)
    return code


def exit_now(code: int, running: list[str]) -> None:
    """End the process without the interpreter's teardown.

    NOTE: deliberate. A thread still inside torch (the model still loading when SIGTERM came, a KV copy that
    outlived the connector's close) cannot be interrupted, and the C++ static destructors that run at a normal
    exit then abort the process ("terminate called without an active exception": SIGABRT), which Kubernetes and
    `pdfleet up` report as a crash of a worker that drained cleanly. By now nothing is left to lose: requests
    have finished or been answered with an error, leases released, sockets closed; logs are flushed here.
    """
    log.info("exiting with %s still running: skipping interpreter teardown", ", ".join(running))
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        cfg = from_args(args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"pdfleet worker: {e}")
    return serve(cfg, args.log_level)
