"""How many torch threads a worker computes with: sized from the CPUs its container may use, one core's worth kept
for the server loop unless the model's compute makes that core worth more to the threads (see `server_cores`);
worker_config calls `resolve` for `--num-threads` (default `auto`), and the worker's CLI calls `export_openmp` before
torch loads.

The CPUs a container may use are the fewest of: its CFS quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` /
`cpu.cfs_period_us`, of its cgroup and every ancestor), its affinity mask (a cpuset, the static CPU manager), and
the CPU request its pod declares (`$PDFLEET_CPU_REQUEST`, millicores, from the downward API: a pod without a
limit still gets only its request when the node is busy). Torch's own default is one thread per visible core:
in a pod with a 2-CPU quota on a 64-core node that is 64 threads throttled to 2 cores, and on 2 cores with a
benchmark client beside it measured a 7x collapse (issue 26).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
REQUEST_ENV = "PDFLEET_CPU_REQUEST"  # millicores (resourceFieldRef requests.cpu, divisor 1m)
SERVER_CORES = 1  # the HTTP server, tokenizer and scheduling loop run beside the compute threads
# Matmul FLOPs per token from which a model is compute-heavy: on a container of fewer than SHARE_ALL_BELOW_CPUS CPUs
# its threads take every core, the server loop sharing them (see server_cores).
HEAVY_FLOPS_PER_TOKEN = 50e6
SHARE_ALL_BELOW_CPUS = 3


@dataclasses.dataclass(frozen=True)
class ThreadPlan:
    """The threads chosen and why (logged at start, so a pod says what it computes with)."""

    threads: int
    cpus: float  # the CPUs the container may use
    source: str  # which limit decided: quota, affinity, request
    kept: int = SERVER_CORES  # cores left to the server loop
    flops_per_token: float | None = None  # the model's matmul FLOPs per token, when known

    def describe(self) -> str:
        if self.source == "--num-threads":
            return f"{self.threads} torch thread(s) (--num-threads)"
        model = "" if self.flops_per_token is None else f" (model: {self.flops_per_token / 1e6:.0f} MFLOP per token)"
        kept = f"{self.kept} kept for the server" if self.kept else "shared with the server"
        return f"{self.threads} torch thread(s): {self.cpus:g} CPU(s) by the container's {self.source}, {kept}{model}"


def parse_flag(text: str) -> int | str:
    """`--num-threads`: a positive count, or `auto`."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"--num-threads {text!r}: a positive number of threads, or auto") from None
    if n < 1:
        raise ValueError(f"--num-threads {n}: at least 1 (or auto)")
    return n


def server_cores(cpus: float, flops_per_token: float | None) -> int:
    """Cores left to the server loop (HTTP, SSE, tokenizer, the engine's Python) beside the compute threads.

    One, unless the container has fewer than SHARE_ALL_BELOW_CPUS CPUs and the model does at least
    HEAVY_FLOPS_PER_TOKEN per token: then that core is half the container, and the server's per-token work is small
    beside the compute's. Measured on 2 cores under 16 streams: the `small` preset (250 MFLOP per token) served
    0.65x vLLM's tokens/s with 1 thread and 0.93-1.02x with 2 (bench/serve.py); the `tiny` preset (8 MFLOP per
    token) served 0.97x with 2 threads what it served with 1 (bench/threads.py --quick; 0.23x before the binding fix
    in ModelRunner._bound, when the second thread shared the first one's core): a model that light gains nothing from
    the second thread, and the server loop keeps a core of its own. A model of unknown size keeps the core. From 3
    CPUs one core is kept whatever the model (as vLLM's CPU backend reserves one for its own loop): not measured on
    this 2-core machine.
    """
    heavy = flops_per_token is not None and flops_per_token >= HEAVY_FLOPS_PER_TOKEN
    return 0 if heavy and cpus < SHARE_ALL_BELOW_CPUS else SERVER_CORES


def plan(quota: float | None, affinity: int, request: float | None, flops_per_token: float | None = None) -> ThreadPlan:
    """Threads for a container that may use `quota` CPUs (None: no quota), `affinity` cores, and asked for `request`
    CPUs (None: unknown), serving a model of `flops_per_token` (None: unknown): the fewest of them, less the server's
    cores, at least one."""
    assert affinity >= 1, "a process runs on at least one core"
    limits = [(float(affinity), "affinity mask")]
    if quota is not None:
        limits.append((quota, "CPU quota (cgroup cpu.max)"))
    if request is not None and request > 0:
        limits.append((request, "pod's CPU request"))
    cpus, source = min(limits)
    kept = server_cores(cpus, flops_per_token)
    return ThreadPlan(max(1, math.floor(cpus) - kept), cpus, source, kept, flops_per_token)


