"""The simulator against the local fleet under saturation (issues 10 and 20): one CSV trace that offers a prefill
pool more than it can serve, replayed through `pdfleet up` and through `pdfleet simulate`, with the `cpu` class
calibrated on this machine just before (`bench/sim.py calibrate --stat median`: the pdfleet engine and one HTTP hop
as the shared machine is now).

The fleet: one prefill and one decode worker (autoscaling off), the 150M-parameter `small` model (fp32, one thread
each), prompts of 600-900 tokens and outputs of 8-24, Poisson arrivals at 1.2x what the prefill replica serves
(from the calibration) for 45 s. So the prefill queue grows all along and is drained after the last arrival: TTFT
is mostly queueing, and tokens/s (first arrival to last answer) is the pool's capacity, not the offered load.

Compared, simulated against local, within TOLERANCE: TTFT p50 and p99, ITL p50 and p99, generated tokens/s.

The model must be able to fail: the same replay simulated with the calibration's prefill MFU halved (the pool
half as fast) must miss (`BROKEN`), or the comparison proves nothing. On a machine the fleet has to itself (CI:
two clean runs within TOLERANCE) the calibrated model must reproduce the local fleet; on one other jobs load
(a load average above the cores + 1 when a replay starts) it is optimistic (see the NOTE at its test) and a miss
there is reported as an expected failure with its numbers, not hidden by a looser tolerance.

On a shared 2-core machine the local fleet's speed moves with other jobs' load, and a calibration taken a minute
earlier may not see the same load; a miss is measured once more from a fresh calibration and a fresh replay (an
error of the simulator misses both; the failure message shows both attempts).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.local.conftest import CHILD_ENV, PDFLEET, ROOT, UpProcess, write_spec
from tests.support.components import free_port

# NOTE: opt-in (`make validate-sim`): a measurement of this machine's speed against the model's prediction, about
# 3.5 minutes, and only meaningful on a machine the fleet has to itself. In `make test` it failed once in CI
# (2026-12-02: TTFT p50 -47%, ITL p99 -59%, both attempts) where other jobs shared the runner.
pytestmark = pytest.mark.measure

# Relative error allowed per metric (simulated vs local). NOTE: p99s are of ~30-60 requests (the last few
# of a growing queue) and ITL p99 of one engine's slowest steps on a machine other jobs share.
TOLERANCE = {"ttft_p50_s": 0.35, "ttft_p99_s": 0.35, "itl_p50_s": 0.35, "itl_p99_s": 0.6, "tokens_per_s": 0.2}
ATTEMPTS = 2
OFFERED = 1.2  # x the prefill replica's capacity
BROKEN = 0.5  # the prefill MFU factor of the deliberately wrong model
PROMPTS, OUTPUTS, SECONDS = (600, 900), (8, 24), 45.0


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sat-models") / "small"
    subprocess.run(
        PDFLEET + ["model", "init", str(path), "--preset", "small"],
        check=True,
        capture_output=True,
        env={**os.environ, **CHILD_ENV},
        timeout=600,
    )
    return path


def prefill_s(cal: dict, prompt: float) -> float:
    """One prompt's prefill on the calibrated engine: its chunks (maxNumBatchedTokens 512) each cost the step
    overhead, and every token the fitted slope."""
    times = {int(k): v for k, v in cal["prefill_s"].items()}
    xs, ys = list(times), list(times.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    chunks = -(-int(prompt) // 512)
    return chunks * cal["step_overhead_s"] + slope * prompt


def write_trace(path: Path, rate: float, seed: int = 1) -> int:
    rng = random.Random(seed)
    rows, t = [], 0.0
    while t < SECONDS:
        rows.append(f"{t:.3f},{rng.randint(*PROMPTS)},{rng.randint(*OUTPUTS)}\n")
        t += rng.expovariate(rate)
    path.write_text("timestamp,prompt_tokens,output_tokens\n" + "".join(rows))
    return len(rows)


def sim_fleet(path: Path, model: Path) -> None:
    """examples/sim/local-tiny.yaml with the small model's architecture and the fixed 1 + 1 pools."""
    from pdfleet_worker.config import ModelConfig

    cfg = ModelConfig.from_dir(model)
    doc = yaml.safe_load((ROOT / "examples" / "sim" / "local-tiny.yaml").read_text())
    doc["acceleratorClassFiles"] = [str(ROOT / "examples" / "acceleratorclasses.yaml")]
    spec = doc["deployment"]["spec"]
    spec["model"].update(
        name="small",
        architecture={
            "parametersBillions": cfg.num_params / 1e9,
            "layers": cfg.num_layers,
            "kvHeads": cfg.num_kv_heads,
            "headDim": cfg.head_dim,
        },
    )
    spec["prefill"].update(minReplicas=1, maxReplicas=1)
    spec["decode"].update(minReplicas=1, maxReplicas=1)
    spec["autoscaling"] = {"enabled": False}
    path.write_text(yaml.safe_dump(doc))


