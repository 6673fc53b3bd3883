"""`pdfleet router`: builds the RouterConfig and serves the router app with uvicorn, draining open streams on SIGTERM;
the CLI calls run()."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from pdfleet_worker.router.app import build_app
from pdfleet_worker.router.router_config import from_args
from pdfleet_worker.wire.draining_server import DrainingServer


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = from_args(args)
        app = build_app(cfg)
    except ValueError as e:
        raise SystemExit(f"pdfleet router: {e}")
    config = uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    DrainingServer(config, app.state.drain).run()
    return 0
