"""Operator replicas with leader election, as processes against the API emulator, authorized by the chart's RBAC.

`install_chart_rbac` applies the ClusterRole/Role objects the chart renders (Helm's own engine) and their
bindings; each `Replica` runs `pdfleet operator --leader-elect` with a token of the chart's ServiceAccount
bound to its own pod name, so the emulator authorizes it by those rules (403 otherwise) and its request log
says which replica sent what. `writes_outside_lease` counts the writes a replica made while it did not hold
the Lease (want 0: two replicas never act at once).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.gen.chart import helm
from tests.support.components import free_port

NAMESPACE = helm.NAMESPACE
SERVICE_ACCOUNT = f"{helm.RELEASE}-operator"
LEASE = f"{helm.RELEASE}-operator"
RBAC_KINDS = ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


@functools.lru_cache(maxsize=8)
def _rendered_rbac(values_json: str) -> str:
    return json.dumps([o for o in helm.render(json.loads(values_json)) if o["kind"] in RBAC_KINDS])


def install_chart_rbac(kube: Any, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The chart's RBAC objects for these values, rendered by Helm (once per values) and applied, with the release
    namespace and the namespaces of the Roles."""
    objects = json.loads(_rendered_rbac(json.dumps(values or {}, sort_keys=True)))
    for ns in sorted({NAMESPACE} | {o["metadata"]["namespace"] for o in objects if o["metadata"].get("namespace")}):
        if kube.get("namespaces", ns) is None:
            kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    kube.apply(objects)
    return objects


class Replica:
    """One operator pod as a local process, started with the chart's leader-election flags (shorter timings)."""

    def __init__(
        self,
        kube: Any,
        pod: str,
        log_dir: Path,
        *,
        lease_duration: float = 3.0,
        renew_deadline: float = 2.0,
        retry_period: float = 0.25,
        resync_interval: float = 0.0,
        kubeconfig: Path | None = None,
        alertmanager_token: str | None = None,
    ) -> None:
        self.pod = pod
        self.kubeconfig = kubeconfig or kube.service_account_kubeconfig(NAMESPACE, SERVICE_ACCOUNT, pod=pod)
        self.lease_duration = lease_duration
        self.liveness_port, self.metrics_port = free_port(), free_port()
        self.cmd = [
            sys.executable,
            "-m",
            "pdfleet_operator.kube.operator_cli",
            "operator",
            "--metrics-port",
            str(self.metrics_port),
            "--liveness-port",
            str(self.liveness_port),
            "--resync-interval",
            str(resync_interval),
            "--analysis-interval",
            "0",
            "--class-status-interval",
            "0",
            "--leader-elect",
            f"--leader-election-namespace={NAMESPACE}",
            f"--leader-election-name={LEASE}",
            f"--leader-election-lease-duration={lease_duration}",
            f"--leader-election-renew-deadline={renew_deadline}",
            f"--leader-election-retry-period={retry_period}",
        ]
        self.env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "POD_NAME": pod}
        self.alertmanager_port: int | None = None
        if alertmanager_token is not None:  # the receiver (leader) or relay (standby), published at POD_IP:port
            self.alertmanager_port = free_port()
            token_file = log_dir / f"{pod}.token"
            token_file.write_text(alertmanager_token + "\n")
            self.cmd += [f"--alertmanager-port={self.alertmanager_port}", f"--alertmanager-token-file={token_file}"]
            self.env["POD_IP"] = "127.0.0.1"
        self.log_path = log_dir / f"{pod}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> Replica:
        """Start it and wait until it answers /healthz (a standby does too)."""
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            stdout=open(self.log_path, "ab"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.pod} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.pod} not healthy after {timeout}s:\n{self.log()}")

    def leader_gauge(self) -> float | None:
        """`pdfleet_operator_leader` from its /metrics (None while nothing answers)."""
        try:
            text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=1).text
        except httpx.HTTPError:
            return None
        return next(
            (float(line.split()[1]) for line in text.splitlines() if line.startswith("pdfleet_operator_leader ")), None
        )

    def metric(self, line_prefix: str) -> float | None:
        """The value of the first /metrics line starting with `line_prefix` (None: no such line, or no answer)."""
        try:
            text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=1).text
        except httpx.HTTPError:
            return None
        return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_prefix)), None)

    def post_alert(self, body: str, token: str | None) -> httpx.Response:
        """POST /alerts to its Alertmanager port, as the chart's Service would (with the bearer token, if any)."""
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        return httpx.post(
            f"http://127.0.0.1:{self.alertmanager_port}/alerts", content=body, headers=headers, timeout=35
        )

    def kill(self) -> None:
        """SIGKILL: the pod's node died; nothing is released."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> int | None:
        """SIGTERM (a rolling update): the leader releases the Lease on its way out; returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""


def lease_holder(kube: Any) -> str | None:
    """The pod whose replica holds the Lease now (identities are `<POD_NAME>_<suffix>`)."""
    lease = kube.get("leases.coordination.k8s.io", LEASE, NAMESPACE)
    holder = ((lease or {}).get("spec") or {}).get("holderIdentity")
    return holder.rsplit("_", 1)[0] if holder else None


def lease_writes(requests: list[Any]) -> list[tuple[str | None, dict[str, Any]]]:
    """(pod, spec) of every successful write of the Lease, in order."""
    return [
        (r.pod, (r.body or {}).get("spec") or {})
        for r in requests
        if r.resource == "leases" and r.is_write and r.status in (200, 201)
    ]


def writes_outside_lease(requests: list[Any]) -> list[Any]:
    """Writes (other than of the Lease) a replica sent while another replica, or none, held the Lease."""
    holder: str | None = None
    out = []
    for r in requests:
        if r.pod is None:
            continue  # the test's own requests
        if r.resource == "leases":
            if r.is_write and r.status in (200, 201):
                holder = r.pod if ((r.body or {}).get("spec") or {}).get("holderIdentity") else None
            continue
        if r.is_write and r.pod != holder:
            out.append(r)
    return out


def settle(kube: Any, quiet: float = 0.8, timeout: float = 30.0) -> None:
    """Wait until no write other than the Lease's renewals has come for `quiet` seconds (the leader is idle)."""
    deadline = time.monotonic() + timeout
    last, quiet_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = sum(1 for r in kube.requests if r.is_write and r.resource != "leases")
        if n != last:
            last, quiet_since = n, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet:
            return
        time.sleep(0.05)
    raise AssertionError(f"the operator kept writing for {timeout} s")
