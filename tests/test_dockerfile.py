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
    assert {"operator", "worker"} <= set(targets)
    installs = re.findall(r"pip install -c constraints\.txt '\.\[(\w+)\]'", dockerfile)
    assert sorted(installs) == ["operator", "worker"] and set(installs) <= set(extras)
    # torch: the image takes the pin from constraints.txt, the same pin the worker extra declares.
    pin = next(line for line in (ROOT / "constraints.txt").read_text().splitlines() if line.startswith("torch=="))
    assert pin in extras["worker"], f"constraints pin {pin} differs from the worker extra {extras['worker']}"
    assert "grep '^torch==' constraints.txt" in dockerfile
    assert "torch" not in " ".join(extras["operator"])
    assert re.search(r"^USER 10001", dockerfile, flags=re.M)


def test_make_images_builds_and_pushes_every_final_target_under_the_names_the_chart_expects(tmp_path):
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
    usage = subprocess.run(["make", "-s", "images"], cwd=ROOT, capture_output=True, text=True)
    assert usage.returncode == 2 and "usage: make images REGISTRY=" in usage.stderr
    done = subprocess.run(["make", "-s", "images", "REGISTRY=reg.example.com/t", f"DOCKER={fake}"], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "MAKEFLAGS": ""})
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    targets = [t for t in re.findall(r"^FROM \S+ AS (\w+)$", (ROOT / "Dockerfile").read_text(), flags=re.M)
               if t != "base"]
    version = re.search(r'__version__ = "(.*)"', (ROOT / "operator/pdfleet_operator/__init__.py").read_text())[1]
    assert calls == [c for t in targets for c in (
        f"build --target {t} -t reg.example.com/t/pdfleet-{t}:{version} "
        "--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .",
        f"push reg.example.com/t/pdfleet-{t}:{version}")]
    values = yaml.safe_load((ROOT / "charts/pdfleet/values.yaml").read_text())
    assert values["image"]["repository"].endswith("/pdfleet-operator")
    assert values["workerImage"]["repository"].endswith("/pdfleet-worker")
    assert "--set workerImage.repository=reg.example.com/t/pdfleet-worker" in done.stdout
