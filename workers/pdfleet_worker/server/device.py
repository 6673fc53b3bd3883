"""The device a worker computes on and the memory its KV pool is sized from: the vendor's torch bridge loaded by
try-import, the device checked present (never a silent CPU fallback), a CPU pod's cgroup memory limit; worker_config
calls it.

NOTE: the worker's CLI sets TORCH_DEVICE_BACKEND_AUTOLOAD=0 before torch is first imported: an installed
torch_npu whose CANN libraries are absent otherwise makes `import torch` itself fail. The bridge of the
device a worker is told to use is imported here instead, where its failure is a clear message.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from pathlib import Path

AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"
MEMINFO = Path("/proc/meminfo")
PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
_V1_UNLIMITED = 1 << 62  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


class DeviceUnavailable(ValueError):
    """The worker was told to compute on a device that this machine (or pod) does not give it."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """A torch device type and the module that registers it with torch (None: built into torch)."""

    kind: str
    bridge: str | None
    what: str


BACKENDS = {
    b.kind: b
    for b in (
        Backend("cuda", None, "an NVIDIA GPU or MIG slice (or a Hygon DCU with DTK's torch)"),
        Backend("npu", "torch_npu", "a Huawei Ascend NPU"),
        Backend("mlu", "torch_mlu", "a Cambricon MLU"),
        Backend("xpu", None, "an Intel GPU"),
    )
}
DEVICES = ("auto", "cpu", *BACKENDS)


def resolve_device(device: str, accelerator_class: str | None = None) -> str:
    """The torch device string to compute on. `auto`: cuda when torch sees a GPU, else cpu (local use).
    Any other accelerator must be there: its bridge imports and torch counts the device, else
    DeviceUnavailable naming the device and the accelerator class."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = device.partition(":")
    if kind == "cpu" and not index:
        return device
    if kind not in BACKENDS or (index and not index.isdigit()):
        raise ValueError(f"--device {device!r}: expected one of {', '.join(DEVICES)}, optionally with :N")
    backend = BACKENDS[kind]
    told = f"--device {device}" + (f" (accelerator class {accelerator_class})" if accelerator_class else "")
    refuse = f"this worker was told to compute on {backend.what} and does not fall back to the CPU"
    import torch

    if backend.bridge is not None:
        try:
            importlib.import_module(backend.bridge)
        # NOTE: any exception: a bridge without its vendor libraries fails as ImportError, OSError or RuntimeError.
        except Exception as e:
            raise DeviceUnavailable(
                f"{told}: {backend.bridge} cannot be imported ({type(e).__name__}: {e}); {refuse}"
            ) from None
    module = getattr(torch, kind, None)
    count = module.device_count() if module is not None and module.is_available() else 0
    if count == 0:
        raise DeviceUnavailable(f"{told}: torch sees no {kind} device (torch {torch.__version__}); {refuse}")
    if index and int(index) >= count:
        raise DeviceUnavailable(f"{told}: torch sees {count} {kind} device(s), so no index {index}; {refuse}")
    return device


@dataclasses.dataclass(frozen=True)
class FreeMemory:
    """Bytes the worker may still fill (weights + KV), and where that figure came from (for messages)."""

    bytes: int
    source: str


def free_memory(device: str, cgroup_dirs: Sequence[Path] | None = None, meminfo: Path = MEMINFO) -> FreeMemory:
    """An accelerator: its free memory. The CPU: the headroom under the pod's cgroup memory limit, or
    MemAvailable when no limit is set (local use)."""
    kind = device.partition(":")[0]
    if kind != "cpu":
        import torch

        free, _ = getattr(torch, kind).mem_get_info(torch.device(device))
        return FreeMemory(int(free), f"{device} free memory")
    dirs = own_cgroup_dirs() if cgroup_dirs is None else list(cgroup_dirs)
    limited = [(room, d) for d in dirs if (room := cgroup_headroom(Path(d))) is not None]
    if limited:
        # NOTE: the node's MemAvailable is not consulted under a limit: the pod's limit is what it was given
        # (a Guaranteed pod has it reserved); the node's free RAM changes with its neighbours.
        room, where = min(limited)
        return FreeMemory(max(0, room), f"the memory limit of cgroup {where}")
    return FreeMemory(mem_available(meminfo), f"MemAvailable of {meminfo} (no cgroup memory limit)")


def mem_available(meminfo: Path = MEMINFO) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{meminfo} has no MemAvailable")


def cgroup_headroom(d: Path) -> int | None:
    """limit - (usage - reclaimable page cache) of one cgroup directory (v2 memory.max or v1
    memory.limit_in_bytes); None when it sets no limit or is not a memory cgroup."""
    v2 = (d / "memory.max").is_file()
    names = (
        ("memory.max", "memory.current", "inactive_file")
        if v2
        else ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    )
    try:
        limit_text = (d / names[0]).read_text().strip()
        if limit_text == "max" or int(limit_text) >= _V1_UNLIMITED:
            return None
        used = int((d / names[1]).read_text().strip())
    except (OSError, ValueError):
        return None
    stat = _stat(d / "memory.stat")
    # Inactive page cache (the model files just read) is reclaimed before the OOM killer acts.
    return int(limit_text) - (used - stat.get(names[2], stat.get("inactive_file", 0)))


def own_cgroup_dirs(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> list[Path]:
    """This process's memory cgroup directory and its ancestors (a parent's limit binds too), for cgroup
    v2 (`0::/path`) and v1 (`N:memory:/path`); the mount root when the path is not visible (a container
    without a cgroup namespace sees only its own cgroup there)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    out: list[Path] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            mount = root
        elif "memory" in controllers.split(","):
            mount = root / "memory"
        else:
            continue
        own = mount / path.lstrip("/")
        start = own if own.is_dir() else mount
        out += [start, *(p for p in start.parents if p.is_relative_to(mount))]
    return list(dict.fromkeys(out))


def _stat(path: Path) -> dict[str, int]:
    try:
        pairs = (line.split() for line in path.read_text().splitlines())
        return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}
    except OSError:
        return {}
