"""bench/router.py end to end (issue 28): the stub worker, the router of this checkout and of a baseline tree (this
checkout again, to exercise the worktree path), the checking client, one JSON line with the keys the README's row
reads. Times nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KEYS = {
    "router_cpu_ms_per_token",
    "router_cpu_ms_per_token_saturated",
    "router_tokens_per_s",
    "direct_tokens_per_s",
    "router_cpu_ms_per_token_vs_base",
    "router_tokens_per_s_saturated_vs_base",
}


@pytest.mark.slow
def test_router_bench_smoke_run_ends_with_its_keys(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "router.py"), "--smoke", "--baseline-tree", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert KEYS <= set(out), sorted(KEYS - set(out))
    assert out["router_cpu_ms_per_token"] > 0 and out["router_tokens_per_s"] > 0 and out["reps"] == 1
    assert list(tmp_path.iterdir()) == [], "the bench removes its logs after a run that succeeded"


def test_router_bench_refuses_a_baseline_that_is_not_a_checkout(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "router.py"), "--baseline-tree", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode != 0 and "holds no workers/pdfleet_worker" in result.stderr
