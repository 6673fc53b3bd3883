"""One style for the whole repository: `ruff format --check` and `ruff check` (pyproject.toml's [tool.ruff]) pass on
every Python file; `make fmt` fixes what can be fixed automatically."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_every_python_file_is_formatted() -> None:
    proc = _ruff("format", "--check", ".")
    assert proc.returncode == 0, f"run `make fmt`:\n{proc.stdout}{proc.stderr}"


def test_every_python_file_passes_the_linter() -> None:
    proc = _ruff("check", "--output-format", "concise", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr
