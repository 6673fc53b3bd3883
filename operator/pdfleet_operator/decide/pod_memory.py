"""The host memory one worker pod needs, part by part, and the request and limit that cover it (pure);
`kube.render` sizes every worker container with it, and a test adds the parts up for every example.

Parts, in bytes of the pod's own (cgroup) memory:
    weights   the weights: resident on the `cpu` class; on an accelerator, staged through host memory once
    kv        the KV pool where it lives in host memory: the `cpu` class (the pdfleet worker sizes it from what the
              limit leaves; vLLM's CPU backend takes VLLM_CPU_KVCACHE_SPACE, rendered from this); 0 on an accelerator
    offload   the host KV offload tier: engine.kvOffload.hostMemory (the pdfleet worker's tier, vLLM's
              --kv-offloading-size), pinned for the pod's whole life
    swap      engine.swapSpace with preemption swap (the pdfleet worker; vLLM V1 has none)
    overhead  the runtime: Python, torch, tokenizer, HTTP server, loader buffers

On an accelerator the request is all of it and the limit adds a second copy of the weights and overhead (a
safetensors load can hold the page cache and the staging copy at once). On the `cpu` class request = limit: the
class's memoryGiB is the replica's memory, the offload tier and swap come on top of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdfleet_operator.api import AcceleratorClassSpec, InferenceDeploymentSpec, parse_quantity
from pdfleet_operator.decide import perf

GIB = 1 << 30
# Host memory of an accelerator worker beyond its weights: tokenizer, HTTP server, the engine's Python, staging.
ACCELERATOR_OVERHEAD_GIB = 4
# What a CPU worker's runtime takes besides weights and KV (Python, torch, tokenizer, server), at least.
CPU_OVERHEAD_GIB = 1


@dataclass(frozen=True)
class PodMemory:
    """One worker container's memory, by part, with the request and limit (whole GiB) that cover it."""

    weights: int
    kv: int
    offload: int
    swap: int
    overhead: int
    request_gib: int
    limit_gib: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.offload + self.swap + self.overhead

    @property
    def vllm_cpu_kv_gib(self) -> int:
        """VLLM_CPU_KVCACHE_SPACE (whole GiB) of a vLLM pod on the `cpu` class."""
        return self.kv // GIB


def _gib(n: float) -> int:
    return math.ceil(n / GIB)


def offload_bytes(spec: InferenceDeploymentSpec) -> int:
    off = spec.engine.kv_offload
    return int(parse_quantity(off.host_memory)) if off is not None and off.host_memory else 0


def swap_bytes(spec: InferenceDeploymentSpec, engine: str) -> int:
    return (
        int(parse_quantity(spec.engine.swap_space)) if engine == "pdfleet" and spec.engine.preemption == "swap" else 0
    )


def budget(spec: InferenceDeploymentSpec, cls: AcceleratorClassSpec, engine: str) -> PodMemory:
    """The memory of one `engine` worker of this deployment on this class."""
    w = perf.weights_bytes(spec)
    weights = 0 if w is None else int(w)
    offload, swap = offload_bytes(spec), swap_bytes(spec, engine)
    if cls.resource_name != "cpu":
        request = _gib(weights + ACCELERATOR_OVERHEAD_GIB * GIB + offload + swap)
        limit = request + _gib(weights + ACCELERATOR_OVERHEAD_GIB * GIB)
        return PodMemory(weights, 0, offload, swap, ACCELERATOR_OVERHEAD_GIB * GIB, request, limit)
    overhead = CPU_OVERHEAD_GIB * GIB
    replica = max(cls.memory_gib * GIB, weights + overhead)  # the class's memory holds weights, KV and the runtime
    room = int((replica - weights - overhead) * spec.engine.kv_cache_memory_fraction)
    # NOTE: the pdfleet worker sizes its pool the same way, from the headroom under the limit once the offload tier
    # and swap are set aside (worker_config.kv_cache_bytes); vLLM is told its size.
    kv = _vllm_cpu_kv(spec, room) if engine == "vllm" else room
    limit = max(_gib(replica + offload + swap), _gib(weights + kv + offload + swap + overhead))
    return PodMemory(weights, kv, offload, swap, limit * GIB - weights - kv - offload - swap, limit, limit)


def _vllm_cpu_kv(spec: InferenceDeploymentSpec, room: int) -> int:
    """vLLM's CPU KV space, whole GiB: what maxNumSeqs sequences of maxModelLen tokens use, within `room`, at least
    1 GiB (VLLM_CPU_KVCACHE_SPACE takes GiB; unset, vLLM sizes it from the node's memory, not the pod's limit)."""
    per_token = perf.kv_bytes_per_token(spec)
    need = room if per_token is None else spec.engine.max_num_seqs * spec.model.max_model_len * per_token
    return max(1, min(math.ceil(need / GIB), room // GIB)) * GIB  # the limit grows when 1 GiB does not fit
