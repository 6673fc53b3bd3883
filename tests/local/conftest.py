"""`pdfleet up` under test: a tiny model made by `pdfleet model init`, spec files with short autoscaling windows, and a
handle on a running `pdfleet up` that reads its output lines and always stops it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

PDFLEET = [sys.executable, "-m", "pdfleet_operator.cli"]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "local-tiny.yaml"
# One torch thread per process: the fleet shares two cores with the test process.
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("local-models") / "tiny"
    subprocess.run(
        PDFLEET + ["model", "init", str(path), "--preset", "tiny"],
        check=True,
        capture_output=True,
        env={**os.environ, **CHILD_ENV},
        timeout=300,
    )
    return path


def write_spec(directory: Path, model_dir: Path | str, **changes) -> Path:
    """examples/local-tiny.yaml with the model at `model_dir` and `changes` merged into spec
    (dotted keys; None removes)."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["model"]["source"] = {"local": {"path": str(model_dir)}}
    for dotted, value in changes.items():
        node = doc["spec"]
        *head, leaf = dotted.split(".")
        for key in head:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    path = directory / "spec.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def run_token(run_dir: Path) -> dict[str, str]:
    """The header a fleet's /workers (and its pdfleet workers) need: the token `pdfleet up` wrote for this run."""
    return {"Authorization": f"Bearer {(run_dir / 'auth-token').read_text().strip()}"}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes (its parent has not reaped it yet)
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


class UpProcess:
    """`pdfleet up ... --plain` as a child; its stdout lines collected by a thread."""

    def __init__(self, argv: list[str], cwd: Path):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            PDFLEET + ["up", *argv, "--plain"],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **CHILD_ENV},
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def summary(self, name: str = "local-tiny") -> str:
        """The summary block, checked to be the last thing printed (no event line after its header)."""
        out = self.output()
        header = f"== pdfleet up {name}: summary =="
        assert header in out, out[-4000:]
        tail = out[out.index(header) :]
        assert not [line for line in tail.splitlines() if line.startswith("+")], f"the summary is printed last:\n{tail}"
        return tail

    def wait_line(self, pattern: str, timeout: float, after: int = 0) -> re.Match:
        """The first output line (from index `after`) matching `pattern`; AssertionError with the output on timeout."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines[after:]:
                m = rx.search(line)
                if m:
                    return m
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r} within {timeout}s; output:\n{self.output()[-6000:]}")

    def pids(self) -> set[int]:
        return {
            int(m.group(1)) for line in self.lines for m in [re.search(r"(?:started|restarted): pid (\d+)", line)] if m
        }

    def ports(self) -> set[int]:
        return {int(m.group(1)) for line in self.lines for m in [re.search(r"pid \d+, (?:[\d.]+)?:(\d+)", line)] if m}

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return code

    def stop(self) -> None:
        """Backstop for a failed test: SIGTERM, then SIGKILL it and every child it reported."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(timeout=10)
        for pid in self.pids():
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
