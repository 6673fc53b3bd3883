"""pdfleet on a real (kind) cluster: the examples become Ready on fake accelerators, serve through the router, a
burst of load moves the P:D ratio and a bad revision is rolled back. Opt-in (`e2e`): run by e2e/run.sh.

e2e/run.sh creates the cluster, installs the chart and exports PDFLEET_E2E_KUBECONFIG; these tests only talk
to that cluster (kubectl from the venv, the openai SDK through `kubectl port-forward`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.components import free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
NS = "pdfleet-e2e"
KUBECTL = str(Path(sys.executable).parent / "kubectl")


@pytest.fixture(scope="module")
def kubeconfig() -> str:
    path = os.environ.get("PDFLEET_E2E_KUBECONFIG")
    if not path:
        pytest.fail("PDFLEET_E2E_KUBECONFIG is not set: run the suite with e2e/run.sh (it creates the kind cluster)")
    return path


def kubectl(kubeconfig: str, *args: str, input: str | None = None, timeout: float = 120) -> str:
    proc = subprocess.run(
        [KUBECTL, "--kubeconfig", kubeconfig, *args], input=input, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"kubectl {' '.join(args)}: {proc.stderr}"
    return proc.stdout


def get(kubeconfig: str, resource: str, name: str, namespace: str = NS) -> dict[str, Any]:
    return json.loads(kubectl(kubeconfig, "-n", namespace, "get", resource, name, "-o", "json"))


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == type_), None)


def wait_until(predicate, timeout: float, what: str, interval: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"{what}: not reached within {timeout}s (last: {last!r})")


@contextlib.contextmanager
def port_forward(kubeconfig: str, service: str) -> Iterator[str]:
    """The router Service on a local port (kubectl port-forward), as an OpenAI base URL."""
    port = free_port()
    proc = subprocess.Popen(
        [KUBECTL, "--kubeconfig", kubeconfig, "-n", NS, "port-forward", f"svc/{service}", f"{port}:80"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "Forwarding from" in line, line
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def complete(base_url: str, prompt: str, max_tokens: int = 16) -> int:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0)
    assert out.choices[0].text is not None
    return out.usage.completion_tokens


@pytest.fixture(scope="module")
def deployed(kubeconfig: str) -> dict[str, dict[str, Any]]:
    kubectl(
        kubeconfig,
        "-n",
        "pdfleet-system",
        "rollout",
        "status",
        "deployment/pdfleet-operator",
        "--timeout=180s",
        timeout=200,
    )
    kubectl(kubeconfig, "-n", NS, "rollout", "status", "deployment/prometheus", "--timeout=180s", timeout=200)
    kubectl(
        kubeconfig,
        "apply",
        "-f",
        str(ROOT / "e2e" / "manifests" / "tiny-pd.yaml"),
        "-f",
        str(ROOT / "e2e" / "manifests" / "tiny-colocated.yaml"),
    )
    out = {}
    for name in ("tiny-pd", "tiny-colocated"):
        kubectl(kubeconfig, "-n", NS, "wait", f"infdep/{name}", "--for=condition=Ready", "--timeout=600s", timeout=620)
        out[name] = get(kubeconfig, "infdep", name)
    return out


def test_examples_are_ready_on_the_fake_accelerators(kubeconfig: str, deployed) -> None:
    pd = deployed["tiny-pd"]["status"]
    assert {(p["role"], p["acceleratorClass"]) for p in pd["pools"]} == {
        ("prefill", "h100-mig-3g-40gb"),
        ("decode", "ascend-910b"),
    }
    assert pd["pdRatio"] == "1:1" and pd["costPerHour"] > 0
    pods = json.loads(kubectl(kubeconfig, "-n", NS, "get", "pods", "-l", "pdfleet.io/deployment=tiny-pd", "-o", "json"))
    nodes = {
        n["metadata"]["name"]: n["metadata"]["labels"]["pdfleet.io/e2e-node"]
        for n in json.loads(kubectl(kubeconfig, "get", "nodes", "-l", "pdfleet.io/e2e-node", "-o", "json"))["items"]
    }
    placed = {
        p["metadata"]["labels"]["pdfleet.io/role"]: (
            nodes.get(p["spec"]["nodeName"]),
            p["spec"]["containers"][0]["resources"]["limits"],
        )
        for p in pods["items"]
        if p["status"].get("phase") == "Running"
    }
    assert placed["prefill"][0] == "mig" and placed["prefill"][1]["nvidia.com/mig-3g.40gb"] == "1"
    assert placed["decode"][0] == "ascend" and placed["decode"][1]["huawei.com/Ascend910"] == "1"
    colo = deployed["tiny-colocated"]["status"]
    assert [(p["role"], p["acceleratorClass"]) for p in colo["pools"]] == [("colocated", "h100-80gb")]


def test_requests_go_through_the_router(kubeconfig: str, deployed) -> None:
    for name in ("tiny-pd", "tiny-colocated"):
        with port_forward(kubeconfig, name) as url:
            assert sum(complete(url, f"hello {i}") for i in range(4)) > 0


def test_a_burst_of_load_moves_the_pd_ratio(kubeconfig: str, deployed) -> None:
    before = get(kubeconfig, "infdep", "tiny-pd")["status"]["pdRatio"]
    stop = threading.Event()
    errors: list[BaseException] = []

    def hammer(url: str, i: int) -> None:
        while not stop.is_set():
            try:
                complete(url, "a long prompt about accelerators " * 40 + str(i), max_tokens=64)
            except Exception as exc:  # 503s under overload are expected; anything else is recorded
                if "503" not in str(exc):
                    errors.append(exc)

    with port_forward(kubeconfig, "tiny-pd") as url:
        threads = [threading.Thread(target=hammer, args=(url, i), daemon=True) for i in range(24)]
        for t in threads:
            t.start()
        try:

            def ratio_moved() -> dict[str, Any] | None:
                st = get(kubeconfig, "infdep", "tiny-pd")["status"]
                return st if st.get("pdRatio") != before else None

            moved = wait_until(ratio_moved, 240, f"P:D ratio moving from {before} under load")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=180)
    assert (
        moved["lastScalingDecision"]["reason"]
        and moved["lastScalingDecision"]["toReplicas"] != moved["lastScalingDecision"]["fromReplicas"]
    )
    assert errors == [], errors[:3]


def test_a_bad_revision_is_rolled_back(kubeconfig: str, deployed) -> None:
    good = get(kubeconfig, "infdep", "tiny-pd")
    good_revision = good["status"]["currentRevision"]
    wait_until(
        lambda: get(kubeconfig, "infdep", "tiny-pd")["status"].get("stableRevision") == good_revision,
        180,
        f"revision {good_revision} soaking into stable",
    )
    # The new revision's workers cannot load their model: its pods never get ready, the router answers 5xx.
    kubectl(
        kubeconfig,
        "-n",
        NS,
        "patch",
        "infdep",
        "tiny-pd",
        "--type=merge",
        "-p",
        json.dumps({"spec": {"model": {"source": {"hostPath": {"path": "/models/missing"}}}}}),
    )
    stop = threading.Event()

    def trickle(url: str) -> None:  # the rollback rule needs requests to see a 5xx ratio
        while not stop.is_set():
            with contextlib.suppress(Exception):
                complete(url, "ping", max_tokens=4)
            time.sleep(0.5)

    def rolled_back() -> dict[str, Any] | None:
        obj = get(kubeconfig, "infdep", "tiny-pd")
        return obj if (condition(obj, "RolledBack") or {}).get("status") == "True" else None

    with port_forward(kubeconfig, "tiny-pd") as url:
        t = threading.Thread(target=trickle, args=(url,), daemon=True)
        t.start()
        try:
            rolled = wait_until(rolled_back, 420, "RolledBack=True")
        finally:
            stop.set()
            t.join(timeout=60)
    st = rolled["status"]
    assert st["currentRevision"] == good_revision and st["failedRevision"] > good_revision
    events = json.loads(
        kubectl(kubeconfig, "-n", NS, "get", "events", "--field-selector", "involvedObject.name=tiny-pd", "-o", "json")
    )["items"]
    assert any(e["reason"] == "RolledBack" for e in events)
    kubectl(kubeconfig, "-n", NS, "wait", "infdep/tiny-pd", "--for=condition=Ready", "--timeout=300s", timeout=320)
    with port_forward(kubeconfig, "tiny-pd") as url:
        assert complete(url, "after the rollback") > 0
