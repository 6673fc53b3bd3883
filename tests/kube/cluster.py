"""Shared test fixtures for the operator: the example AcceleratorClasses and a fleet of fake Nodes.

Used by the pure tests, the golden files and the emulator tests alike, so that all three see the
same cluster. Node labels are the ones the example classes select on.
"""

from __future__ import annotations

import pathlib
from typing import Any

import yaml

from pdfleet_operator.api import AcceleratorClass, AcceleratorClassSpec, InferenceDeployment

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
CLASSES_FILE = EXAMPLES / "acceleratorclasses.yaml"
GPU_TAINT = {"key": "nvidia.com/gpu", "effect": "NoSchedule"}

# class name -> (node labels, resource name, taints)
NODE_SHAPES: dict[str, tuple[dict[str, str], str, list[dict]]] = {
    "h100": ({"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, "nvidia.com/gpu", [GPU_TAINT]),
    "h100-mig": (
        {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/mig.strategy": "mixed"},
        "nvidia.com/mig-3g.40gb",
        [GPU_TAINT],
    ),
    "h200": ({"nvidia.com/gpu.product": "NVIDIA-H200"}, "nvidia.com/gpu", [GPU_TAINT]),
    "a100": ({"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}, "nvidia.com/gpu", [GPU_TAINT]),
    "l40s": ({"nvidia.com/gpu.product": "NVIDIA-L40S"}, "nvidia.com/gpu", [GPU_TAINT]),
    "ascend": ({"accelerator": "huawei-Ascend910"}, "huawei.com/Ascend910", []),
    "cambricon": ({"cambricon.com/mlu.model": "MLU370"}, "cambricon.com/mlu", []),
    "hygon": ({"hygon.com/dcu.model": "K100-AI"}, "hygon.com/dcu", []),
    "kunlunxin": ({"kunlunxin.com/xpu.model": "R200"}, "kunlunxin.com/xpu", []),
    "cpu": ({}, "cpu", []),
}


def class_objects() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(CLASSES_FILE.read_text()) if d]


def classes() -> dict[str, AcceleratorClassSpec]:
    return {d["metadata"]["name"]: AcceleratorClass.model_validate(d).spec for d in class_objects()}


def node(
    name: str,
    shape: str,
    units: int | str,
    *,
    extra: dict[str, str] | None = None,
    ready: bool = True,
    unschedulable: bool = False,
    taints: list[dict] | None = None,
) -> dict[str, Any]:
    """A Node advertising `units` of the shape's resource (plus cpu/memory for the node itself)."""
    labels, resource, shape_taints = NODE_SHAPES[shape]
    allocatable = {"cpu": "32", "memory": "256Gi", "pods": "110"}
    allocatable[resource] = str(units)
    if extra:
        allocatable.update(extra)
    spec: dict[str, Any] = {}
    if shape_taints or taints:
        spec["taints"] = list(taints if taints is not None else shape_taints)
    if unschedulable:
        spec["unschedulable"] = True
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
        "spec": spec,
        "status": {
            "allocatable": allocatable,
            "capacity": dict(allocatable),
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def pod(
    name: str,
    node_name: str | None,
    requests: dict[str, str],
    *,
    namespace: str = "default",
    labels: dict[str, str] | None = None,
    phase: str = "Running",
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
        "spec": {
            "nodeName": node_name,
            "containers": [{"name": "c", "image": "x", "resources": {"requests": requests, "limits": requests}}],
        }
        if node_name
        else {"containers": [{"name": "c", "image": "x", "resources": {"requests": requests}}]},
        "status": {"phase": phase},
    }


def standard_nodes() -> list[dict[str, Any]]:
    """One node of each kind, with room for every example at its minimum size and some growth."""
    return [
        node("h100-0", "h100", 8),
        node("h100-mig-0", "h100-mig", 4),
        node("h200-0", "h200", 8),
        node("a100-0", "a100", 8),
        node("l40s-0", "l40s", 4),
        node("ascend-0", "ascend", 8),
        node("cambricon-0", "cambricon", 8),
        node("hygon-0", "hygon", 8),
        node("kunlunxin-0", "kunlunxin", 8),
    ]


def example_deployments() -> dict[str, dict[str, Any]]:
    """Every InferenceDeployment in examples/, by name."""
    out = {}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "InferenceDeployment":
                out[doc["metadata"]["name"]] = doc
    return out


def example_files() -> dict[str, pathlib.Path]:
    """Example file stem -> path, for the files that hold InferenceDeployments."""
    return {
        p.stem: p
        for p in sorted(EXAMPLES.glob("*.yaml"))
        if any(d and d.get("kind") == "InferenceDeployment" for d in yaml.safe_load_all(p.read_text()))
    }


def spec_of(doc: dict[str, Any]):
    return InferenceDeployment.model_validate(doc).spec
