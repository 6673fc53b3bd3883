"""`make demo` as the README runs it (in a copy of the repository, reusing this venv): exit 0, a scale-up and a
scale-down of a role, the summary printed last; `make up` runs the same fleet without load."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

import pytest

from tests.local.conftest import CHILD_ENV, ROOT
from tests.support.components import free_port, missing

pytestmark = pytest.mark.slow


def repo_copy(tmp_path):
    for name in ("Makefile", "pyproject.toml", "constraints.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    return tmp_path


def test_make_demo_scales_a_role_up_and_down_and_prints_the_summary_last(tmp_path):
    if shutil.which("make") is None:
        missing("make (the README's `make demo`)")  # skips on a workstation without make; fails under CI=true
    repo = repo_copy(tmp_path)
    started = time.monotonic()
    # -o venv: this venv is already installed (`make test` made it); everything after it runs as written.
    result = subprocess.run(
        ["make", "-o", "venv", "demo"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **CHILD_ENV, "PDFLEET_PORT": str(free_port())},
    )
    took = time.monotonic() - started
    out = result.stdout
    assert result.returncode == 0, (out[-6000:], result.stderr[-3000:])
    assert (repo / "models" / "tiny" / "config.json").is_file(), "the demo model was made"
    header = "== pdfleet up local-tiny: summary =="
    summary = out[out.index(header) :]
    body = summary.splitlines()[1:]
    assert not [line for line in body if line.startswith("+")] and not out[out.index(header) :].count("make:"), summary
    m = re.search(r"^scaling   (\d+) up, (\d+) down:", summary, re.M)
    assert m and int(m.group(1)) >= 1 and int(m.group(2)) >= 1, summary
    assert re.search(r"^requests  \d+ scheduled, [1-9]\d* completed", summary, re.M), summary
    assert re.search(r"^TTFT      p50 [\d.]+s  p99 [\d.]+s", summary, re.M), summary
    assert re.search(r"\$[\d.]+ per 1M generated tokens", summary) and "cpu $0.1/unit-h" in summary, summary
    assert re.search(r"decode +1 -> [23] +(QueueAboveTarget|QueueGrowing|MaxReplicas|PrefillBacklog): ", summary), (
        summary
    )
    print(
        f"make demo took {took:.0f}s"
    )  # a number to read, not a bound: the 300 s subprocess timeout is the only limit


def test_make_up_runs_the_example_until_interrupted():
    dry = subprocess.run(
        ["make", "-n", "-o", "venv", "up"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "pdfleet up examples/local-tiny.yaml --port ${PDFLEET_PORT:-8000}\n" in dry and "--load" not in dry
