"""The CRDs and examples as a cluster sees them: kubectl apply, printer columns, and admission rejections."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from tests.api import invalid_resources
from tests.api.invalid_resources import CASES

ROOT = Path(__file__).resolve().parents[2]


def test_kubectl_applies_crds_and_examples_and_shows_printer_columns(kube):
    kube.kubectl("apply", "-f", str(ROOT / "crds"))
    applied = kube.kubectl("apply", "-f", str(ROOT / "examples"))
    docs = [d for f in sorted((ROOT / "examples").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    assert applied.stdout.count("created") == len(docs) >= 16, applied.stdout
    deployments = {d["metadata"]["name"] for d in docs if d["kind"] == "InferenceDeployment"}

    infdep = kube.kubectl("get", "infdep").stdout.splitlines()
    assert infdep[0].split() == ["NAME", "MODEL", "PREFILL", "DECODE", "P:D", "$/H", "READY", "AGE"]
    assert {line.split()[0] for line in infdep[1:]} == deployments
    assert {"qwen2-7b", "llama31-8b", "chat-latency", "chat-cost", "local-tiny", "qwen2-7b-vllm"} <= deployments
    row = next(line.split() for line in infdep[1:] if line.startswith("llama31-8b "))
    assert row[1] == "meta-llama/Llama-3.1-8B-Instruct"

    acc = kube.kubectl("get", "acc").stdout.splitlines()
    assert acc[0].split() == ["NAME", "VENDOR", "RESOURCE", "$/H", "AGE"]
    row = next(line.split() for line in acc[1:] if line.startswith("h100-mig-3g-40gb "))
    assert row[1:4] == ["nvidia", "nvidia.com/mig-3g.40gb", "1.28"]

    both = kube.kubectl("get", "infdep,acc").stdout
    assert "inferencedeployment.pdfleet.io/llama31-8b" in both and "acceleratorclass.pdfleet.io/cpu" in both
    # Category and short names resolve.
    assert "llama31-8b" in kube.kubectl("get", "pdfleet").stdout


def test_server_applies_schema_defaults(kube):
    kube.kubectl("apply", "-f", str(ROOT / "crds"))
    kube.kubectl("apply", "-f", str(ROOT / "examples/local-tiny.yaml"))
    stored = kube.get("infdep", "local-tiny", "default")
    assert stored["spec"]["engine"]["kvCacheMemoryFraction"] == 0.85
    assert stored["spec"]["rollback"]["errorRatioThreshold"] == 0.01
    assert stored["spec"]["autoscaling"]["pdRatio"] == {"min": 0.125, "max": 8.0}


@pytest.fixture
def crd_cluster(kube):
    kube.kubectl("apply", "-f", str(ROOT / "crds"))
    return kube


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_invalid_resource_rejected_by_emulator_admission(crd_cluster, case):
    obj = case.build()
    if obj["kind"] == "InferenceDeployment":
        path = "/apis/pdfleet.io/v1alpha1/namespaces/default/inferencedeployments"
    else:
        path = "/apis/pdfleet.io/v1alpha1/acceleratorclasses"
    resp = httpx.post(f"{crd_cluster.url}{path}", params={"fieldValidation": "Strict"}, json=obj, timeout=10)
    assert resp.status_code in (400, 422), resp.text
    status = resp.json()
    assert status["kind"] == "Status" and status["status"] == "Failure"
    causes = (status.get("details") or {}).get("causes") or [{"field": "", "message": status["message"]}]
    assert any(
        invalid_resources.matches(case, c.get("field", ""), c.get("message", ""))
        or invalid_resources.matches(case, case.field, status["message"])
        and case.field in status["message"]
        for c in causes
    ), status
    assert crd_cluster.list(obj["kind"], "default" if obj["kind"] == "InferenceDeployment" else None) == []
