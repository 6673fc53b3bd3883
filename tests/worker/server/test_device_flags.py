"""A worker told to use an accelerator that is absent exits with a message naming the device and the class (never a CPU
fallback), an installed but unusable torch_npu breaks nothing, and a CPU pod's KV pool is sized from its cgroup memory
limit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdfleet_worker.config import ModelConfig
from pdfleet_worker.server import device
from pdfleet_worker.server.worker_config import kv_cache_bytes
from tests.support.components import free_port, missing

REPO = Path(__file__).resolve().parents[3]
PDFLEET = [sys.executable, "-m", "pdfleet_operator.cli"]
GiB, MiB = 1 << 30, 1 << 20
NO_FALLBACK = "does not fall back to the CPU"


def run_worker(model_dir: str, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("TORCH_DEVICE_BACKEND_AUTOLOAD", "PDFLEET_ACCELERATOR")}
    return subprocess.run(
        PDFLEET + ["worker", "--model", model_dir, "--port", str(free_port()), *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def test_worker_told_npu_without_one_exits_naming_device_and_class(llama):
    p = run_worker(llama.path, "--device", "npu", "--accelerator-class", "ascend-910b")
    assert p.returncode == 1, p.stderr
    assert p.stderr.strip().splitlines()[-1] == (
        "pdfleet worker: --device npu (accelerator class ascend-910b): torch_npu cannot be imported "
        "(ModuleNotFoundError: No module named 'torch_npu'); this worker was told to compute on a Huawei Ascend NPU "
        f"and {NO_FALLBACK}"
    )


def test_worker_told_cuda_it_lacks_exits_and_the_class_may_come_from_the_env(llama):
    absent = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU: absent on every machine
    p = run_worker(llama.path, "--device", absent, env={"PDFLEET_ACCELERATOR": "h100-80gb"})
    assert p.returncode == 1, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"pdfleet worker: --device {absent} (accelerator class h100-80gb): torch sees "), last
    assert last.endswith(f"NVIDIA GPU or MIG slice (or a Hygon DCU with DTK's torch) and {NO_FALLBACK}"), last


def test_devices_resolve_in_process():
    assert device.resolve_device("cpu") == "cpu"
    assert device.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu"), "auto stays as it was"
    with pytest.raises(ValueError, match="expected one of auto, cpu, cuda, npu, mlu, xpu"):
        device.resolve_device("tpu")
    with pytest.raises(ValueError, match="expected one of"):
        device.resolve_device("cuda:first")
    with pytest.raises(device.DeviceUnavailable, match=r"^--device mlu: torch_mlu cannot be imported"):
        device.resolve_device("mlu")
    if not torch.xpu.is_available():
        with pytest.raises(
            device.DeviceUnavailable, match=r"--device xpu \(accelerator class arc\): torch sees no xpu"
        ):
            device.resolve_device("xpu", "arc")


def test_installed_but_unusable_torch_npu_breaks_neither_torch_nor_the_message(llama, tmp_path):
    """The real torch_npu wheel on sys.path without Ascend's CANN libraries (as on every non-Ascend node)."""
    target = Path(os.environ.get("PDFLEET_TORCH_NPU_TARGET", REPO / "build" / "torch-npu"))
    if not (target / "torch_npu").is_dir():
        missing(f"torch_npu in {target} (pip install --no-deps --target {target} torch-npu==2.13.0)")
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH")) if p)}
    plain = subprocess.run(
        [sys.executable, "-c", "import torch"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env, "TORCH_DEVICE_BACKEND_AUTOLOAD": "1"},
    )
    assert plain.returncode != 0 and "Failed to load the backend extension: torch_npu" in plain.stderr, (
        "the premise: with autoloading on, this torch_npu breaks `import torch`"
    )
    p = run_worker(llama.path, "--device", "npu", "--accelerator-class", "ascend-910b", env=env)
    assert p.returncode == 1, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "pdfleet worker: --device npu (accelerator class ascend-910b): torch_npu cannot be "
        "imported (ImportError: libhccl.so"
    ), last
    init = subprocess.run(
        PDFLEET + ["model", "init", str(tmp_path / "m"), "--preset", "tiny"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert init.returncode == 0, init.stderr


# -- KV sizing from the cgroup ----------------------------------------------------------------------


def cgroup_v2(d: Path, limit: int | str, current: int, inactive_file: int) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "memory.max").write_text(f"{limit}\n")
    (d / "memory.current").write_text(f"{current}\n")
    (d / "memory.stat").write_text(
        f"anon {current - inactive_file}\nfile {inactive_file}\ninactive_file {inactive_file}\n"
    )
    return d


def cgroup_v1(d: Path, limit: int, usage: int, inactive_file: int) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (d / "memory.stat").write_text(f"cache 9\ninactive_file 1\ntotal_inactive_file {inactive_file}\n")
    return d


def test_cpu_memory_is_the_cgroup_limits_headroom(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       65536000 kB\nMemAvailable:   50000000 kB\n")
    pod = cgroup_v2(tmp_path / "v2", 4 * GiB, 1 * GiB, 512 * MiB)
    got = device.free_memory("cpu", [pod], meminfo)
    assert got.bytes == 4 * GiB - 512 * MiB, "the page cache it could reclaim is not in use"
    assert got.source == f"the memory limit of cgroup {pod}"
    unlimited = cgroup_v2(tmp_path / "none", "max", 1 * GiB, 0)
    assert device.free_memory("cpu", [unlimited], meminfo).bytes == 50000000 * 1024, "no limit: MemAvailable"
    v1 = cgroup_v1(tmp_path / "v1", 2 * GiB, 1 * GiB, 256 * MiB)
    assert device.free_memory("cpu", [v1], meminfo).bytes == 2 * GiB - 768 * MiB
    v1_unlimited = cgroup_v1(tmp_path / "v1-none", 9223372036854771712, 1 * GiB, 0)
    assert device.free_memory("cpu", [v1_unlimited], meminfo).source.startswith("MemAvailable")
    assert device.free_memory("cpu", [pod, v1, unlimited], meminfo).bytes == 2 * GiB - 768 * MiB, "the tightest binds"
    full = cgroup_v2(tmp_path / "full", 1 * GiB, 2 * GiB, 0)
    assert device.free_memory("cpu", [full], meminfo).bytes == 0


def test_own_cgroup_dirs_follow_proc_self_cgroup(tmp_path):
    root = tmp_path / "sys-fs-cgroup"
    (root / "kubepods" / "pod1" / "c1").mkdir(parents=True)
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1/c1\n")
    assert device.own_cgroup_dirs(proc, root) == [
        root / "kubepods" / "pod1" / "c1",
        root / "kubepods" / "pod1",
        root / "kubepods",
        root,
    ]
    proc.write_text("0::/elsewhere\n")  # not visible here: the container's own cgroup is the mount
    assert device.own_cgroup_dirs(proc, root) == [root]
    (root / "memory" / "x").mkdir(parents=True)
    proc.write_text("5:devices:/x\n4:memory:/x\n0::/\n")
    assert device.own_cgroup_dirs(proc, root) == [root / "memory" / "x", root / "memory", root]


def test_kv_pool_is_sized_from_the_pod_limit_not_the_nodes_free_ram(llama, tmp_path):
    cfg = ModelConfig.from_dir(llama.path)
    weights = sum(p.stat().st_size for p in Path(llama.path).glob("*.safetensors"))
    sizing = dict(
        fraction=0.5, device="cpu", dtype="float32", kv_dtype="auto", block_size=16, max_num_seqs=64, max_model_len=256
    )
    pod = cgroup_v2(tmp_path / "pod", weights + 8 * MiB + 100 * MiB, 100 * MiB, 0)  # 8 MiB above the weights
    assert kv_cache_bytes(llama.path, cfg, cgroup_dirs=[pod], **sizing) == 4 * MiB
    tight = cgroup_v2(tmp_path / "tight", weights + 100 * MiB, 100 * MiB, 0)  # room for the weights only
    with pytest.raises(
        ValueError, match=rf"no memory for the KV cache: 0.0 GiB free \(the memory limit of cgroup {tight}\)"
    ):
        kv_cache_bytes(llama.path, cfg, cgroup_dirs=[tight], **sizing)
