"""The simulator against the local fleet (issue 10's validation): one short CSV trace replayed through
`pdfleet up examples/local-tiny.yaml --load trace.csv` and through `pdfleet simulate --fleet
examples/sim/local-tiny.yaml --calibration cal.json`, the `cpu` class calibrated on this machine just before
(`bench/sim.py calibrate --stat median`: the engine and one HTTP hop as the shared machine is now). TTFT p50
and generated tokens/s must agree within 25%.

The trace is 60 s at about 1 request/s with 32-256-token prompts and 16-64-token outputs: far below what
two cores sustain, so the comparison is of latency, not of a queue that a few % of speed would tip over.

On a shared 2-core machine the local fleet's own TTFT p50 moves with other jobs' load (25-43 ms for the
same trace), and the calibration measured a minute earlier may not see the same load. So a miss is
measured once more from a fresh calibration and a fresh replay; a systematic error of the simulator
misses both attempts, and the failure message shows both. Measured (simulated vs local TTFT p50):
-9%, +24%, +16%, -15% in four runs (load average 0.5-1.6); +4%, +77%, -25% with an earlier 40-s trace
(load 1-2.3). Tokens/s agreed within 2% every time.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from tests.local.conftest import CHILD_ENV, PDFLEET, ROOT, UpProcess, model_dir, write_spec  # noqa: F401
from tests.support.components import free_port

TOLERANCE = 0.25
# A miss is measured again from a fresh calibration (see the module docstring); an error in the model
# is systematic and misses every attempt.
ATTEMPTS = 2


def write_trace(path, seconds: float = 60.0, rate: float = 1.0, seed: int = 1) -> int:
    rng = random.Random(seed)
    rows, t = [], 0.0
    while t < seconds:
        rows.append(f"{t:.3f},{rng.randint(32, 256)},{rng.randint(16, 64)}\n")
        t += rng.expovariate(rate)
    path.write_text("timestamp,prompt_tokens,output_tokens\n" + "".join(rows))
    return len(rows)


def measure(workdir, model_dir, trace, n: int) -> tuple[dict[str, float], dict[str, str], dict]:  # noqa: F811
    """Calibrate the `cpu` class now, replay `trace` through `pdfleet up` and through `pdfleet simulate`."""
    workdir.mkdir()
    cal = workdir / "cal.json"
    # one torch thread: what `pdfleet up` gives each worker (--threads-per-worker 1)
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "sim.py"), "calibrate", "--model", str(model_dir),
                           "--threads", "1", "--stat", "median", "--reps", "5", "--http-reps", "40", "--out", str(cal)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **CHILD_ENV})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    calibration = json.loads(cal.read_text())
    assert "http_hop_s" in calibration

    spec = write_spec(workdir, model_dir)
    report = workdir / "up.json"
    up = UpProcess([str(spec), "--port", str(free_port()), "--load", str(trace), "--report", str(report)], cwd=workdir)
    try:
        assert up.wait(240) == 0, up.output()[-6000:]
    finally:
        up.stop()
    real = json.loads(report.read_text())

    out = workdir / "sim"
    done = subprocess.run(PDFLEET + ["simulate", "--fleet", str(ROOT / "examples" / "sim" / "local-tiny.yaml"),
                                     "--trace", str(trace), "--calibration", str(cal), "--out", str(out),
                                     "--no-plots", "--quiet"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    sim = next(iter(json.loads((out / "report.json").read_text())["policies"].values()))

    assert real["completed"] == sim["completed"] == n and real["generated_tokens"] == sim["generated_tokens"]
    compared = {
        "ttft_p50_s": (real["ttft_p50_s"], sim["ttft_p50_s"]),
        "tokens_per_s": (real["generated_tokens_per_s"], sim["generated_tokens"] / sim["simulated_s"]),
    }
    errors = {k: (s - r) / r for k, (r, s) in compared.items()}
    detail = {k: f"local {r:.4g} simulated {s:.4g} ({errors[k]:+.0%})" for k, (r, s) in compared.items()}
    return errors, detail, calibration


@pytest.mark.slow
def test_the_simulator_reproduces_the_local_fleet_within_25_percent(tmp_path, model_dir):  # noqa: F811
    trace = tmp_path / "trace.csv"
    n = write_trace(trace)
    attempts = []
    for attempt in range(ATTEMPTS):
        errors, detail, calibration = measure(tmp_path / f"attempt-{attempt}", model_dir, trace, n)
        attempts.append(detail)
        print(json.dumps({"attempt": attempt, "calibration": calibration, **detail}))
        if all(abs(e) <= TOLERANCE for e in errors.values()):
            break
    assert all(abs(e) <= TOLERANCE for e in errors.values()), attempts
