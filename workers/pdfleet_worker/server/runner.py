"""`pdfleet worker`: builds the config, serves the app with uvicorn and turns SIGTERM into a drain; the CLI calls run()."""
from __future__ import annotations

import argparse
import logging
import os

import uvicorn

from pdfleet_worker.server.app import Worker, build_app
from pdfleet_worker.server.draining_server import DrainingServer
from pdfleet_worker.server.worker_config import WorkerConfig, from_args

def serve(cfg: WorkerConfig, log_level: str = "info") -> int:
    try:
        worker = Worker(cfg)
    except ValueError as e:  # an unusable --auth-token-file
        raise SystemExit(f"pdfleet worker: {e}")
    app = build_app(worker)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=log_level, access_log=log_level == "debug",
                            timeout_graceful_shutdown=5, lifespan="on", timeout_keep_alive=30)
    server = DrainingServer(config, worker.drain)
    server.run()
    return 0 if worker.load_error is None else 1


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        cfg = from_args(args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"pdfleet worker: {e}")
    return serve(cfg, args.log_level)
