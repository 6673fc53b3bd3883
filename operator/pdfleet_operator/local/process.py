"""One child process of `pdfleet up` (the router or a worker): its own session and process group, killed with us
(PR_SET_PDEATHSIG), output to a log file; signalled by its PID, and its group swept once it has exited."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
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
    stops its children in order), with stdout and stderr appended to `log_path`.

    The session makes the child the leader of a process group that holds only what it spawned (vLLM's
    API server starts an engine-core process, which starts a worker). SIGTERM goes to the leader, which
    stops its own children; once the leader has exited, and before it is reaped, whatever is left of
    its group gets SIGKILL. NOTE: the unreaped leader keeps its PID, hence the group ID, from being reused,
    so the sweep can only reach this child's own descendants (that did not start sessions of their own).
    """

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str]):
        self.name, self.argv, self.log_path, self.env = name, argv, log_path, env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "Child":
        assert self.proc is None, f"{self.name} already started"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            parent = os.getpid()
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
                preexec_fn=lambda: _die_with_parent(parent),
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} not started"
        return self.proc.pid

    def poll(self) -> int | None:
        """The exit status once it has exited (its group swept, the leader reaped), else None."""
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            try:
                exited = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
            except ChildProcessError:  # reaped already
                exited = True
            if not exited:
                return None
            self._sweep()
        return self.proc.poll()

    def _sweep(self) -> None:
        """SIGKILL what is left of the group (the leader is a zombie: the group ID is still ours)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def alive(self) -> bool:
        return self.proc is not None and self.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """SIGTERM: a worker or router drains its open requests and exits 0 (vLLM stops its engine processes)."""
        self.signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the whole group now."""
        if self.alive():
            self._sweep()

    def wait(self, timeout: float) -> int | None:
        assert self.proc is not None, f"{self.name} not started"
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return code

    def group(self) -> list[int]:
        """PIDs in this child's process group now (Linux /proc; the leader included while it runs)."""
        if self.proc is None:
            return []
        return group_members(self.pid)

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes whose process group is `pgid`, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            out.append(int(entry.name))
    return sorted(out)
