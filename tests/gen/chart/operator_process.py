"""`pdfleet operator` as the chart's Deployment describes it (command, args, env), run as a child process against the
API emulator.

Only the port numbers change (the Deployment's 9090/8080 may be taken on this machine), and the
credentials: a kubeconfig for the emulator stands in for the in-cluster ServiceAccount token, and a local file
holds the Alertmanager token the chart's Secret mounts (`ALERTMANAGER_TOKEN`). Also:
`exercise`, which drives the operator through every path of its reconcile (create, status, drift,
stale children, API trouble, price change, delete) so the request log shows every verb it uses.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import kmock

from pdfleet_operator.kube import render
from tests.kube import harness
from tests.kube.cluster import example_deployments
from tests.support.components import free_port

PORT_FLAGS = ("--metrics-port", "--liveness-port", "--alertmanager-port")
ALERTMANAGER_TOKEN = "alertmanager-token-for-the-chart-tests"
# NOTE: how long exercise() waits for the operator process to react (a wait returns as soon as it has). Alone the
# reactions take seconds; in the full suite on 2 cores, beside the engine's tests, they took 20-22 s several times
# (2026-12-03 and -04: a revision-history prune, a price change's re-plan, the deletion of stale children). With
# another tenant's load on top, a re-plan was not seen in 45 s either, once: not explained then. Once since, nothing
# was reconciled because the operator had exited: its Lease renewal waited behind the emulator's backlog past the
# chart's renew deadline (test_install.py's EMULATOR_ELECTION).
REACT_S = 45


def free_ports() -> dict[str, int]:
    """A free local port for each port flag (pick them early when a scrape config must name them)."""
    return {flag: free_port() for flag in PORT_FLAGS}


class OperatorProcess:
    """The operator container's command line as a local process; stopped by PID (SIGTERM, then SIGKILL)."""

    def __init__(
        self, deployment: dict[str, Any], kubeconfig: Path, log_path: Path, ports: dict[str, int] | None = None
    ) -> None:
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["command"] == ["pdfleet"], container["command"]
        self.ports = ports or free_ports()
        self.token_file = log_path.with_suffix(".alertmanager-token")
        self.token_file.write_text(ALERTMANAGER_TOKEN + "\n")
        self.args = [self._local(self._port(a)) for a in container["args"]]
        self.env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            **{e["name"]: e["value"] for e in container.get("env", []) if "value" in e},
        }
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def _local(self, arg: str) -> str:
        flag, _, _ = arg.partition("=")
        return f"{flag}={self.token_file}" if flag == "--alertmanager-token-file" else arg

    def _port(self, arg: str) -> str:
        flag, _, value = arg.partition("=")
        if flag in PORT_FLAGS:
            assert re.fullmatch(r"\d+", value), arg
            return f"{flag}={self.ports[flag]}"
        return arg

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['--metrics-port']}/metrics"

    def start(self, timeout: float = 30.0) -> OperatorProcess:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdfleet_operator.cli", *self.args],
            env=self.env,
            stdout=open(self.log_path, "wb"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdfleet operator exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.ports['--liveness-port']}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"pdfleet operator not healthy after {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-8000:] if self.log_path.exists() else ""


# --- driving it through every path of the reconcile ------------------------------------------------------

