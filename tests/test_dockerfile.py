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
