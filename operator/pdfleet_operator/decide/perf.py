"""A roofline estimate of one replica on one AcceleratorClass: does the model fit, and how fast is it.

Pure; placement ranks classes with it and checks the SLO, the simulator can reuse it. Prefill is
compute-bound (2 x parameters FLOPs per token), decode is bandwidth-bound (every step reads the weights
and the batch's KV once). The efficiencies are deliberately round numbers: the estimate orders classes
and rejects hopeless ones; the autoscaler corrects sizes from real queues.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdfleet_operator.api import AcceleratorClassSpec, InferenceDeploymentSpec

GIB = 1 << 30
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Fraction of peak a serving engine reaches: MFU for prefill GEMMs, MBU for decode reads.
PREFILL_MFU = 0.5
DECODE_MBU = 0.8
# Device memory kept back for activations, CUDA graphs / runtime workspaces, per unit.
RUNTIME_RESERVE_GIB = 1.0
# NOTE: the ITL estimate is for a moderately loaded decode step (8 sequences at half the model
# length), not batch 1: a class that meets the SLO only when idle does not meet it.
REF_DECODE_BATCH = 8


@dataclass(frozen=True)
class Fit:
    """Whether one replica of the model fits one replica's worth of the class's memory."""

    fits: bool
    known: bool  # False when the spec has no model architecture: fit assumed, not checked
    weights_gib: float
    kv_gib_needed: float  # KV for one sequence of maxModelLen tokens (the least a replica must hold)
    kv_gib_available: float
    message: str


def replica_memory_gib(cls: AcceleratorClassSpec) -> float:
    return cls.memory_gib * cls.count


def weights_bytes(spec: InferenceDeploymentSpec) -> float | None:
    """Bytes of one replica's weights. engine.quantization int8: one byte per parameter.

    NOTE: int8 keeps the embedding table and the norms in model.dtype and adds a scale per output row; the
    architecture gives no vocabulary size, so every parameter counts one byte (an 8B Llama-3 in bf16: about
    6% fewer bytes than it loads). Decode time follows the bytes (a bandwidth roofline): this assumes int8
    kernels read at the share of bandwidth float ones do, which torch's CPU int8 GEMV does not reach
    (bench/levers.py measures what it does reach)."""
    arch = spec.model.architecture
    if arch is None:
        return None
    per_param = 1 if spec.engine.quantization == "int8" else DTYPE_BYTES[spec.model.dtype]
    return arch.parameters_billions * 1e9 * per_param


def kv_bytes_per_token(spec: InferenceDeploymentSpec) -> float | None:
    arch = spec.model.architecture
    if arch is None:
        return None
    elem = 1 if spec.engine.kv_cache_dtype == "int8" else DTYPE_BYTES[spec.model.dtype]
    return 2 * arch.layers * arch.kv_heads * arch.head_dim * elem  # K and V


def fit(spec: InferenceDeploymentSpec, cls: AcceleratorClassSpec) -> Fit:
    """Weights plus KV for one full-length sequence within the KV fraction of what the weights leave."""
    weights, per_token = weights_bytes(spec), kv_bytes_per_token(spec)
    mem = replica_memory_gib(cls)
    if weights is None or per_token is None:
        return Fit(True, False, 0.0, 0.0, mem, "model.architecture not given: fit not checked")
    w_gib = weights / GIB
    kv_need = per_token * spec.model.max_model_len / GIB
    left = mem - w_gib - RUNTIME_RESERVE_GIB * cls.count
    kv_avail = max(0.0, left) * spec.engine.kv_cache_memory_fraction
    if left <= 0:
        return Fit(False, True, w_gib, kv_need, 0.0, f"weights {w_gib:.1f} GiB do not fit {mem:g} GiB")
    if kv_avail < kv_need:
        return Fit(
            False,
            True,
            w_gib,
            kv_need,
            kv_avail,
            f"KV for one {spec.model.max_model_len}-token sequence needs {kv_need:.1f} GiB, "
            f"{kv_avail:.1f} GiB left after {w_gib:.1f} GiB of weights",
        )
    return Fit(True, True, w_gib, kv_need, kv_avail, f"{w_gib:.1f} GiB weights + {kv_avail:.1f} GiB KV in {mem:g} GiB")


def ttft_seconds(spec: InferenceDeploymentSpec, cls: AcceleratorClassSpec) -> float | None:
    """Time to prefill one engine step's token budget (what a new request waits at most behind)."""
    weights = weights_bytes(spec)
    arch = spec.model.architecture
    if weights is None or arch is None:
        return None
    tokens = min(spec.model.max_model_len, spec.engine.max_num_batched_tokens)
    compute = 2 * arch.parameters_billions * 1e9 * tokens / (cls.peak_tflops * 1e12 * cls.count * PREFILL_MFU)
    read = weights / (cls.memory_bandwidth_gbps * 1e9 * cls.count * DECODE_MBU)
    return max(compute, read)


def itl_seconds(spec: InferenceDeploymentSpec, cls: AcceleratorClassSpec) -> float | None:
    """One decode step at the reference load: weights plus the batch's KV read once."""
    weights, per_token = weights_bytes(spec), kv_bytes_per_token(spec)
    if weights is None or per_token is None:
        return None
    batch = min(REF_DECODE_BATCH, spec.engine.max_num_seqs)
    kv = per_token * batch * spec.model.max_model_len / 2
    return (weights + kv) / (cls.memory_bandwidth_gbps * 1e9 * cls.count * DECODE_MBU)
