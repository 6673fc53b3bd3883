"""The Dockerfile installs exactly what CI proves: the same constraints, extras that exist, the pinned torch."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_dockerfile_install_steps_match_ci():
    dockerfile = (ROOT / "Dockerfile").read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    targets = re.findall(r"^FROM \S+ AS (\w+)$", dockerfile, flags=re.M)
    assert {"operator", "torch", "kernels", "worker", "vendor"} <= set(targets)
    installs = re.findall(r"pip install -c constraints\.txt '\.\[(\w+)\]'", dockerfile)
    assert sorted(installs) == ["operator", "worker"] and set(installs) <= set(extras)
    # torch: the image takes the pin from constraints.txt, the same pin the worker extra declares.
    pin = next(line for line in (ROOT / "constraints.txt").read_text().splitlines() if line.startswith("torch=="))
    assert pin in extras["worker"], f"constraints pin {pin} differs from the worker extra {extras['worker']}"
    assert "grep '^torch==' constraints.txt" in dockerfile
    assert "torch" not in " ".join(extras["operator"])
    assert re.search(r"^USER 10001", dockerfile, flags=re.M)
    # The vendor target installs the worker extra without its torch (the base's torch drives the device).
    vendor = dockerfile[dockerfile.index("AS vendor") :]
    listed = re.search(r"'\.\[router\]' ([^\\]+)\\", vendor)[1].split()
    assert sorted(listed + ["pdfleet[router]", pin]) == sorted(
        re.sub(r"[<>=].*", "", d) if not d.startswith("torch") else d for d in extras["worker"]
    ), listed


def test_the_worker_image_carries_prebuilt_kernels_and_no_compiler():
    """g++ lives in the kernels stage only; the worker copies the libraries and points PDFLEET_KERNEL_DIR at them,
    and its build fails if a compiler slipped in or no library loads."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    stages = {name: base for base, name in re.findall(r"^FROM (\S+) AS (\w+)$", dockerfile, flags=re.M)}
    assert stages["kernels"] == "torch" and stages["worker"] == "torch"
    worker = dockerfile[dockerfile.index("FROM torch AS worker") : dockerfile.index("AS vendor")]
    kernels = dockerfile[dockerfile.index("FROM torch AS kernels") : dockerfile.index("FROM torch AS worker")]
    assert "g++" in kernels and "prebuilt_kernels build /opt/pdfleet/kernels" in kernels
    assert "COPY --from=kernels /opt/pdfleet/kernels /opt/pdfleet/kernels" in worker
    assert "PDFLEET_KERNEL_DIR=/opt/pdfleet/kernels" in worker and "! command -v g++" in worker
    assert "apt-get install" not in worker


def test_the_cpu_worker_image_preloads_tcmalloc_and_checks_it_loaded():
    """As `pdfleet up` does for CPU workers: the package where TCMALLOC is set, LD_PRELOAD by soname, and a build
    that fails when the preload did not take (ld.so only warns about a library it cannot find)."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    torch_stage = dockerfile[dockerfile.index("FROM base AS torch") : dockerfile.index("FROM torch AS kernels")]
    worker = dockerfile[dockerfile.index("FROM torch AS worker") : dockerfile.index("AS vendor")]
    assert "ARG TCMALLOC=" in torch_stage and 'if [ -n "$TCMALLOC" ]' in torch_stage
    assert "apt-get install -y --no-install-recommends libtcmalloc-minimal4" in torch_stage
    assert "ARG TCMALLOC=" in worker and "ENV LD_PRELOAD=${TCMALLOC:+libtcmalloc_minimal.so.4}" in worker
    assert "grep -q libtcmalloc_minimal /proc/self/maps" in worker
    # the soname is the one the Debian package ships and `pdfleet up` looks up
    from pdfleet_operator.local import machine

    assert machine.TCMALLOC == "tcmalloc_minimal"


def test_make_images_builds_the_operator_and_a_cpu_and_a_cuda_worker_under_the_names_the_chart_expects(tmp_path):
    """HEAD built one worker, with CPU torch: every NVIDIA pool rendered --device cuda crash-looped."""
    import os
    import shutil
    import subprocess

    import yaml

    if shutil.which("make") is None:
        from tests.support.components import missing

        missing("make")
    log = tmp_path / "docker.log"
    fake = tmp_path / "docker"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    fake.chmod(0o755)
    env = {**os.environ, "MAKEFLAGS": ""}
    usage = subprocess.run(["make", "-s", "images"], cwd=ROOT, capture_output=True, text=True)
    assert usage.returncode == 2 and "usage: make images REGISTRY=" in usage.stderr
    done = subprocess.run(
        ["make", "-s", "images", "REGISTRY=reg.example.com/t", f"DOCKER={fake}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    version = re.search(r'__version__ = "(.*)"', (ROOT / "operator/pdfleet_operator/__init__.py").read_text())[1]
    reg = "reg.example.com/t"
    assert log.read_text().splitlines() == [
        f"build --target operator -t {reg}/pdfleet-operator:{version} .",
        f"push {reg}/pdfleet-operator:{version}",
        f"build --target worker -t {reg}/pdfleet-worker:{version}-cpu "
        "--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu --build-arg TCMALLOC=1 .",
        f"push {reg}/pdfleet-worker:{version}-cpu",
        f"build --target worker -t {reg}/pdfleet-worker:{version}-cuda "
        "--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .",
        f"push {reg}/pdfleet-worker:{version}-cuda",
    ]
    values = yaml.safe_load((ROOT / "charts/pdfleet/values.yaml").read_text())
    assert values["image"]["repository"].endswith("/pdfleet-operator")
    assert values["workerImage"]["repository"].endswith("/pdfleet-worker")
    assert values["workerImage"]["platforms"] == ["cpu", "cuda"], "the chart names what make images builds"
    assert f"--set workerImage.repository={reg}/pdfleet-worker" in done.stdout
    assert "--set 'workerImage.platforms={cpu,cuda}'" in done.stdout
    # A vendor platform builds on the vendor's PyTorch image, and is refused before anything is built without one.
    log.unlink()
    refused = subprocess.run(
        ["make", "-s", "images", f"REGISTRY={reg}", f"DOCKER={fake}", "WORKER_PLATFORMS=cpu npu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
    )
    assert refused.returncode == 2 and "BASE_npu" in refused.stderr and not log.exists()
    vendor = subprocess.run(
        [
            "make",
            "-s",
            "images",
            f"REGISTRY={reg}",
            f"DOCKER={fake}",
            "WORKER_PLATFORMS=npu",
            "BASE_npu=vendor.example.com/cann-torch-npu:8",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
    )
    assert vendor.returncode == 0, vendor.stderr
    assert (
        f"build --target vendor -t {reg}/pdfleet-worker:{version}-npu --build-arg "
        "VENDOR_BASE=vendor.example.com/cann-torch-npu:8 ." in log.read_text().splitlines()
    )
