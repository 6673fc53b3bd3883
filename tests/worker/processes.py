"""Real worker and router processes on loopback for the worker's server, router, wire and KV transfer tests (fixtures
shared by tests/worker/conftest.py): a tiny model made by `pdfleet model init`, the deployment token the pipeline's
prefill/decode workers and router share, process handles that always stop what they started."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.components import free_port

PDFLEET = [sys.executable, "-m", "pdfleet_operator.cli"]
MODEL = "tiny"
READY_TIMEOUT_S = 90.0
# One torch thread per process: several workers share two cores with the test process.
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

PORT_RETRIES = 2  # a child that found its chosen port taken is started again on another
_ALL: list["Proc"] = []
# The pipeline's deployment token (its prefill and decode workers and its router; the colocated worker runs
# without one, as a worker on its own does): what calling its PD workers directly needs.
TOKEN = secrets.token_urlsafe(24)
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Proc:
    """A `pdfleet worker` or `pdfleet router` child process on 127.0.0.1:port, stopped by PID."""

    def __init__(self, name: str, args: list[str], logdir: Path, port: int | None = None):
        self.name = name
        self.logdir = logdir
        self.args = args  # the command's arguments, --host and --port apart (added by start)
        self.port_given = port is not None  # a given port is kept; a chosen one is re-chosen if it was taken
        self._listen_on(port or free_port())
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}  # extra environment (e.g. KUBECONFIG)
        self.headers: dict[str, str] = {}  # what its guarded endpoints need (the deployment token)

    def _listen_on(self, port: int) -> None:
        self.port = port
        self.log_path = self.logdir / f"{self.name}-{port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> "Proc":
        env = {**os.environ, **CHILD_ENV, **self.env}
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            PDFLEET + self.args + ["--host", "127.0.0.1", "--port", str(self.port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        if self not in _ALL:
            _ALL.append(self)
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> "Proc":
        deadline = time.monotonic() + timeout
        retries = PORT_RETRIES
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if not self.port_given and retries and "address already in use" in self.log():
                    # Another process took the chosen port before this child listened: choose again.
                    retries -= 1
                    self._listen_on(free_port())
                    self.start()
                    continue
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout}s:\n{self.log()}")

    def load(self) -> dict:
        return httpx.get(f"{self.url}/load", headers=self.headers, timeout=5.0).json()

    def metrics_text(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5.0).text

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (a worker drains), then SIGKILL if it lingers; returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""


def worker(
    logdir: Path, model_dir: str, role: str, *extra: str, name: str | None = None, port: int | None = None
) -> Proc:
    """port: a given one (a worker restarted where it was), else a free one."""
    args = [
        "worker",
        "--model",
        model_dir,
        "--served-model-name",
        MODEL,
        "--role",
        role,
        "--num-kv-blocks",
        "256",
        "--num-threads",
        "1",
        "--log-level",
        "warning",
        *extra,
    ]
    return Proc(name or role, args, logdir, port)


def router(logdir: Path, *args: str, name: str = "router") -> Proc:
    return Proc(
        name,
        ["router", "--health-interval", "0.25", "--discovery-interval", "1", "--log-level", "warning", *args],
        logdir,
    )


def start_all(*procs: Proc) -> None:
    """Start in parallel, then wait for each; on failure stop every one before raising."""
    try:
        for p in procs:
            if p.proc is None:
                p.start()
        for p in procs:
            p.wait_ready()
    except BaseException:
        for p in procs:
            p.kill()
        raise


def wait_until(predicate, timeout: float = 15.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what} not reached within {timeout}s (last: {last!r})")


def worker_urls(router: Proc) -> dict[str, str]:
    """The router's worker ids (what its x-pdfleet-* headers carry: never an address) -> URLs, from /workers."""
    answer = httpx.get(f"{router.url}/workers", headers=router.headers, timeout=5)
    return {w["id"]: w["url"] for w in answer.json()["workers"]}


def pool_whole(w: Proc) -> bool:
    ld = w.load()
    return (
        ld.get("free_blocks") == ld.get("total_blocks")
        and ld.get("running") == 0
        and ld.get("waiting") == 0
        and ld.get("held_blocks") == 0
        and ld.get("waiting_for_remote_kv") == 0
    )


@pytest.fixture(scope="session")
def logdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serving-logs")


@pytest.fixture(scope="session")
def token_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("auth") / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return str(path)


def authenticated(proc: Proc, token_file: str) -> Proc:
    """The process with the pipeline's token (`--auth-token-file`), its handle sending it."""
    proc.args += ["--auth-token-file", token_file]
    proc.headers = dict(AUTH)
    return proc


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    """A tiny random Llama with a trained BPE tokenizer, written by the real CLI."""
    path = tmp_path_factory.mktemp("models") / MODEL
    subprocess.run(
        PDFLEET + ["model", "init", str(path), "--preset", "tiny"],
        check=True,
        capture_output=True,
        env=dict(os.environ, **CHILD_ENV),
        timeout=300,
    )
    return str(path)


class Pipeline:
    """1 prefill + 1 decode worker behind a router (tier `default`), plus a colocated worker as tier `colo`."""

    def __init__(self, prefill: Proc, decode: Proc, colo: Proc, router: Proc):
        self.prefill, self.decode, self.colo, self.router = prefill, decode, colo, router

    @property
    def workers(self) -> list[Proc]:
        return [self.prefill, self.decode, self.colo]


@pytest.fixture(scope="session")
def pipeline(logdir, model_dir, token_file) -> Pipeline:
    p = authenticated(worker(logdir, model_dir, "prefill", "--kv-lease", "3s"), token_file)
    d = authenticated(
        worker(
            logdir,
            model_dir,
            "decode",
            "--kv-on-failure",
            "recompute",
            "--kv-transfer-timeout",
            "3s",
            "--kv-peers",
            "127.0.0.1",
        ),
        token_file,
    )
    c = worker(
        logdir,
        model_dir,
        "both",
        "--max-num-seqs",
        "4",
        "--max-waiting-requests",
        "4",
        "--max-request-bytes",
        "200000",
        "--max-n",
        "4",
        name="colo",
    )
    start_all(p, d, c)
    r = authenticated(
        router(
            logdir,
            "--prefill",
            p.url,
            "--decode",
            d.url,
            "--workers",
            f"colo={c.url}",
            "--model-alias",
            "tiny-colo=colo",
        ),
        token_file,
    )
    try:
        start_all(r)
        yield Pipeline(p, d, c, r)
    finally:
        for proc in (r, p, d, c):
            proc.stop()


def pytest_sessionfinish(session, exitstatus) -> None:
    # Backstop: nothing a test started outlives the session, even after an error in a fixture.
    for p in _ALL:
        p.kill()
