"""`pdfleet render SPEC... --classes FILE`: the operator's objects as a YAML stream, or a clear error and exit 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import yaml

from tests.kube.cluster import CLASSES_FILE, EXAMPLES, node

PDFLEET = [sys.executable, "-m", "pdfleet_operator.cli"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PDFLEET, "render", *args], capture_output=True, text=True, timeout=120)


def test_every_example_renders_to_objects_the_kubernetes_schemas_accept() -> None:
    done = run(*(str(p) for p in sorted(EXAMPLES.glob("*.yaml")) if p != CLASSES_FILE), "--classes", str(CLASSES_FILE))
    assert done.returncode == 0, done.stderr
    objs = [o for o in yaml.safe_load_all(done.stdout) if o]
    kinds = {o["kind"] for o in objs}
    assert kinds == {"ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "NetworkPolicy"}
    for o in objs:
        kubernetes_validate.validate(o, "1.30.0", strict=True)
    engines = {
        c["name"] for o in objs if o["kind"] == "Deployment" for c in o["spec"]["template"]["spec"]["containers"]
    }
    assert engines == {"worker", "vllm", "router"}


def test_nodes_decide_the_plan_and_a_full_cluster_is_an_error(tmp_path: Path) -> None:
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [node("l40s-0", "l40s", 4)]}))
    done = run(str(EXAMPLES / "qwen2-7b.yaml"), "--classes", str(CLASSES_FILE), "--nodes", str(nodes), "--monitoring")
    assert done.returncode == 0, done.stderr
    assert {o["kind"] for o in yaml.safe_load_all(done.stdout)} >= {"PodMonitor", "PrometheusRule"}
    nodes.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [node("l40s-0", "l40s", 0)]}))
    done = run(str(EXAMPLES / "qwen2-7b.yaml"), "--classes", str(CLASSES_FILE), "--nodes", str(nodes))
    assert done.returncode == 1 and done.stdout == ""
    assert "InferenceDeployment/qwen2-7b: colocated:" in done.stderr


def test_bad_input_is_one_clear_line_per_problem_and_exit_1(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "pdfleet.io/v1alpha1",
                "kind": "InferenceDeployment",
                "metadata": {"name": "bad"},
                "spec": {
                    "model": {"name": "m", "source": {"pvc": {"claimName": "models"}}},
                    "prefill": {"acceleratorClasses": ["h100-80gb"]},
                    "decode": {"acceleratorClasses": ["kunlunxin-r200"]},
                },
            }
        )
    )
    done = run(str(bad), "--classes", str(CLASSES_FILE))
    assert done.returncode == 1 and done.stdout == ""
    assert "spec.decode.acceleratorClasses[0]: AcceleratorClass kunlunxin-r200" in done.stderr
    assert "no PyTorch bridge for kunlunxin" in done.stderr
    done = run(str(bad))  # no classes at all
    assert done.returncode == 1 and "AcceleratorClass h100-80gb, kunlunxin-r200 not found" in done.stderr
    bad.write_text("spec: [")
    done = run(str(bad))
    assert done.returncode == 1 and "not valid YAML" in done.stderr
    bad.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "pdfleet.io/v1alpha1",
                "kind": "InferenceDeployment",
                "metadata": {"name": "bad"},
                "spec": {"engine": {"runtime": "tgi"}},
            }
        )
    )
    done = run(str(bad), "--classes", str(CLASSES_FILE))
    assert done.returncode == 1 and "spec.engine.runtime" in done.stderr
