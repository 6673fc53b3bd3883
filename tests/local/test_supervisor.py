"""The supervisor's rules without a fleet: worker command lines and environments per class (GPU devices handed out
once), back-off that doubles to its cap and starts over after a replica has served, drain order."""

from __future__ import annotations

import json
import sys

import pytest

from pdfleet_operator.decide.placement import FleetPlan, PlannedPool
from pdfleet_operator.local import machine
from pdfleet_operator.local import spec as specs
from pdfleet_operator.local import supervisor as sv
from pdfleet_operator.local.process import Child
from tests.local.conftest import ROOT, write_spec
from tests.support.components import free_port


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(tmp_path, model_dir, gpus: int = 0, **changes) -> tuple[sv.Supervisor, Clock]:
    local = specs.load(write_spec(tmp_path, model_dir, **changes), ROOT / "examples" / "acceleratorclasses.yaml")
    clock = Clock()
    sup = sv.Supervisor(local, tmp_path / "run", free_port(), threads=2, machine=machine.Machine(2, gpus), clock=clock)
    return sup, clock


def test_worker_command_and_environment_follow_the_class(tmp_path, model_dir):
    sup, _ = make(
        tmp_path,
        model_dir,
        gpus=2,
        **{"decode.acceleratorClasses": ["h100-80gb"], "engine.extraArgs": ["--max-n", "2"]},
    )
    gpu = sv.Replica("decode-0", "decode", "h100-80gb", 9001, sup._gpus_for("h100-80gb"))
    sup.workers.append(gpu)
    assert gpu.devices == (0,) and sup._gpus_for("h100-80gb") == (1,)
    sup.workers.append(sv.Replica("decode-1", "decode", "h100-80gb", 9002, (1,)))
    with pytest.raises(specs.UpError, match="1 GPU\\(s\\) per replica, 0 free"):
        sup._gpus_for("h100-80gb")
    argv = sup._worker_argv(gpu)
    assert argv[:4] == [sys.executable, "-m", "pdfleet_operator.cli", "worker"] and argv[-2:] == ["--max-n", "2"]
    assert ["--role", "decode"] == argv[argv.index("--role") : argv.index("--role") + 2] and "--device" in argv
    assert argv[argv.index("--engine-config") + 1] == str(tmp_path / "run" / "engine.json")
    assert argv[argv.index("--num-threads") + 1] == "2"
    env = sup._env(gpu)
    assert (
        env["CUDA_VISIBLE_DEVICES"] == "0"
        and env["PDFLEET_ACCELERATOR"] == "h100-80gb"
        and env["OMP_NUM_THREADS"] == "2"
    )
    cpu = sv.Replica("prefill-0", "prefill", "cpu", 9003)
    cpu_argv = sup._worker_argv(cpu)
    assert cpu_argv[cpu_argv.index("--device") + 1] == "cpu" and sup._env(cpu)["CUDA_VISIBLE_DEVICES"] == ""
    router = sup._router_argv()
    assert router[router.index("--workers-file") + 1] == str(tmp_path / "run" / "workers.json")


def test_cpu_workers_get_tcmalloc_preloaded_unless_turned_off(tmp_path, model_dir, monkeypatch):
    monkeypatch.setattr(machine.ctypes.util, "find_library", lambda name: f"lib{name}.so.4")
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")
    sup, _ = make(tmp_path, model_dir)
    for name in ("off", "absent", "bad"):
        (tmp_path / name).mkdir()
    cpu = sv.Replica("decode-0", "decode", "cpu", 9001)
    assert sup._env(cpu)["LD_PRELOAD"] == "/opt/other.so:libtcmalloc_minimal.so.4"  # the user's own kept first
    assert sup._env(sv.Replica("router", "router", "", 9002))["LD_PRELOAD"] == "/opt/other.so"  # workers only
    monkeypatch.setenv(machine.PRELOAD_ENV, "none")
    assert make(tmp_path / "off", model_dir)[0]._env(cpu)["LD_PRELOAD"] == "/opt/other.so"
    monkeypatch.setenv(machine.PRELOAD_ENV, "auto")
    monkeypatch.setattr(machine.ctypes.util, "find_library", lambda name: None)  # not installed: nothing preloaded
    assert make(tmp_path / "absent", model_dir)[0]._env(cpu)["LD_PRELOAD"] == "/opt/other.so"
    monkeypatch.setenv(machine.PRELOAD_ENV, "jemalloc")
    with pytest.raises(specs.UpError, match="PDFLEET_PRELOAD='jemalloc': use auto"):
        make(tmp_path / "bad", model_dir)


