"""CPU kernels compiled ahead of time, when the worker image is built, for each x86-64 level (and aarch64), and the
one this CPU runs found at start without a compiler; cpu_kernels.load() asks `find()` before it compiles.

The worker image has no compiler (`python:3.11-slim`): the Dockerfile's `kernels` stage installs g++, runs
`python -m pdfleet_worker.layers.prebuilt_kernels build /opt/pdfleet/kernels`, and the image copies only the
libraries, with PDFLEET_KERNEL_DIR pointing at them. `-march=native` there would target the build machine's CPU
(SIGILL on an older node), so each library targets one ISA level and `find()` loads the best level whose
instructions this CPU has (/proc/cpuinfo flags). A library is named by its level and a key over the kernel
source, torch's version and the flags, so a stale one is never loaded.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

ENV = "PDFLEET_KERNEL_DIR"
log = logging.getLogger("pdfleet.worker.kernels")

# (level, -march[+extensions], the /proc/cpuinfo flags a CPU needs for it), best first. The x86-64 psABI levels, and
# v4 with AVX512-BF16 (Cooper Lake, Sapphire Rapids and later Xeons, Zen 4 and later): the bf16 prefill attention's
# `vdpbf16ps` path (layers/cpu_kernels.cpp) exists only in a library built with it.
_V4 = frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})
X86_LEVELS = (
    ("x86-64-v4-bf16", "x86-64-v4+avx512bf16", _V4 | {"avx512_bf16"}),
    ("x86-64-v4", "x86-64-v4", _V4),
    ("x86-64-v3", "x86-64-v3", frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave", "abm"})),
    ("x86-64-v2", "x86-64-v2", frozenset({"sse4_1", "sse4_2", "ssse3", "popcnt", "cx16"})),
    ("x86-64", "x86-64", frozenset()),
)
ARM_LEVELS = (("armv8-a", "armv8-a", frozenset()),)


def levels(machine: str | None = None) -> tuple[tuple[str, str, frozenset[str]], ...]:
    machine = machine or platform.machine()
    return X86_LEVELS if machine in ("x86_64", "AMD64") else ARM_LEVELS


def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def best_level(flags: Iterable[str], available: Sequence[str], machine: str | None = None) -> str | None:
    """The best level among `available` whose required flags are all in `flags`."""
    have = set(flags)
    for name, _, needs in levels(machine):
        if name in available and needs <= have:
            return name
    return None


def _target(march: str) -> list[str]:
    """`x86-64-v4+avx512bf16` -> -march=x86-64-v4 -mavx512bf16 -mtune=generic."""
    base, *extensions = march.split("+")
    return [f"-march={base}", *(f"-m{e}" for e in extensions), "-mtune=generic"]


def _flags(march: str) -> list[str]:
    from pdfleet_worker.layers import cpu_kernels

    return [f for flag in cpu_kernels.FLAGS for f in (_target(march) if flag == "-march=native" else [flag])]


def library_name(level: str) -> str:
    """`pdfleet_cpu_kernels-<level>-<key>.so`: key over the source, torch's version and the flags."""
    import torch

    from pdfleet_worker.layers import cpu_kernels

    march = next(m for name, m, _ in levels() if name == level)
    key = hashlib.sha256()
    for part in (cpu_kernels.SOURCE.read_bytes(), torch.__version__.encode(), " ".join(_flags(march)).encode()):
        key.update(part)
    return f"pdfleet_cpu_kernels-{level}-{key.hexdigest()[:16]}.so"


def find(directory: str | None = None, flags: Iterable[str] | None = None) -> Path | None:
    """The prebuilt library for this CPU in `directory` ($PDFLEET_KERNEL_DIR), None when there is none to use."""
    directory = directory or os.environ.get(ENV)
    if not directory or not Path(directory).is_dir():
        return None
    names = {name: Path(directory) / library_name(name) for name, _, _ in levels()}
    present = [name for name, path in names.items() if path.is_file()]
    level = best_level(cpu_flags() if flags is None else flags, present)
    if level is None:
        log.warning("no prebuilt CPU kernels in %s for this CPU (present: %s)", directory, ", ".join(present) or "none")
        return None
    log.info("CPU kernels: prebuilt for %s, %s", level, names[level])
    return names[level]


def build(out_dir: Path, only: Sequence[str] | None = None, compiler: str | None = None) -> list[Path]:
    """Compile one library per level (all of this architecture's, or `only`) into `out_dir`."""
    from pdfleet_worker.layers import cpu_kernels

    compiler = compiler or cpu_kernels._compiler()
    out_dir.mkdir(parents=True, exist_ok=True)
    built = []
    for name, march, _ in levels():
        if only is not None and name not in only:
            continue
        out = out_dir / library_name(name)
        command = [
            f
            for a in cpu_kernels._compile_command(compiler, out)
            for f in (_target(march) if a == "-march=native" else [a])
        ]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling the CPU kernels for {name} failed:\n{proc.stderr[-3000:]}")
        built.append(out)
    return built


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m pdfleet_worker.layers.prebuilt_kernels", description=__doc__.splitlines()[0]
    )
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile the kernels for every ISA level of this architecture into DIR")
    b.add_argument("dir")
    b.add_argument("--level", action="append", help="only this level (repeatable)")
    c = sub.add_parser("check", help="load the library this CPU would use from DIR (the image's smoke test)")
    c.add_argument("dir")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "build":
        for path in build(Path(args.dir), args.level):
            print(path)
        return 0
    path = find(args.dir)
    if path is None:
        print(f"no prebuilt CPU kernels in {args.dir} for this CPU", file=sys.stderr)
        return 1
    import torch

    torch.ops.load_library(str(path))
    print(f"loaded {path}: torch.ops.pdfleet.paged_decode_attention={torch.ops.pdfleet.paged_decode_attention}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