def simulate(workdir: Path, fleet: Path, trace: Path, cal: Path, name: str) -> dict:
    out = workdir / name
    done = subprocess.run(
        PDFLEET
        + [
            "simulate",
            "--fleet",
            str(fleet),
            "--trace",
            str(trace),
            "--calibration",
            str(cal),
            "--out",
            str(out),
            "--no-plots",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return next(iter(json.loads((out / "report.json").read_text())["policies"].values()))


def errors_of(real: dict, sim: dict) -> tuple[dict[str, float], dict[str, str]]:
    compared = {k: (real[k], sim[k]) for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")}
    compared["tokens_per_s"] = (real["generated_tokens_per_s"], sim["generated_tokens"] / sim["simulated_s"])
    errors = {k: (s - r) / r for k, (r, s) in compared.items()}
    return errors, {k: f"local {r:.4g} simulated {s:.4g} ({errors[k]:+.0%})" for k, (r, s) in compared.items()}


def within(errors: dict[str, float]) -> bool:
    return all(abs(e) <= TOLERANCE[k] for k, e in errors.items())


def measure(workdir: Path, model: Path) -> dict:
    """Calibrate now, write a trace at OFFERED x the prefill capacity, replay it locally and simulated (and
    simulated with the broken model)."""
    workdir.mkdir()
    load_before = os.getloadavg()[0]
    cal = workdir / "cal.json"
    # one torch thread: what `pdfleet up` gives each worker (--threads-per-worker 1)
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "sim.py"),
            "calibrate",
            "--model",
            str(model),
            "--preset",
            "small",
            "--threads",
            "1",
            "--stat",
            "median",
            "--reps",
            "3",
            "--http-reps",
            "20",
            "--out",
            str(cal),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **CHILD_ENV},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    calibration = json.loads(cal.read_text())
    capacity = 1.0 / prefill_s(calibration, sum(PROMPTS) / 2)  # requests/s one prefill replica serves
    trace = workdir / "trace.csv"
    n = write_trace(trace, OFFERED * capacity)

    spec = write_spec(
        workdir,
        model,
        **{
            "model.name": "small",
            "prefill.minReplicas": 1,
            "prefill.maxReplicas": 1,
            "decode.minReplicas": 1,
            "decode.maxReplicas": 1,
            "autoscaling": {"enabled": False},
        },
    )
    report = workdir / "up.json"
    up = UpProcess([str(spec), "--port", str(free_port()), "--load", str(trace), "--report", str(report)], cwd=workdir)
    try:
        assert up.wait(600) == 0, up.output()[-6000:]
    finally:
        up.stop()
    real = json.loads(report.read_text())

    fleet = workdir / "fleet.yaml"
    sim_fleet(fleet, model)
    sim = simulate(workdir, fleet, trace, cal, "sim")
    assert real["completed"] == sim["completed"] == n and real["generated_tokens"] == sim["generated_tokens"]
    broken_cal = workdir / "broken.json"
    broken_cal.write_text(json.dumps({**calibration, "prefill_mfu": calibration["prefill_mfu"] * BROKEN}))
    broken = simulate(workdir, fleet, trace, broken_cal, "broken")
    errors, detail = errors_of(real, sim)
    broken_errors, broken_detail = errors_of(real, broken)
    one = prefill_s(calibration, sum(PROMPTS) / 2)
    return {
        "errors": errors,
        "detail": detail,
        "broken_errors": broken_errors,
        "broken_detail": broken_detail,
        "requests": n,
        "offered_per_s": round(OFFERED * capacity, 3),
        "prefill_s": round(one, 3),
        # saturated: a queue made the local TTFT p50 several times one prompt's own prefill
        "saturated": real["ttft_p50_s"] > 2 * one,
        "calibration": calibration,
        "load_average": round(max(load_before, os.getloadavg()[0]), 2),
    }


@pytest.fixture(scope="module")
def replays(tmp_path_factory, small_model) -> list[dict]:
    """Up to ATTEMPTS saturated replays (a fresh calibration each), stopping at the first within TOLERANCE."""
    root = tmp_path_factory.mktemp("saturated")
    attempts = []
    for attempt in range(ATTEMPTS):
        got = measure(root / f"attempt-{attempt}", small_model)
        attempts.append(got)
        print(
            json.dumps({"attempt": attempt, **{k: v for k, v in got.items() if k not in ("errors", "broken_errors")}})
        )
        if got["saturated"] and within(got["errors"]):
            break
    return attempts


def _summary(attempts: list[dict]) -> list[dict]:
    return [
        {
            "ok": a["detail"],
            "broken": a["broken_detail"],
            "saturated": a["saturated"],
            "prefill_s": a["prefill_s"],
            "offered_per_s": a["offered_per_s"],
            "load_average": a["load_average"],
        }
        for a in attempts
    ]


def shared_with_other_jobs(attempts: list[dict]) -> bool:
    """Every attempt ran while more was runnable than the cores and one more (the fleet's own four processes
    keep two cores busy at saturation; beyond that, other jobs took the time the calibration saw free)."""
    return all(a["load_average"] > (os.cpu_count() or 1) + 1 for a in attempts)


@pytest.mark.slow
def test_a_model_with_half_the_prefill_speed_misses_the_saturated_local_fleet(replays):
    for got in replays:
        assert got["saturated"], (
            "no queue formed locally: the calibration misjudged the replica's speed",
            _summary(replays),
        )
        assert not within(got["broken_errors"]), ("a model with half the prefill speed passed", _summary(replays))


# NOTE: on a machine the fleet has to itself (two clean-clone CI runs, 2026-12-01) the calibrated model was
# within TOLERANCE. On the shared 2-core development machine (load average 2-12 from other jobs), four attempts
# in two runs: simulated vs local TTFT p50 -40%, -68%, -55%, -59%, TTFT p99 -45% to -70%, tokens/s +24%,
# +65%, +28%, +54%, ITL p50 -6% to -38%: optimistic. The calibration times one worker alone; in the replay the
# prefill worker shares two cores with the decode worker, the router, the load generator and the other jobs,
# and at saturation it never idles, so other jobs take exactly the time the model counted on. A miss there is
# an expected failure with its numbers; a miss on a machine without other jobs fails.
@pytest.mark.slow
def test_the_simulator_reproduces_the_saturated_local_fleet(replays):
    if not within(replays[-1]["errors"]) and shared_with_other_jobs(replays):
        pytest.xfail(
            f"other jobs load this machine (load average {[a['load_average'] for a in replays]} on "
            f"{os.cpu_count()} cores): the simulator, calibrated on free cores, is optimistic: {_summary(replays)}"
        )
    assert within(replays[-1]["errors"]), _summary(replays)
