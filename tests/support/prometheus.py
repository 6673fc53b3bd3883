"""Real Prometheus and Alertmanager (Debian's packages) for tests, on free loopback ports.

`PrometheusServer` and `AlertmanagerServer` write their own config into a temp dir, start the
binary, wait for `/-/ready` and stop it by PID. The fixtures `prometheus_factory` and
`alertmanager_factory` hand out started servers and stop every one at teardown.
"""

from __future__ import annotations

import abc
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support.components import binary, free_port

READY_TIMEOUT_S = 20.0


class _Server(abc.ABC):
    """A child process serving HTTP on 127.0.0.1:port, stopped by PID."""

    name = "server"

    def __init__(self) -> None:
        self.port = free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix=f"pdfleet-{self.name}-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.workdir / "server.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @abc.abstractmethod
    def _command(self) -> list[str]:
        """The command line that starts this server."""

    def start(self) -> "_Server":
        assert self.proc is None, f"{self.name} already started"
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self._command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {READY_TIMEOUT_S}s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self) -> "_Server":
        """Stop and start again on the same port and storage (a Prometheus outage and recovery)."""
        self.stop()
        self.proc = None
        return self.start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""


class PrometheusServer(_Server):
    """Prometheus with a generated config: scrape jobs, rule files and optional Alertmanagers."""

    name = "prometheus"

    def __init__(
        self,
        targets: dict[str, list[str]] | None = None,
        rule_files: list[Path] | None = None,
        alertmanagers: list[str] | None = None,
        interval: str = "1s",
        extra_scrape_configs: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__()
        self.binary = binary("prometheus")
        config: dict[str, Any] = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": addrs}]} for job, addrs in (targets or {}).items()
            ]
            + list(extra_scrape_configs or []),
        }
        if rule_files:
            config["rule_files"] = [str(Path(p).resolve()) for p in rule_files]
        if alertmanagers:
            config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": alertmanagers}]}]}
        self.config_path = self.workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))

    def _command(self) -> list[str]:
        return [
            self.binary,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--web.enable-lifecycle",
        ]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """Instant query; the result vector (raises on a Prometheus error)."""
        resp = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=5.0)
        body = resp.json()
        if body.get("status") != "success":
            raise RuntimeError(f"query {promql!r} failed: {body}")
        return body["data"]["result"]

    def wait_for(
        self, promql: str, predicate=lambda result: bool(result), timeout: float = 20.0
    ) -> list[dict[str, Any]]:
        """Poll a query until predicate(result) holds; the last result on success, AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(promql)
            if predicate(result):
                return result
            time.sleep(0.25)
        raise AssertionError(f"{promql!r} did not satisfy the condition within {timeout}s; last result {result}")

    def targets_up(self) -> int:
        return len(self.query("up == 1"))


class AlertmanagerServer(_Server):
    """Alertmanager routing every alert to webhook receivers (the operator's, in rollback tests)."""

    name = "alertmanager"

    def __init__(
        self,
        webhook_urls: list[str],
        group_wait: str = "1s",
        group_interval: str = "1s",
        repeat_interval: str = "1h",
        bearer_token: str | None = None,
    ) -> None:
        super().__init__()
        self.binary = binary("prometheus-alertmanager")
        config = {
            "route": {
                "receiver": "hooks",
                "group_by": ["alertname", "pdfleet_deployment"],
                "group_wait": group_wait,
                "group_interval": group_interval,
                "repeat_interval": repeat_interval,
            },
            "receivers": [
                {
                    "name": "hooks",
                    "webhook_configs": [
                        {
                            "url": u,
                            "send_resolved": True,
                            **(
                                {"http_config": {"authorization": {"type": "Bearer", "credentials": bearer_token}}}
                                if bearer_token
                                else {}
                            ),
                        }
                        for u in webhook_urls
                    ],
                }
            ],
        }
        self.config_path = self.workdir / "alertmanager.yml"
        self.config_path.write_text(yaml.safe_dump(config))

    def _command(self) -> list[str]:
        return [
            self.binary,
            f"--config.file={self.config_path}",
            f"--storage.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--cluster.listen-address=",
        ]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture
def prometheus_factory() -> Iterator[Any]:
    """Call with PrometheusServer's arguments; returns a started server, stopped at teardown."""
    started: list[_Server] = []

    def make(**kwargs: Any) -> PrometheusServer:
        server = PrometheusServer(**kwargs)
        started.append(server)
        server.start()
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def alertmanager_factory() -> Iterator[Any]:
    """Call with AlertmanagerServer's arguments; returns a started server, stopped at teardown."""
    started: list[_Server] = []

    def make(**kwargs: Any) -> AlertmanagerServer:
        server = AlertmanagerServer(**kwargs)
        started.append(server)
        server.start()
        return server

    yield make
    for server in started:
        server.stop()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