def test_back_off_doubles_to_its_cap_and_starts_over_after_serving(tmp_path, model_dir):
    sup, clock = make(tmp_path, model_dir)
    sup.startup = False
    r = sv.Replica("decode-0", "decode", "cpu", 9001)
    r.child = Child("decode-0", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "c.log", {}).start()
    code = r.child.wait(30)
    sup.workers.append(r)
    waits = []
    for _ in range(7):
        r.state = sv.READY
        sup._exited(r, code, clock.now)
        waits.append(r.backoff_s)
        assert r.state == sv.BACKOFF and r.restart_at == clock.now + r.backoff_s
    assert waits == [1, 2, 4, 8, 16, 30, 30]
    assert sup.events[-1].message == f"pid {r.child.pid} exited with status 3; restarting in 30s"
    r.state, r.ready_since = sv.READY, clock.now - sv.BACKOFF_RESET_S
    sup._exited(r, code, clock.now)
    assert r.backoff_s == 1, "a replica that served for BACKOFF_RESET_S starts over"
    sup.startup = True
    r.state = sv.STARTING
    with pytest.raises(specs.UpError, match="decode-0 exited with status 3 while the fleet was starting"):
        sup._exited(r, code, clock.now)


def test_scaling_down_drains_a_crashed_replica_first_then_the_newest(tmp_path, model_dir):
    sup, _ = make(tmp_path, model_dir)
    sup.run_dir.mkdir()
    a, b, c = (sv.Replica(f"decode-{i}", "decode", "cpu", 9001 + i, state=sv.READY) for i in range(3))
    b.state = sv.BACKOFF
    sup.workers += [a, b, c]
    plan = FleetPlan((PlannedPool("prefill", "cpu", 0), PlannedPool("decode", "cpu", 1)))
    sup.scale_to(FleetPlan((PlannedPool("decode", "cpu", 2),)))
    assert b not in sup.workers and [e.subject for e in sup.events] == ["decode-1"], "the crashed one goes first"
    sup.scale_to(plan)
    assert [r.name for r in sup.active("decode")] == ["decode-0"], "then the newest"


def test_the_router_and_prometheus_files_list_the_pools_a_colocated_spec_has(tmp_path, model_dir):
    sup, _ = make(
        tmp_path,
        model_dir,
        disaggregation=False,
        prefill=None,
        decode=None,
        colocated={"acceleratorClasses": ["cpu"], "minReplicas": 1, "maxReplicas": 2},
    )
    sup.run_dir.mkdir()
    sup.workers += [
        sv.Replica("colocated-0", "colocated", "cpu", 9001, state=sv.READY),
        sv.Replica("colocated-1", "colocated", "cpu", 9002, state=sv.DRAINING),
    ]
    sup.write_files()
    assert json.loads((sup.run_dir / "workers.json").read_text()) == {"workers": ["http://127.0.0.1:9001"]}
    groups = json.loads((sup.run_dir / "prometheus-targets.json").read_text())
    assert groups == [
        {
            "targets": ["127.0.0.1:9001"],
            "labels": {
                "namespace": "default",
                "pdfleet_deployment": "local-tiny",
                "pdfleet_role": "colocated",
                "pdfleet_accelerator": "cpu",
                "replica": "colocated-0",
            },
        }
    ]
    assert json.loads((sup.run_dir / "engine.json").read_text())["max_model_len"] == 1024
    (target,) = sup.scrape_targets()  # the direct-scrape source gets the labels Prometheus gets from the file
    assert (target.url, target.engine, dict(target.labels)) == (
        "http://127.0.0.1:9001/metrics",
        "pdfleet",
        groups[0]["labels"],
    )


def test_up_replays_a_csv_trace_as_its_load(tmp_path):
    from rich.console import Console

    from pdfleet_operator.local import up

    trace = tmp_path / "t.csv"
    trace.write_text("timestamp,prompt_tokens,output_tokens\n100,8,4\n101.5,16,2\n130,8,8\n")
    runner = up.Up(up.Options(file="x.yaml", load=str(trace), duration=20.0), Console())
    assert [(a.t, a.prompt_tokens, a.output_tokens) for a in runner._arrivals()] == [(0.0, 8, 4), (1.5, 16, 2)]
    runner.opts.load = str(tmp_path / "missing.csv")
    with pytest.raises(specs.UpError, match="no such trace file"):
        runner._arrivals()
