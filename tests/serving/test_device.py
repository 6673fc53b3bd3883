"""The worker picks its device itself: the operator renders no --device, so a GPU pod must find its GPU."""

from __future__ import annotations

import pytest

from pdfleet_worker.server.worker_config import resolve_device


def test_explicit_devices_are_kept():
    for device in ("cpu", "cuda", "cuda:1"):
        assert resolve_device(device) == device


def test_auto_follows_what_torch_sees():
    torch = pytest.importorskip("torch")
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
