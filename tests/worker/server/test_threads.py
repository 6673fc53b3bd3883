"""Torch threads sized from the container (server/threads.py): quota, affinity mask and the pod's CPU request, one
core kept for the server loop unless the model is heavy on a container of 2 CPUs; `--num-threads auto` is the
default, and a number still wins."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pdfleet_worker.model import model_init
from pdfleet_worker.server import threads, worker_config


def _cgroup_v2(tmp_path: Path, quota: str, parent_quota: str = "max 100000") -> tuple[Path, Path]:
    root = tmp_path / "cg2"
    own = root / "kubepods.slice" / "pod1" / "ctr"
    own.mkdir(parents=True)
    (root / "kubepods.slice" / "pod1" / "cpu.max").write_text(parent_quota + "\n")
    (own / "cpu.max").write_text(quota + "\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods.slice/pod1/ctr\n")
    return proc, root


def test_a_cpu_quota_sizes_the_threads_not_the_nodes_cores(tmp_path) -> None:
    proc, root = _cgroup_v2(tmp_path, "400000 100000")
    assert threads.cgroup_quota(proc, root) == 4.0
    plan = threads.plan(threads.cgroup_quota(proc, root), affinity=64, request=None)
    assert (plan.threads, plan.cpus) == (3, 4.0) and "quota" in plan.source
    # A parent's tighter quota binds too (a pod-level limit over a container without one).
    proc, root = _cgroup_v2(tmp_path / "b", "max 100000", parent_quota="250000 100000")
    assert threads.cgroup_quota(proc, root) == 2.5
    assert threads.plan(2.5, 64, None).threads == 1


def test_cgroup_v1_quota_and_no_quota(tmp_path) -> None:
    root = tmp_path / "cg1"
    own = root / "cpu,cpuacct" / "kubepods" / "pod1"
    own.mkdir(parents=True)
    (own / "cpu.cfs_quota_us").write_text("300000\n")
    (own / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/kubepods/pod1\n3:cpu,cpuacct:/kubepods/pod1\n")
    assert threads.cgroup_quota(proc, root) == 3.0
    (own / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads.cgroup_quota(proc, root) is None


def test_without_a_quota_the_affinity_mask_or_the_pods_request_decide() -> None:
    assert threads.plan(None, 8, None).threads == 7
    assert threads.plan(None, 64, 2.0).threads == 1 and threads.plan(None, 64, 2.0).source == "pod's CPU request"
    assert threads.plan(None, 1, None).threads == 1, "never fewer than one"
    assert threads.plan(1.5, 2, None).threads == 1
    assert threads.requested_cpus({"PDFLEET_CPU_REQUEST": "2000"}) == 2.0
    assert threads.requested_cpus({"PDFLEET_CPU_REQUEST": ""}) is None
    assert threads.requested_cpus({}) is None


def test_a_worker_started_without_the_flag_sizes_its_threads_from_the_container(llama, monkeypatch) -> None:
    """What a pod gets: no number, a 4-CPU quota on a 64-core node -> 3 threads (HEAD: None, torch's one per core)."""
    monkeypatch.setattr(threads, "cgroup_quota", lambda: 4.0)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _pid: set(range(64)))
    monkeypatch.delenv(threads.REQUEST_ENV, raising=False)
    p = argparse.ArgumentParser()
    worker_config.add_arguments(p)
    base = ["--model", llama.path, "--device", "cpu", "--num-kv-blocks", "8"]
    assert worker_config.from_args(p.parse_args(base)).engine.num_threads == 3
    assert worker_config.from_args(p.parse_args(base + ["--num-threads", "auto"])).engine.num_threads == 3
    monkeypatch.setenv(threads.REQUEST_ENV, "2000")  # the rendered pod's request, no limit
    monkeypatch.setattr(threads, "cgroup_quota", lambda: None)
    assert worker_config.from_args(p.parse_args(base)).engine.num_threads == 1
    assert worker_config.from_args(p.parse_args(base + ["--num-threads", "5"])).engine.num_threads == 5


