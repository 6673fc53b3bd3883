"""`pdfleet load`: the open-loop schedule (Poisson, bursts, CSV replay), percentiles as numpy computes them, and a
replayed trace against a real worker reporting what `pdfleet simulate` reports for the same trace, key for key."""

from __future__ import annotations

import json
import os
import subprocess
import time

import httpx
import numpy as np
import pytest

from pdfleet_operator import trace as tr
from pdfleet_operator.local import load
from tests.local.conftest import CHILD_ENV, PDFLEET, ROOT
from tests.support.components import free_port

# The keys both summaries carry and that a replay can be compared on.
SHARED_KEYS = (
    "requests",
    "completed",
    "rejected",
    "too_long",
    "unfinished",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "slo_attainment",
    "prompt_tokens",
    "generated_tokens",
)


def test_poisson_schedule_is_seeded_open_loop_and_bursts_where_asked():
    burst = load.Burst(5.0, 20.0, 40.0)
    a = load.poisson(4.0, 60.0, prompt_tokens=64, output_tokens=128, burst=burst, seed=3)
    assert a == load.poisson(4.0, 60.0, prompt_tokens=64, output_tokens=128, burst=burst, seed=3)
    assert a != load.poisson(4.0, 60.0, prompt_tokens=64, output_tokens=128, burst=burst, seed=4)
    times = [x.t for x in a]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 60.0
    inside = sum(1 for t in times if 20.0 <= t < 40.0) / 20.0
    outside = sum(1 for t in times if not 20.0 <= t < 40.0) / 40.0
    assert 14 < inside < 26 and 2.5 < outside < 5.5, (inside, outside)
    prompts = sorted(x.prompt_tokens for x in a)
    assert 50 < prompts[len(prompts) // 2] < 80 and all(1 <= p <= 256 for p in prompts)
    assert load.default_burst(5.0, 40.0) == load.Burst(5.0, 8.0, 22.0)
    for bad in (dict(rate=0.0, duration=1.0), dict(rate=1.0, duration=-1.0)):
        with pytest.raises(ValueError):
            load.poisson(prompt_tokens=8, output_tokens=8, **bad)
    with pytest.raises(ValueError, match="start < end"):
        load.Burst(2.0, 10.0, 5.0)


def test_percentiles_match_numpy_and_the_summary_counts_each_fate():
    rng = np.random.default_rng(0)
    values = rng.exponential(1.0, 101).tolist()
    for q in (0, 50, 90, 99, 100):
        assert load.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert load.percentile([], 50) is None
    arrivals = [load.Arrival(i * 0.1, 10, 4) for i in range(5)]
    ok = load.Result(arrivals[0], load.OK, 200, 0.05, [0.05, 0.06, 0.08, 0.09], 4)
    slow = load.Result(arrivals[1], load.OK, 200, 3.0, [3.0, 3.5], 2)
    results = [
        ok,
        slow,
        load.Result(arrivals[2], load.REJECTED, 503),
        load.Result(arrivals[3], load.TOO_LONG, 400),
        load.Result(arrivals[4], load.DROPPED),
    ]
    s = load.summarize(results, 10.0, slo_ttft=2.0, slo_itl=0.2)
    assert (s["requests"], s["sent"], s["completed"], s["rejected"], s["too_long"], s["dropped"]) == (5, 4, 2, 1, 1, 1)
    assert s["generated_tokens"] == 6 and s["prompt_tokens"] == 20 and s["generated_tokens_per_s"] == 0.6
    assert s["slo_attainment"] == 0.25, "1 of the 4 that were not too long met both targets"
    assert ok.tpot() == pytest.approx(0.04 / 3) and s["itl_p50_s"] == pytest.approx(0.015)
    assert set(SHARED_KEYS) <= set(s)


def test_a_trace_written_by_the_simulator_replays_as_written(tmp_path):
    trace = tr.synthetic("conversation", mean_rate=2.0, duration=30.0, seed=1)
    path = tmp_path / "t.csv"
    tr.write_csv(trace, path)
    got = load.from_trace(path)
    assert [a.prompt_tokens for a in got] == trace.prompt.tolist()
    assert [a.t for a in got] == pytest.approx((trace.arrival - trace.arrival[0]).tolist(), abs=1e-5)
    fast = load.from_trace(path, duration=5.0, speedup=2.0)
    assert fast and all(a.t < 5.0 for a in fast) and len(fast) >= sum(1 for t in got if t.t < 10.0) - 1
    (tmp_path / "bad.csv").write_text("timestamp,prompt_tokens,output_tokens\n0,ten,4\n")
    with pytest.raises(ValueError, match=r"bad.csv:2: prompt_tokens 'ten' is not a number"):
        load.from_trace(tmp_path / "bad.csv")


def test_load_cli_needs_a_shape_and_an_endpoint(tmp_path):
    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(PDFLEET + ["load", *argv], capture_output=True, text=True, timeout=60)

    assert "give --rate and --duration" in run("--url", "http://127.0.0.1:1").stderr
    (tmp_path / "t.csv").write_text("0,8,4\n")
    assert (
        "a --trace has its own arrivals"
        in run("--url", "http://x:1", "--trace", str(tmp_path / "t.csv"), "--rate", "2").stderr
    )
    down = run("--url", f"http://127.0.0.1:{free_port()}", "--rate", "5", "--duration", "2")
    assert down.returncode == 1 and "ConnectError" in down.stderr


@pytest.mark.slow
def test_a_replayed_trace_reports_what_the_simulator_reports_for_it(tmp_path, model_dir):
    trace = tmp_path / "trace.csv"
    trace.write_text("timestamp,prompt_tokens,output_tokens\n0.0,32,16\n0.2,48,8\n0.5,5000,8\n0.8,16,32\n1.0,24,12\n")
    port = free_port()
    log = open(tmp_path / "worker.log", "wb")
    worker = subprocess.Popen(
        PDFLEET
        + [
            "worker",
            "--model",
            str(model_dir),
            "--served-model-name",
            "tiny",
            "--role",
            "both",
            "--port",
            str(port),
            "--num-threads",
            "1",
            "--max-model-len",
            "1024",
            "--num-kv-blocks",
            "256",
            "--log-level",
            "warning",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **CHILD_ENV},
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert worker.poll() is None and time.monotonic() < deadline, (tmp_path / "worker.log").read_text()
            time.sleep(0.2)
        out = subprocess.run(
            PDFLEET
            + [
                "load",
                "--url",
                f"http://127.0.0.1:{port}/v1",
                "--trace",
                str(trace),
                "--slo-ttft",
                "2s",
                "--slo-itl",
                "200ms",
                "--json",
                str(tmp_path / "load.json"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
    finally:
        worker.terminate()
        worker.wait(30)
    assert "TTFT      p50" in out.stdout and "tokens/s" in out.stdout
    real = json.loads((tmp_path / "load.json").read_text())
    subprocess.run(
        PDFLEET
        + [
            "simulate",
            "--fleet",
            str(ROOT / "examples" / "sim" / "local-tiny.yaml"),
            "--trace",
            str(trace),
            "--out",
            str(tmp_path / "sim"),
            "--no-plots",
            "--quiet",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    sim = next(iter(json.loads((tmp_path / "sim" / "report.json").read_text())["policies"].values()))
    assert set(SHARED_KEYS) <= set(sim) and set(SHARED_KEYS) <= set(real)
    for key in ("requests", "completed", "too_long", "rejected", "prompt_tokens", "generated_tokens"):
        assert real[key] == sim[key], (key, real, sim)
    assert (real["completed"], real["too_long"], real["generated_tokens"]) == (4, 1, 68)
    assert 0 < real["ttft_p50_s"] <= real["ttft_p99_s"] and real["slo_attainment"] is not None
