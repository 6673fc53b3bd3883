"""The simulator compiled with mypyc (sim/native.py) answers exactly as it does interpreted, is what the suite runs
(`make test` builds it first), and a build of other sources is never loaded."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdfleet_operator.sim import native
from tests.sim.support import ROOT

NOT_TIMINGS = ("wall", "cpu", "compiled")


def simulate(out: Path, compiled: bool) -> dict:
    env = {**os.environ, "PDFLEET_SIM_NATIVE": "1" if compiled else "0"}
    cmd = [
        sys.executable,
        "-m",
        "pdfleet_operator.cli",
        "simulate",
        "--fleet",
        str(ROOT / "examples/sim/fleet-100.yaml"),
    ]
    cmd += ["--trace", "conversation", "--duration", "90m", "--compare", "--no-plots", "--jobs", "1", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("runs interpreted" in proc.stderr) is not compiled, proc.stderr[-2000:]
    doc = json.loads((out / "report.json").read_text())
    assert doc["compiled"] is compiled
    return doc


def answers(doc: dict) -> dict:
    """report.json without its timings."""

    def strip(x):  # noqa: ANN001, ANN202
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if not any(t in k for t in NOT_TIMINGS)}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    return strip(doc)


# NOTE: mypy (mypyc) comes with the dev extra, which `make test` installs, and `make test` builds first: there these
# never skip. An install without the dev extra (the operator image) has no compiler for the simulator and runs it
# interpreted, which the rest of tests/sim covers.
needs_mypyc = pytest.mark.skipif(
    importlib.util.find_spec("mypyc") is None, reason="mypy (mypyc) is not installed: the simulator runs interpreted"
)


def built() -> None:
    assert native.active(), f"no build of the simulator's current sources: run `make sim-native` ({native.build_dir()})"


@needs_mypyc
def test_the_suite_runs_the_build_of_these_sources():
    built()


@needs_mypyc
def test_compiled_and_interpreted_give_the_same_report(tmp_path):
    built()
    compiled = simulate(tmp_path / "compiled", compiled=True)
    interpreted = simulate(tmp_path / "interpreted", compiled=False)
    # every policy, the equal-SLO search (variants stopped early included) and the comparison's figures
    assert compiled["equal_slo"] and compiled["policies"]
    assert answers(compiled) == answers(interpreted)


def test_a_build_is_matched_to_its_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("PDFLEET_SIM_NATIVE_DIR", str(tmp_path / "cache"))
    here = tmp_path / "sources"
    here.mkdir()
    for m in native.MODULES:
        (here / f"{m}.py").write_bytes((native.HERE / f"{m}.py").read_bytes())
    monkeypatch.setattr(native, "HERE", here)
    built = native.build_dir()
    (built / "pdfleet_operator" / "sim").mkdir(parents=True)
    path: list[str] = []
    assert native.enable(path) is None and path == [], "a build that did not finish is not used"
    (built / native.DONE).write_text("")
    assert native.enable(path) == built and path == [str(built / "pdfleet_operator" / "sim")]
    (here / "engine.py").write_text((here / "engine.py").read_text() + "\n# edited\n")
    assert native.build_dir() != built, "an edited module has another build"
    assert native.enable([]) is None
    monkeypatch.setenv("PDFLEET_SIM_NATIVE", "0")
    (native.build_dir() / native.DONE).parent.mkdir(parents=True)
    (native.build_dir() / native.DONE).write_text("")
    assert native.enable([]) is None, "PDFLEET_SIM_NATIVE=0 runs interpreted"