STALE_KINDS = {  # kind -> (apiVersion, a minimal valid spec part)
    "ConfigMap": ("v1", {"data": {"engine.json": "{}"}}),
    "Service": ("v1", {"spec": {"clusterIP": "None", "ports": [{"name": "http", "port": 8000}]}}),
    "PodDisruptionBudget": ("policy/v1", {"spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"x": "y"}}}}),
    "Deployment": (
        "apps/v1",
        {
            "spec": {
                "replicas": 0,
                "selector": {"matchLabels": {"x": "y"}},
                "template": {
                    "metadata": {"labels": {"x": "y"}},
                    "spec": {"containers": [{"name": "c", "image": "old"}]},
                },
            }
        },
    ),
    "PodMonitor": (
        "monitoring.coreos.com/v1",
        {"spec": {"selector": {"matchLabels": {"x": "y"}}, "podMetricsEndpoints": [{"port": "http"}]}},
    ),
    "PrometheusRule": ("monitoring.coreos.com/v1", {"spec": {"groups": []}}),
}


def _in(namespace: str, doc: dict[str, Any]) -> dict[str, Any]:
    return {**doc, "metadata": {**doc["metadata"], "namespace": namespace}}


def exercise(kube: Any, namespace: str, *, monitoring: bool) -> None:
    """Every example in `namespace`, reconciled, made ready, then every kind of change the operator reacts to."""
    examples = example_deployments()
    for doc in examples.values():
        kube.apply(_in(namespace, doc))
    # NOTE: every example arrives at once and the operator takes them in turn: on a loaded 2-core host the last
    # one's first reconcile passed 20 s once in the full suite (alone it takes seconds), so REACT_S.
    for name in examples:
        harness.wait_reconciled(kube, name, namespace=namespace, timeout=REACT_S)
        harness.mark_ready(kube, name, namespace)
    for name in examples:
        harness.wait_reconciled(
            kube,
            name,
            namespace=namespace,
            check=lambda o: any(
                c["type"] == "Ready" and c["status"] == "True" for c in o["status"].get("conditions", [])
            ),
        )

    # Children an older operator left behind (owned, labelled, no longer rendered) are deleted.
    target = "llama31-8b"
    owner = kube.get("infdep", target, namespace)
    meta = {
        "namespace": namespace,
        "labels": {render.LABEL_DEPLOYMENT: target, "app.kubernetes.io/managed-by": render.MANAGER},
        "ownerReferences": [render.Owner(target, namespace, owner["metadata"]["uid"]).reference()],
    }
    kinds = [k for k in STALE_KINDS if monitoring or k not in render.MONITORING_KINDS]
    kinds.sort(key=lambda k: k not in render.MONITORING_KINDS)  # unwatched kinds first: a watched one triggers
    for kind in kinds:
        api_version, body = STALE_KINDS[kind]
        kube.apply(
            {
                "apiVersion": api_version,
                "kind": kind,
                "metadata": {"name": f"{target}-old-{kind.lower()}", **meta},
                **body,
            }
        )
    plural = {
        "ConfigMap": "configmaps",
        "Service": "services",
        "PodDisruptionBudget": "poddisruptionbudgets.policy",
        "Deployment": "deployments.apps",
        "PodMonitor": "podmonitors.monitoring.coreos.com",
        "PrometheusRule": "prometheusrules.monitoring.coreos.com",
    }
    kube.wait_for(
        lambda: all(kube.get(plural[k], f"{target}-old-{k.lower()}", namespace) is None for k in kinds),
        timeout=REACT_S,
        message="stale children deleted",
    )

    # A hand edit of a child is reverted; a child deleted by hand comes back.
    worker = next(
        d
        for d in kube.list("deployments.apps", namespace, label_selector=f"{render.LABEL_DEPLOYMENT}={target}")
        if d["metadata"]["labels"].get(render.LABEL_ROLE) == "decode"
    )
    kube.patch("deployments.apps", worker["metadata"]["name"], {"spec": {"replicas": 9}}, namespace)
    kube.wait_for(
        lambda: (
            kube.get("deployments.apps", worker["metadata"]["name"], namespace)["spec"]["replicas"]
            == worker["spec"]["replicas"]
        ),
        timeout=REACT_S,
        message="hand edit reverted",
    )
    service = target  # the router Service carries the deployment's name
    kube.delete("services", service, namespace)
    kube.wait_for(
        lambda: kube.get("services", service, namespace) is not None, timeout=REACT_S, message="Service recreated"
    )

    # API trouble: while applying the new revision's Deployment answers 503, the handler fails temporarily;
    # kopf waits and then marks the CR (a patch) to wake itself up, and the retry converges.
    failing = threading.Event()
    (
        kube.emulator["patch", kmock.resource("apps", "v1", "deployments"), kmock.namespace(namespace), failing.is_set]
        << 503
    )
    failing.set()
    current = kube.get("infdep", target, namespace)
    kube.patch(
        "infdep", target, {"spec": {"engine": {"maxNumSeqs": current["spec"]["engine"]["maxNumSeqs"] + 1}}}, namespace
    )

    def marked() -> bool:
        return any(
            r.subresource is None
            for r in kube.requests_for(verb="patch", resource="inferencedeployments", namespace=namespace, name=target)
        )

    try:
        kube.wait_for(marked, timeout=REACT_S, message="kopf's retry mark on the CR")
    finally:
        failing.clear()
    harness.wait_reconciled(kube, target, namespace=namespace, timeout=REACT_S)

    # Revision history beyond its limit is pruned (ControllerRevisions deleted): two template changes store
    # the two superseded revisions, and a limit of 1 keeps the newer one.
    before = kube.get("infdep", target, namespace)
    seqs, served = before["spec"]["engine"]["maxNumSeqs"], before["status"]["currentRevision"]
    kube.patch(
        "infdep",
        target,
        {"spec": {"rollback": {"revisionHistoryLimit": 1}, "engine": {"maxNumSeqs": seqs + 1}}},
        namespace,
    )
    # This reconcile follows kopf's retry: in the loaded full suite it landed 22 s after the patch once.
    harness.wait_reconciled(
        kube,
        target,
        namespace=namespace,
        timeout=REACT_S,
        check=lambda cr: cr["status"]["currentRevision"] == served + 1,
    )
    kube.patch("infdep", target, {"spec": {"engine": {"maxNumSeqs": seqs + 2}}}, namespace)

    def history() -> list[int]:
        return sorted(
            r["revision"]
            for r in kube.list(
                "controllerrevisions.apps", namespace, label_selector=f"{render.LABEL_DEPLOYMENT}={target}"
            )
        )

    kube.wait_for(
        lambda: history() == [served + 1], timeout=REACT_S, message=f"revision history pruned to [{served + 1}]"
    )

    # A price change re-plans; deleting the CR lets garbage collection take the children.
    kube.patch("acceleratorclass", "cpu", {"spec": {"costPerHour": 0.11}})
    kube.wait_for(
        lambda: any(e["reason"] == "Replanned" for e in harness.events(kube, "local-tiny", namespace)),
        timeout=REACT_S,
        message="price change re-planned local-tiny",
    )
    kube.delete("infdep", "qwen2-7b", namespace)
    kube.wait_for(lambda: harness.children(kube, "qwen2-7b", namespace) == {}, timeout=REACT_S, message="children gone")
    kube.patch("acceleratorclass", "cpu", {"spec": {"costPerHour": 0.10}})
