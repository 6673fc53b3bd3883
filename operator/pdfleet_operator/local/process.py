"""One child process of `pdfleet up` (the router or a worker): its own session, killed with us (PR_SET_PDEATHSIG), output to a log file, signalled only by its PID."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _die_with_parent(parent: int) -> None:
    """Runs in the child before exec: SIGTERM when the process that started us dies, even by SIGKILL.

    NOTE: the signal follows the *thread* that forked; `pdfleet up` starts children from its main
    thread only, which lives as long as the process.
    """
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died between fork and prctl
        os._exit(1)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


class Child:
    """A command started in its own session (Ctrl-C in the terminal reaches `pdfleet up` only, which
    stops its children in order), with stdout and stderr appended to `log_path`."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str]):
        self.name, self.argv, self.log_path, self.env = name, argv, log_path, env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "Child":
        assert self.proc is None, f"{self.name} already started"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            parent = os.getpid()
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True,
                                         preexec_fn=lambda: _die_with_parent(parent))
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} not started"
        return self.proc.pid

    def poll(self) -> int | None:
        """The exit status once it has exited (reaped), else None."""
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """SIGTERM: a worker or router drains its open requests and exits 0."""
        self.signal(signal.SIGTERM)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def wait(self, timeout: float) -> int | None:
        assert self.proc is not None, f"{self.name} not started"
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])