def _preset_config(tmp_path: Path, preset: str, tie: bool = False) -> Path:
    """A model directory holding only the preset's config.json: what the thread rule reads."""
    import json

    ids = {model_init.BOS: 0, model_init.EOS: 1}
    cfg = model_init._hf_config(
        model_init.PRESETS[preset], "llama", model_init.PRESETS[preset]["vocab_size"], ids, "float32", tie
    )
    d = tmp_path / f"{preset}-{tie}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_a_heavy_model_on_two_cpus_shares_the_server_core_a_light_one_keeps_it(tmp_path) -> None:
    """The measured pair (bench/serve.py, bench/threads.py): on 2 cores the `small` preset served 1.45x with 2 threads,
    the `tiny` preset 0.97x (nothing gained); from 3 CPUs, and for a model of unknown size, one core stays the
    server's."""
    small, tiny = _preset_config(tmp_path, "small"), _preset_config(tmp_path, "tiny")
    flops_small, flops_tiny = threads.model_flops_per_token(small), threads.model_flops_per_token(tiny)
    assert 240e6 < flops_small < 260e6 and 7e6 < flops_tiny < 9e6
    assert flops_tiny < threads.HEAVY_FLOPS_PER_TOKEN <= flops_small
    # Tied embeddings: the one table is the LM head, so it counts; untied, the input table does not.
    tied = threads.model_flops_per_token(_preset_config(tmp_path, "small", tie=True))
    assert tied == pytest.approx(flops_small)
    assert threads.model_flops_per_token(tmp_path / "missing") is None
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    assert threads.model_flops_per_token(tmp_path / "bad") is None

    heavy = threads.resolve("auto", affinity=[0, 1], detect=False, model=small)
    assert (heavy.threads, heavy.kept) == (2, 0) and "shared with the server" in heavy.describe()
    assert "251 MFLOP per token" in heavy.describe()
    light = threads.resolve("auto", affinity=[0, 1], detect=False, model=tiny)
    assert (light.threads, light.kept) == (1, 1) and "1 kept for the server" in light.describe()
    assert threads.resolve("auto", affinity=[0, 1], detect=False, model=tmp_path / "missing").threads == 1
    assert threads.resolve("auto", affinity=list(range(64)), quota=2.0, detect=False, model=small).threads == 2
    assert threads.resolve("auto", affinity=list(range(64)), quota=2.5, detect=False, model=small).threads == 2
    assert threads.resolve("auto", affinity=[0, 1, 2], detect=False, model=small).threads == 2
    assert threads.resolve("auto", affinity=list(range(8)), detect=False, model=small).threads == 7
    assert threads.resolve(1, affinity=[0, 1], detect=False, model=small).threads == 1, "a number still wins"


def test_the_worker_and_its_openmp_size_a_heavy_model_alike(tmp_path, monkeypatch) -> None:
    small = _preset_config(tmp_path, "small")
    monkeypatch.setattr(threads, "cgroup_quota", lambda: None)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setenv(threads.REQUEST_ENV, "2000")
    env: dict[str, str] = {}
    assert threads.export_openmp("auto", env, model=small).threads == 2 and env["OMP_NUM_THREADS"] == "2"
    p = argparse.ArgumentParser()
    worker_config.add_arguments(p)
    args = p.parse_args(["--model", str(small), "--device", "cpu", "--num-kv-blocks", "8"])
    assert worker_config.from_args(args).engine.num_threads == 2


def test_the_flag_takes_auto_or_a_positive_number() -> None:
    p = argparse.ArgumentParser()
    worker_config.add_arguments(p)
    base = ["--model", "m"]
    assert p.parse_args(base).num_threads is None
    assert p.parse_args(base + ["--num-threads", "auto"]).num_threads == "auto"
    assert p.parse_args(base + ["--num-threads", "3"]).num_threads == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            p.parse_args(base + ["--num-threads", bad])
    assert threads.resolve(3, affinity=[0, 1], detect=False).threads == 3
    assert threads.resolve("auto", affinity=[0, 1, 2, 3], quota=None, request=None, detect=False).threads == 3
    assert threads.resolve(None, affinity=list(range(64)), quota=2.0, detect=False).threads == 1


def test_openmp_gets_the_same_count_before_torch_loads(monkeypatch) -> None:
    """OpenMP reads its default team size from the environment when it loads, per thread: set once, before torch."""
    monkeypatch.setattr(threads, "cgroup_quota", lambda: 3.0)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _pid: set(range(16)))
    env: dict[str, str] = {}
    assert threads.export_openmp(None, env).threads == 2 and env == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    env = {"OMP_NUM_THREADS": "6"}
    threads.export_openmp(4, env)
    assert env == {"OMP_NUM_THREADS": "6", "MKL_NUM_THREADS": "4"}, "an operator's own setting stays"


def test_the_worker_command_sets_openmp_before_torch_loads() -> None:
    import subprocess
    import sys

    code = (
        "import sys, os\n"
        "from pdfleet_worker.server import threads\n"
        "threads.export_openmp('auto')\n"
        "assert 'torch' not in sys.modules, 'threads imports no torch'\n"
        "import torch\n"
        "print(os.environ['OMP_NUM_THREADS'], torch.get_num_threads())\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k not in threads.OPENMP_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    omp, torch_threads = out.stdout.split()
    assert omp == str(threads.resolve("auto").threads) and torch_threads == omp, "torch's pool takes it at import"
