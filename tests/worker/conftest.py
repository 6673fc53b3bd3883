"""Fixtures every folder of the worker's tests shares, defined once here so that the session-scoped ones start once:
tiny HF models, the transformers oracle and engines that must end whole (oracle.py); real worker and router processes on
loopback (processes.py)."""

from __future__ import annotations

from tests.worker.oracle import llama, make_engine, tiny, tiny_models  # noqa: F401
from tests.worker.processes import logdir, model_dir, pipeline, pytest_sessionfinish, token_file  # noqa: F401
