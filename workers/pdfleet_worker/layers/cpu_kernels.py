"""Builds cpu_kernels.cpp with the host's C++ compiler on first use and loads it as torch.ops.pdfleet; ModelRunner and
attention call it.

`load()` answers whether the ops exist. Without a compiler (or with PDFLEET_CPU_KERNELS=0) it
answers False once, with a warning, and the engine keeps its plain-PyTorch paths.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path

import torch

from pdfleet_worker.layers import prebuilt_kernels

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# NOTE: -fopenmp because at::parallel_for is an inline OpenMP loop (without it the kernels run on
# one thread); the library then needs libgomp.so.1, which the loader resolves to the copy torch
# has already loaded, so there is one OpenMP runtime and one thread pool.
FLAGS = ["-O3", "-march=native", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno"]


def cache_dir() -> Path:
    """$PDFLEET_KERNEL_CACHE, else ~/.cache/pdfleet/kernels, else (read-only home) the temp dir's."""
    if os.environ.get("PDFLEET_KERNEL_CACHE"):
        return Path(os.environ["PDFLEET_KERNEL_CACHE"])
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdfleet" / "kernels"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / "pdfleet-kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _compile_command(compiler: str, out: Path) -> list[str]:
    root = Path(torch.__file__).parent
    inc, lib = root / "include", root / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        compiler,
        *FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{inc}",
        f"-I{inc / 'torch/csrc/api/include'}",
        f"-I{sysconfig.get_paths()['include']}",
        str(SOURCE),
        "-o",
        str(out),
        f"-L{lib}",
        "-lc10",
        "-ltorch_cpu",
        "-ltorch",
        f"-Wl,-rpath,{lib}",
    ]


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        raise FileNotFoundError("no C++ compiler (g++ or $CXX) on PATH")
    return compiler


def library_path() -> Path:
    """Where the library for this source, torch, compiler, flags and CPU lives (built or not)."""
    key = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        torch.__version__.encode(),
        _compiler().encode(),
        " ".join(FLAGS).encode(),
        _cpu_flags().encode(),
    ):
        key.update(part)
    return cache_dir() / f"pdfleet_cpu_kernels-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """library_path(), compiled first if it is not there (written to a temporary name, then renamed,
    so a reader never loads half a file).

    NOTE: builders of the same library take turns on a lock file beside it, and whoever comes second
    finds the library built: `pdfleet up` starts several workers at once, and on a fresh machine each
    compiled its own copy (~20 s of CPU each, measured on 2 cores) while the fleet was starting."""
    out = library_path()
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:  # a filesystem without locks: each process compiles, as before
            pass
        if out.exists():
            return out
        _compile(out)
    return out


def _compile(out: Path) -> None:
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    proc = subprocess.run(_compile_command(_compiler(), tmp), capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"compiling {SOURCE.name} failed:\n{proc.stderr[-3000:]}")
    os.replace(tmp, out)


@functools.lru_cache(maxsize=None)
def load() -> bool:
    """True when torch.ops.pdfleet.paged_decode_attention and pin_threads are usable."""
    if os.environ.get("PDFLEET_CPU_KERNELS", "1") == "0":
        return False
    try:
        # the image's ahead-of-time build (no compiler in it), else compiled here on first use
        torch.ops.load_library(str(prebuilt_kernels.find() or build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        warnings.warn(
            f"pdfleet CPU kernels unavailable, using plain PyTorch attention: {e}", RuntimeWarning, stacklevel=2
        )
        return False

    @torch.library.register_fake("pdfleet::paged_decode_attention")
    def _(out, q, kv, scale, tables, lens, softmax_scale):  # mutates out only: nothing to compute when tracing
        return None

    @torch.library.register_fake("pdfleet::onednn_linear")
    def _(x, packed, bias):  # packed keeps the weight's logical shape [out, in]
        return x.new_empty(*x.shape[:-1], packed.shape[0])

    return True


def pin_threads(cores: list[int], exclusive: bool = True) -> int:
    """Bind compute thread i to cores[i % len] (exclusive), or every compute thread to all of
    `cores`; returns how many threads took it (0 without the kernels). The calling thread is
    thread 0, and processes it starts inherit its affinity."""
    if not load() or not cores:
        return 0
    return int(torch.ops.pdfleet.pin_threads(list(cores), exclusive))


def parse_cores(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]."""
    cores: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"PDFLEET_CPU_BIND: {text!r} is not a core list like 0-3 or 0,2")
        cores += range(int(lo), int(hi or lo) + 1)
    return cores


def cores_to_bind(setting: str, threads: int, allowed: set[int]) -> list[int]:
    """The cores compute threads are bound to, [] for none. setting (PDFLEET_CPU_BIND): 'off';
    'auto' binds only when this process may use exactly as many cores as it has threads (a
    cpuset or a small machine of its own: binding to cores others may be bound to as well would
    only make collisions permanent); else a core list, which must lie inside the allowed cores."""
    if setting == "off":
        return []
    if setting == "auto":
        return sorted(allowed) if len(allowed) == threads else []
    cores = parse_cores(setting)
    if not set(cores) <= allowed:
        raise ValueError(
            f"PDFLEET_CPU_BIND={setting}: cores {sorted(set(cores) - allowed)} are not allowed "
            f"to this process (allowed: {sorted(allowed)})"
        )
    return cores


if __name__ == "__main__":  # python -m pdfleet_worker.layers.cpu_kernels: build and report
    print(build() if load() else "unavailable", file=sys.stderr)
