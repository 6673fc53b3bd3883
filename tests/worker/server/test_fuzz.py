"""The OpenAI schema fuzzer, bounded: bench/fuzz.py (schemathesis with OpenAI's own OpenAPI document, from .venv-fuzz)
against a prefill/decode router and a colocated worker finds no 5xx, no error outside the OpenAI shape, no worker
address and no uncounted router answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.components import missing

REPO = Path(__file__).resolve().parents[3]
FUZZ_PYTHON = REPO / ".venv-fuzz" / "bin" / "python"


@pytest.mark.slow
def test_openai_schema_fuzzer_finds_nothing():
    if not os.access(FUZZ_PYTHON, os.X_OK):
        missing(f"the fuzzer's virtualenv {FUZZ_PYTHON.parent.parent} (`python3 bench/fuzz.py --install`)")
    # 6 operations x 2 modes x 2 targets x 15 cases: about 400 requests, ~25 s here with the processes' start.
    run = subprocess.run(
        [
            str(FUZZ_PYTHON),
            str(REPO / "bench" / "fuzz.py"),
            "--examples",
            "15",
            "--seed",
            "3",
            "--time-limit",
            "60",
            "--python",
            sys.executable,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    lines = run.stdout.strip().splitlines()
    assert lines, run.stderr[-3000:]
    summary = json.loads(lines[-1])
    assert run.returncode == 0 and summary["findings"] == 0, "\n".join(lines[:-1])[:6000]
    assert summary["server_errors"] == 0 and summary["tracebacks_in_logs"] == 0
    assert summary["cases"] >= 300 and summary["skipped_for_time"] == 0, summary
