"""Every benchmark script starts as `python bench/X.py` (bench/operator.py must not shadow the stdlib)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))


def test_all_interface_scripts_exist():
    assert {"engine.py", "pd.py", "operator.py", "autoscaler.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_starts(script):
    result = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True,
                            timeout=120, cwd=BENCH.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage" in result.stdout.lower()