def model_flops_per_token(model_dir: str | os.PathLike | None) -> float | None:
    """2 x the parameters a decode step multiplies (every linear and the LM head; not the input embedding table),
    from the model's config.json; None when there is none or it does not parse (the worker reports that itself)."""
    if model_dir is None:
        return None
    from pdfleet_worker.config import ModelConfig  # torch-free

    try:
        cfg = ModelConfig.from_dir(str(model_dir))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    embedding = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return 2.0 * (cfg.num_params - embedding)


def cgroup_quota(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> float | None:
    """The CPUs this process's cgroup (or an ancestor) is limited to, None when none is."""
    quotas = [q for d in _cpu_dirs(proc_cgroup, root) if (q := _quota_of(d)) is not None]
    return min(quotas) if quotas else None


def _quota_of(d: Path) -> float | None:
    try:
        if (d / "cpu.max").is_file():  # v2: "max 100000" or "200000 100000"
            fields = (d / "cpu.max").read_text().split()
            if fields[0] == "max":
                return None
            return int(fields[0]) / int(fields[1])
        if (d / "cpu.cfs_quota_us").is_file():  # v1: -1 for none
            quota = int((d / "cpu.cfs_quota_us").read_text())
            period = int((d / "cpu.cfs_period_us").read_text())
            return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cpu_dirs(proc_cgroup: Path, root: Path) -> list[Path]:
    """This process's cpu cgroup directory and its ancestors, v2 (`0::/path`) and v1 (`N:cpu,cpuacct:/path`); the mount
    root when the path is not visible (a container with its own cgroup namespace sees its cgroup at the root)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    out: list[Path] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            mount = root
        elif "cpu" in controllers.split(","):
            mount = next(
                (m for m in (root / controllers, root / "cpu", root / "cpu,cpuacct") if m.is_dir()), root / "cpu"
            )
        else:
            continue
        own = mount / path.lstrip("/")
        start = own if own.is_dir() else mount
        out += [start, *(p for p in start.parents if p.is_relative_to(mount))]
    return list(dict.fromkeys(out))


def requested_cpus(environ: dict[str, str] | os._Environ = os.environ) -> float | None:
    """The pod's CPU request from $PDFLEET_CPU_REQUEST (millicores), None when unset or not a number."""
    text = environ.get(REQUEST_ENV, "").strip()
    if not text.isdigit() or int(text) == 0:
        return None
    return int(text) / 1000


def resolve(
    setting: int | str | None,
    *,
    affinity: Sequence[int] | None = None,
    quota: float | None = None,
    request: float | None = None,
    detect: bool = True,
    model: str | os.PathLike | None = None,
) -> ThreadPlan:
    """The threads for `--num-threads` (None or `auto`: sized from this container and the model in `model`; a
    number: that many)."""
    cores = len(affinity if affinity is not None else os.sched_getaffinity(0))
    if isinstance(setting, int):
        return ThreadPlan(setting, float(cores), "--num-threads")
    if detect:
        quota = cgroup_quota() if quota is None else quota
        request = requested_cpus() if request is None else request
    return plan(quota, cores, request, model_flops_per_token(model))


OPENMP_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def export_openmp(
    setting: int | str | None,
    environ: dict[str, str] | os._Environ = os.environ,
    model: str | os.PathLike | None = None,
) -> ThreadPlan:
    """Before torch loads: OMP_NUM_THREADS and MKL_NUM_THREADS (those not set already) to the threads `setting`
    resolves to for the model in `model`.

    NOTE: torch.set_num_threads sizes torch's own pool, but OpenMP's default team size is per thread and read from
    the environment when the library loads: the engine steps in a thread of its own, and without these its OpenMP
    regions outside torch's (the C++ kernels, oneDNN) took one thread per core. Measured on 2 cores under 16
    streams (bench/threads.py): the worker with only set_num_threads served 0.92x the one with OMP_NUM_THREADS too.
    """
    plan_ = resolve(setting, model=model)
    for name in OPENMP_ENV:
        environ.setdefault(name, str(plan_.threads))
    return plan_
