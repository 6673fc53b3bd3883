"""The simulator's event loop compiled with mypyc, loaded only when it was built from the sources in this checkout.

A day of the 100-accelerator example fleet is ~1.1M requests, and `pdfleet simulate --compare` runs ten such days;
interpreted, each request costs ~25 us of Python across the event loop, the replica model and the router. mypyc
compiles those modules as they are (typed Python, the same code and meaning) into C extensions that run it about
twice as fast (bench/HISTORY.md), and nothing depends on it: without a build (no compiler, no mypy, a module edited
since) the same modules run interpreted and `pdfleet simulate` says so.

`make sim-native` (which `make venv` runs; `native.main(["build"])`) compiles MODULES into
`<cache>/<digest>/`, the digest over their sources and this Python's ABI: an edited module has another digest, so a
build of older sources is never loaded. `enable()` (the package's `__init__`) puts a build of these very sources in
front of the package's own directory. `PDFLEET_SIM_NATIVE=0` runs interpreted; tests/sim/test_native.py holds a
compiled run's report equal to an interpreted one's.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

# The hot path (profiled: the event loop, the replica model, the router's kept scores); the rest of the package
# (fleet files, reports, plots, the operator's decide code it calls) stays interpreted.
MODULES = ("stats", "perf_model", "engine", "router", "simulator")
HERE = Path(__file__).resolve().parent
DONE = "BUILT"  # written last: a directory without it is a build that did not finish


def cache_root() -> Path:
    """$PDFLEET_SIM_NATIVE_DIR, else ~/.cache/pdfleet/sim-native (as the worker's kernels are cached), else (a
    read-only home) the temp dir's. Nothing is created here: it runs at every import of the package."""
    if os.environ.get("PDFLEET_SIM_NATIVE_DIR"):
        return Path(os.environ["PDFLEET_SIM_NATIVE_DIR"])
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdfleet" / "sim-native"
    existing = next((p for p in (home, *home.parents) if p.exists()), None)
    if existing is not None and os.access(existing, os.W_OK):
        return home
    return Path(tempfile.gettempdir()) / "pdfleet-sim-native"


def digest() -> str:
    """What a build must have been made from: the modules' sources and the interpreter's extension ABI."""
    key = hashlib.sha256()
    key.update(f"{sys.implementation.cache_tag} {sysconfig.get_config_var('EXT_SUFFIX')}".encode())
    for name in MODULES:
        key.update(name.encode() + b"\0" + (HERE / f"{name}.py").read_bytes())
    return key.hexdigest()[:16]


def build_dir() -> Path:
    return cache_root() / digest()


def wanted() -> bool:
    return os.environ.get("PDFLEET_SIM_NATIVE", "1") != "0"


def enable(package_path: list[str]) -> Path | None:
    """Put the build of these sources, if there is one, in front of the package's directory (`package_path`, the
    package's __path__); the build's directory, else None."""
    if not wanted():
        return None
    try:
        out = build_dir()
    except OSError:  # a module unreadable: nothing to match a build against
        return None
    if not (out / DONE).is_file():
        return None
    package_path.insert(0, str(out / "pdfleet_operator" / "sim"))
    if str(out) not in sys.path:
        sys.path.append(str(out))  # mypyc's runtime library for the build is a top-level module
    return out


def active() -> bool:
    """Whether the simulator's modules running in this process are the compiled ones."""
    from pdfleet_operator.sim import engine, simulator

    return not engine.__file__.endswith(".py") and not simulator.__file__.endswith(".py")  # type: ignore[union-attr]


def note() -> str | None:
    """A line for `pdfleet simulate` when it runs interpreted: why, and how to compile it."""
    if active():
        return None
    if not wanted():
        return "the simulator runs interpreted (PDFLEET_SIM_NATIVE=0)"
    return "the simulator runs interpreted, about half as fast: `make sim-native` compiles it for these sources"


def build(log=print) -> Path:  # noqa: ANN001 - a print-like callable
    """build_dir(), compiled first if it is not there. The package is copied to a scratch directory (mypyc writes
    its extensions beside the sources it compiles) and the finished build renamed into place, so a reader never
    sees half of one; a second builder finding it there keeps the first's."""
    out = build_dir()
    if (out / DONE).is_file():
        log(f"sim-native: up to date ({out})")
        return out
    if importlib.util.find_spec("mypyc") is None:
        raise RuntimeError("mypyc is not installed (pip install mypy): the simulator stays interpreted")
    worker = importlib.util.find_spec("pdfleet_worker")
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    log(f"sim-native: compiling {', '.join(MODULES)} with mypyc (a minute or two) ...")
    with tempfile.TemporaryDirectory(prefix="build-", dir=out.parent) as scratch:
        src = Path(scratch) / "src"
        shutil.copytree(HERE.parent, src / "pdfleet_operator", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        env = {**os.environ, "PDFLEET_SIM_NATIVE": "0"}
        if worker is not None and worker.submodule_search_locations:
            # the router's picker, typed (it is called, not compiled)
            env["MYPYPATH"] = str(Path(next(iter(worker.submodule_search_locations))).parent)
        proc = subprocess.run(
            [sys.executable, "-m", "mypyc", *(f"pdfleet_operator/sim/{m}.py" for m in MODULES)],
            cwd=src,
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"mypyc failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        stage = Path(scratch) / "out"
        (stage / "pdfleet_operator" / "sim").mkdir(parents=True)
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        for lib in src.glob(f"*{suffix}"):  # the shared runtime library
            shutil.move(lib, stage / lib.name)
        for m in MODULES:
            shutil.move(src / "pdfleet_operator" / "sim" / f"{m}{suffix}", stage / "pdfleet_operator" / "sim")
        (stage / DONE).write_text(f"{' '.join(MODULES)}\n")
        try:
            os.replace(stage, out)
        except OSError:
            if not (out / DONE).is_file():  # not another builder's finished copy: a real failure
                raise
    log(f"sim-native: built in {time.monotonic() - start:.0f} s ({out})")
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="sim-native", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("build", "status"))
    args = p.parse_args(argv)
    if args.command == "status":
        print(f"{'compiled' if active() else 'interpreted'}; build for these sources: {build_dir()}")
        return 0
    try:
        build()
    except RuntimeError as e:
        print(f"sim-native: {e}", file=sys.stderr)
        return 1
    return 0
