"""A table of invalid custom resources, shared by the offline-validation and emulator-admission tests.

Each case starts from a valid example, breaks one thing, and names the field the error must point
at (a prefix of the reported field path) and a word the error must contain.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str, index: int = 0) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]
    return docs[index]


BASE_DEPLOYMENT = _load("llama31-8b-pd-mig.yaml")
BASE_CLASS = _load("acceleratorclasses.yaml", 0)


@dataclass(frozen=True)
class Case:
    id: str
    base: dict[str, Any]
    mutate: Callable[[dict[str, Any]], None]
    field: str  # the reported field path starts with this
    word: str = ""  # and this appears in the field or the message (case-insensitive)

    def build(self) -> dict[str, Any]:
        obj = copy.deepcopy(self.base)
        self.mutate(obj)
        return obj


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(obj: dict[str, Any]) -> None:
        *head, leaf = path.split(".")
        node = obj
        for key in head:
            node = node.setdefault(key, {})
        node[leaf] = value

    return mutate


def _delete(path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(obj: dict[str, Any]) -> None:
        *head, leaf = path.split(".")
        node = obj
        for key in head:
            node = node[key]
        del node[leaf]

    return mutate


def _all(*mutations: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def mutate(obj: dict[str, Any]) -> None:
        for m in mutations:
            m(obj)

    return mutate


D, A = BASE_DEPLOYMENT, BASE_CLASS
CASES: list[Case] = [
    # --- InferenceDeployment ---
    Case("min-above-max-replicas", D, _set("spec.decode.minReplicas", 20), "spec.decode.minReplicas", "maxReplicas"),
    Case(
        "ratio-bounds-reversed",
        D,
        _set("spec.autoscaling.pdRatio", {"min": 4, "max": 1}),
        "spec.autoscaling.pdRatio.min",
        "max",
    ),
    Case("kv-fraction-zero", D, _set("spec.engine.kvCacheMemoryFraction", 0), "spec.engine.kvCacheMemoryFraction"),
    Case(
        "kv-fraction-above-one", D, _set("spec.engine.kvCacheMemoryFraction", 1.5), "spec.engine.kvCacheMemoryFraction"
    ),
    Case("error-ratio-zero", D, _set("spec.rollback.errorRatioThreshold", 0), "spec.rollback.errorRatioThreshold"),
    Case("unknown-role", D, _set("spec.encode", {"acceleratorClasses": ["h100-80gb"]}), "spec.encode"),
    Case(
        "class-name-not-dns-label",
        D,
        _set("spec.prefill.acceleratorClasses", ["H100_80GB"]),
        "spec.prefill.acceleratorClasses",
    ),
    Case("quantity-does-not-parse", D, _set("spec.engine.shmSize", "lots"), "spec.engine.shmSize"),
    Case(
        "memory-quantity-with-bytes-suffix",
        D,
        _set("spec.prefill.resources", {"requests": {"memory": "32GB"}}),
        "spec.prefill.resources.requests",
    ),
    Case("duration-does-not-parse", D, _set("spec.autoscaling.interval", "5 minutes"), "spec.autoscaling.interval"),
    Case("rollback-for-does-not-parse", D, _set("spec.rollback.for", "2 min"), "spec.rollback.for"),
    Case("name-not-dns-label", D, _set("metadata.name", "Llama_8B"), "metadata.name"),
    Case("name-too-long", D, _set("metadata.name", "l" * 41), "metadata.name"),
    Case("typo-unknown-field", D, _set("spec.engine.blocksize", 32), "spec.engine.blocksize"),
    Case("colocated-with-pd-roles", D, _set("spec.disaggregation", False), "spec", "colocated"),
    Case("pd-without-decode", D, _delete("spec.decode"), "spec", "decode"),
    Case(
        "two-model-sources",
        D,
        _set("spec.model.source.hostPath", {"path": "/models/llama"}),
        "spec.model.source",
        "exactly one",
    ),
    Case("no-model-source", D, _set("spec.model.source", {}), "spec.model.source", "exactly one"),
    Case("block-size-zero", D, _set("spec.engine.blockSize", 0), "spec.engine.blockSize"),
    Case("unknown-dtype", D, _set("spec.model.dtype", "fp8"), "spec.model.dtype"),
    Case("unknown-tier", D, _set("spec.tier", "fast"), "spec.tier"),
    Case(
        "token-budget-below-max-seqs",
        D,
        _set("spec.engine.maxNumBatchedTokens", 64),
        "spec.engine.maxNumBatchedTokens",
        "maxNumSeqs",
    ),
    Case("negative-min-replicas", D, _set("spec.prefill.minReplicas", -1), "spec.prefill.minReplicas"),
    Case("replicas-wrong-type", D, _set("spec.prefill.maxReplicas", "four"), "spec.prefill.maxReplicas"),
    Case("no-accelerator-classes", D, _set("spec.prefill.acceleratorClasses", []), "spec.prefill.acceleratorClasses"),
    Case(
        "duplicate-accelerator-classes",
        D,
        _set("spec.decode.acceleratorClasses", ["h100-80gb", "h100-80gb"]),
        "spec.decode.acceleratorClasses",
        "duplicate",
    ),
    Case("prompt-token-target-on-decode", D, _set("spec.decode.targetPromptTokensPerReplica", 100), "spec", "prefill"),
    Case("missing-model", D, _delete("spec.model"), "spec.model", "required"),
    Case("model-name-with-space", D, _set("spec.model.name", "llama 8b"), "spec.model.name"),
    Case(
        "unknown-kv-failure-policy",
        D,
        _set("spec.engine.kvTransfer.onFailure", "retry"),
        "spec.engine.kvTransfer.onFailure",
    ),
    Case(
        "prometheus-url-without-scheme",
        D,
        _set("spec.autoscaling.prometheusUrl", "prometheus:9090"),
        "spec.autoscaling.prometheusUrl",
    ),
    Case("tolerance-one", D, _set("spec.autoscaling.tolerance", 1.0), "spec.autoscaling.tolerance"),
    Case("unknown-runtime", D, _set("spec.engine.runtime", "tgi"), "spec.engine.runtime"),
    Case(
        "vllm-settings-on-pdfleet",
        D,
        _all(_set("spec.engine.runtime", "pdfleet"), _set("spec.engine.vllm", {"extraArgs": ["--enforce-eager"]})),
        "spec.engine.vllm",
        "runtime vllm",
    ),
    Case(
        "int8-kv-on-vllm",
        D,
        _all(_set("spec.engine.runtime", "vllm"), _set("spec.engine.kvCacheDtype", "int8")),
        "spec.engine.kvCacheDtype",
        "vllm",
    ),
    Case(
        "int8-weights-on-vllm",
        D,
        _all(_set("spec.engine.runtime", "vllm"), _set("spec.engine.quantization", "int8")),
        "spec.engine.quantization",
        "vllm",
    ),
    Case("int4-weights", D, _set("spec.engine.quantization", "int4"), "spec.engine.quantization"),
    Case(
        "router-peer-with-namespace-and-cidr",
        D,
        _set("spec.router", {"allowFrom": [{"namespace": "a", "cidr": "10.0.0.0/8"}]}),
        "spec.router.allowFrom[0]",
        "exactly one",
    ),
    Case(
        "router-peer-pod-labels-without-namespace",
        D,
        _set("spec.router", {"allowFrom": [{"cidr": "10.0.0.0/8", "podLabels": {"a": "b"}}]}),
        "spec.router.allowFrom[0]",
        "podLabels",
    ),
    Case(
        "kv-connector-not-a-name",
        D,
        _set("spec.engine.vllm", {"kvConnector": "nixl connector"}),
        "spec.engine.vllm.kvConnector",
    ),
    # --- AcceleratorClass ---
    Case("unknown-vendor", A, _set("spec.vendor", "nvidea"), "spec.vendor"),
    Case("resource-name-without-domain", A, _set("spec.resourceName", "gpu"), "spec.resourceName"),
    Case("negative-price", A, _set("spec.costPerHour", -1), "spec.costPerHour"),
    Case("zero-memory", A, _set("spec.memoryGiB", 0), "spec.memoryGiB"),
    Case(
        "mig-on-ascend",
        A,
        _all(
            _set("spec.vendor", "huawei"),
            _set("spec.resourceName", "huawei.com/Ascend910"),
            _set("spec.partition", {"type": "mig", "profile": "3g.40gb"}),
        ),
        "spec.partition",
        "MIG",
    ),
    Case("class-name-uppercase", A, _set("metadata.name", "H100"), "metadata.name"),
    Case("missing-peak-tflops", A, _delete("spec.peakTflops"), "spec.peakTflops", "required"),
    Case(
        "exists-toleration-with-value",
        A,
        _set("spec.tolerations", [{"key": "k", "operator": "Exists", "value": "v"}]),
        "spec.tolerations[0]",
        "value",
    ),
    Case("env-name-invalid", A, _set("spec.env", [{"name": "1BAD", "value": "x"}]), "spec.env[0].name"),
    Case("cpu-vendor-with-gpu-resource", A, _set("spec.vendor", "cpu"), "spec.resourceName", "cpu"),
    Case("price-date-not-iso", A, _set("spec.costAsOf", "June 2025"), "spec.costAsOf"),
    Case("vgpu-partition", A, _set("spec.partition", {"type": "vgpu", "profile": "a100-4c"}), "spec.partition.type"),
    Case("default-vllm-without-vllm", A, _set("spec.runtimes", {"default": "vllm"}), "spec.runtimes.default", "vllm"),
    Case(
        "vllm-runtime-without-image",
        A,
        _set("spec.runtimes", {"vllm": {"kvConnector": "NixlConnector"}}),
        "spec.runtimes.vllm.image",
        "required",
    ),
    Case(
        "unknown-torch-device", A, _set("spec.runtimes", {"pdfleet": {"device": "tpu"}}), "spec.runtimes.pdfleet.device"
    ),
    # issue 26: device visibility is the device plugin's (HEAD's example classes hard-coded it to "0")
    Case(
        "fixed-visible-devices",
        A,
        _set("spec.env", [{"name": "ASCEND_RT_VISIBLE_DEVICES", "value": "0"}]),
        "spec.env[0]",
        "device plugin",
    ),
    Case(
        "fixed-visible-devices-in-a-runtime",
        A,
        _set("spec.runtimes", {"pdfleet": {"env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}]}}),
        "spec.runtimes.pdfleet.env[0]",
        "device plugin",
    ),
    Case(
        "volume-mount-of-no-volume",
        A,
        _set("spec.volumeMounts", [{"name": "driver", "mountPath": "/opt/x"}]),
        "spec.volumeMounts",
        "names one of spec.volumes",
    ),
    Case(
        "relative-host-path",
        A,
        _set("spec.volumes", [{"name": "d", "hostPath": {"path": "usr/local/dcmi"}}]),
        "spec.volumes[0].hostPath.path",
    ),
]

assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"


def matches(case: Case, field: str, message: str) -> bool:
    """Whether one reported error is the one the case expects."""
    text = f"{field} {message}".lower()
    return field.startswith(case.field) and case.word.lower() in text
