"""CPU kernels built with the image (layers/prebuilt_kernels.py): one library per ISA level compiled ahead of time,
the best one this CPU runs loaded at start by a worker that has no compiler (the image has none)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdfleet_worker.layers import prebuilt_kernels as pk
from tests.support.components import free_port

V4 = {
    "avx512f",
    "avx512bw",
    "avx512cd",
    "avx512dq",
    "avx512vl",
    "avx",
    "avx2",
    "bmi1",
    "bmi2",
    "f16c",
    "fma",
    "movbe",
    "xsave",
    "abm",
    "sse4_1",
    "sse4_2",
    "ssse3",
    "popcnt",
    "cx16",
}
AVX2_ONLY = V4 - {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
LEVELS = ["x86-64-v4-bf16", "x86-64-v4", "x86-64-v3", "x86-64-v2", "x86-64"]


def test_the_best_level_the_cpu_runs_is_chosen_among_those_built() -> None:
    assert pk.best_level(V4, LEVELS, "x86_64") == "x86-64-v4", "AVX-512 without BF16 (Skylake, Ice Lake)"
    assert pk.best_level(V4 | {"avx512_bf16"}, LEVELS, "x86_64") == "x86-64-v4-bf16"
    assert pk.best_level(AVX2_ONLY | {"avx512_bf16"}, LEVELS, "x86_64") == "x86-64-v3", "bf16 needs the v4 base too"
    assert pk.best_level(AVX2_ONLY, LEVELS, "x86_64") == "x86-64-v3", "no AVX-512 on this node: never the v4 build"
    assert pk.best_level(set(), LEVELS, "x86_64") == "x86-64"
    assert pk.best_level(V4, ["x86-64-v3"], "x86_64") == "x86-64-v3"
    assert pk.best_level(AVX2_ONLY, ["x86-64-v4"], "x86_64") is None, "a v4 build only: nothing this CPU can run"
    assert pk.best_level({"asimd"}, ["armv8-a"], "aarch64") == "armv8-a"


def test_a_level_with_extensions_compiles_with_each_and_no_native_target() -> None:
    flags = pk._flags("x86-64-v4+avx512bf16")
    assert flags[flags.index("-march=x86-64-v4") + 1 : flags.index("-march=x86-64-v4") + 3] == [
        "-mavx512bf16",
        "-mtune=generic",
    ]
    assert "-march=native" not in flags and "-march=native" not in pk._flags("x86-64-v3")
    assert pk.library_name("x86-64-v4-bf16") != pk.library_name("x86-64-v4")


def test_a_library_is_named_by_its_level_and_key_and_found_only_when_present(tmp_path) -> None:
    name = pk.library_name("x86-64-v3")
    assert name.startswith("pdfleet_cpu_kernels-x86-64-v3-") and name.endswith(".so")
    assert name != pk.library_name("x86-64-v4")
    assert pk.find(str(tmp_path), V4) is None
    (tmp_path / pk.library_name("x86-64-v3")).write_bytes(b"")
    (tmp_path / "pdfleet_cpu_kernels-x86-64-v4-0000000000000000.so").write_bytes(b"")  # stale: other source/torch
    assert pk.find(str(tmp_path), V4) == tmp_path / pk.library_name("x86-64-v3")
    assert pk.find(str(tmp_path / "absent"), V4) is None


@pytest.mark.slow
def test_a_worker_with_no_compiler_on_path_loads_the_prebuilt_kernels(tmp_path) -> None:
    """The image's layout: libraries built here (the image's build stage, with g++), then a worker started with no
    compiler on PATH, an empty kernel cache and PDFLEET_KERNEL_DIR: it maps the prebuilt library, warns of no
    fallback, compiles nothing and serves. HEAD's worker needs g++ at first use: it warned and ran plain PyTorch."""
    if shutil.which("g++") is None:
        pytest.skip("g++ builds the libraries (the image's build stage)")
    if pk.levels()[-1][0] != "x86-64":
        pytest.skip("the levels of this test are x86-64's")
    level = pk.best_level(pk.cpu_flags(), LEVELS)
    kernels = tmp_path / "kernels"
    (built,) = pk.build(kernels, only=[level])
    model = tmp_path / "tiny"
    subprocess.run(
        [sys.executable, "-m", "pdfleet_operator.cli", "model", "init", str(model), "--preset", "tiny"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    bare = tmp_path / "bin"  # PATH holds nothing: no g++, c++ or cc
    bare.mkdir()
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC", "PDFLEET_CPU_KERNELS")}
    env.update(
        {
            "PATH": str(bare),
            "HOME": str(tmp_path / "home"),
            "PDFLEET_KERNEL_CACHE": str(cache),
            pk.ENV: str(kernels),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    assert shutil.which("g++", path=env["PATH"]) is None and shutil.which("c++", path=env["PATH"]) is None
    port = free_port()
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdfleet_operator.cli",
                "worker",
                "--model",
                str(model),
                "--device",
                "cpu",
                "--num-kv-blocks",
                "64",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-level",
                "info",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "tiny", "prompt": "hello kernels", "max_tokens": 8, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert str(built) in maps, "the prebuilt library is mapped into the worker"
        text = log.read_text()
        assert "CPU kernels unavailable" not in text and f"prebuilt for {level}" in text, text[-3000:]
        assert not cache.exists() or not any(cache.rglob("*.so")), "nothing was compiled"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
