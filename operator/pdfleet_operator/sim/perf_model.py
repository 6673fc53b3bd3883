"""Step times of one simulated replica: the operator's `perf` roofline with calibrated efficiencies and batch effects.

The simulator's engine model (`sim.engine`) asks one question many times: how long does an engine step
take that computes `tokens` new tokens while reading the KV of `context` tokens? The answer is the
roofline of `pdfleet_operator.decide.perf` made per-step:

    step = overhead + max(tokens x 2 x params / (peak x count x MFU),
                          (weights + context x KV bytes per token) / (bandwidth x count x MBU))

so a prefill chunk is compute-bound, a decode step is bandwidth-bound until the batch is large enough
to become compute-bound, and a growing batch slows every sequence in it (its KV is read each step).
KV moves between pools in bytes / min(source, destination network) plus a fixed latency.

A request also pays the serving path outside the engine: every HTTP round trip to first byte (client ->
router, router -> prefill worker, router -> decode worker) costs `http_hop_s` of the worker's class
(parsing, tokenizer-free admission, the event loop, the socket), measured by `bench/sim.py calibrate`
against a real worker. The simulator delays a request's entry into its first queue by two hops and the
KV hand-off by one; a class without a measurement pays nothing (the default 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdfleet_operator.api import AcceleratorClassSpec, InferenceDeploymentSpec, parse_quantity
from pdfleet_operator.decide import perf

GIB = perf.GIB
# NOTE: a serving engine on a GPU spends a few ms per step outside the GEMMs (scheduling, sampling,
# kernel launches, host syncs); 3 ms is vLLM-like without CUDA graphs for decode. The `cpu` class gets
# its own number from calibration (`sim.calibration`), where this term dominates for tiny models.
DEFAULT_STEP_OVERHEAD_S = 0.003
DEFAULT_KV_TRANSFER_LATENCY_S = 0.002


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak one class reaches, and where the numbers come from."""

    prefill_mfu: float = perf.PREFILL_MFU
    decode_mbu: float = perf.DECODE_MBU
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S
    kv_transfer_gbps: float | None = None  # measured KV link; None: the class's networkGBps
    http_hop_s: float = 0.0  # one HTTP round trip to first byte on this class's host (measured)
    tensor_parallel_scaling: float = 1.0  # a replica over `count` devices reaches this share of count x one
    source: str = "default (pdfleet_operator.decide.perf)"

    def __post_init__(self) -> None:
        for name in ("prefill_mfu", "decode_mbu"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"Efficiency.{name} must be in (0, 1], got {value}")
        if not 0 <= self.step_overhead_s < 10:
            raise ValueError(f"Efficiency.step_overhead_s must be in [0, 10) seconds, got {self.step_overhead_s}")
        if not 0 <= self.http_hop_s < 10:
            raise ValueError(f"Efficiency.http_hop_s must be in [0, 10) seconds, got {self.http_hop_s}")
        if not 0 < self.tensor_parallel_scaling <= 1:
            raise ValueError(
                f"Efficiency.tensor_parallel_scaling must be in (0, 1], got {self.tensor_parallel_scaling}"
            )


@dataclass(frozen=True)
class ReplicaPerf:
    """One replica of a deployment on one class, reduced to the constants a step time needs."""

    accelerator_class: str
    flop_s_per_token: float  # seconds of compute per token through the model
    weights_read_s: float  # seconds to read the weights once
    kv_read_s_per_token: float  # seconds to read one token's KV once
    overhead_s: float
    kv_capacity_tokens: int  # KV slots of the replica (whole blocks)
    kv_bytes_per_token: float
    network_gbps: float
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    http_hop_s: float = 0.0  # one HTTP round trip to a worker of this class (first byte)
    swap_space_tokens: int = 0  # engine.preemption swap: KV tokens the swap space holds (0: recompute)
    # the pdfleet engine's partial prefill "auto" (a prompt the budget would cut waits whole for the next step
    # when the cut would lengthen this one by DEFER_SHARE or more); vLLM always cuts
    defers_partial_prefill: bool = False

    def step_time(self, tokens: float, context: float) -> float:
        """One engine step computing `tokens` tokens over a batch whose KV holds `context` tokens."""
        compute = tokens * self.flop_s_per_token
        memory = self.weights_read_s + context * self.kv_read_s_per_token
        return self.overhead_s + (compute if compute > memory else memory)

    def prefill_tokens_per_s(self) -> float:
        """Throughput of back-to-back full prefill steps (no decode in the batch)."""
        budget = self.max_num_batched_tokens
        return budget / self.step_time(budget, budget)


def kv_transfer_s(
    tokens: float, src: ReplicaPerf, dst: ReplicaPerf, latency_s: float = DEFAULT_KV_TRANSFER_LATENCY_S
) -> float:
    """Seconds to move `tokens` tokens of KV from a prefill replica to a decode replica."""
    gbps = min(src.network_gbps, dst.network_gbps)
    return latency_s + tokens * src.kv_bytes_per_token / (gbps * 1e9)


def replica_perf(
    spec: InferenceDeploymentSpec, name: str, cls: AcceleratorClassSpec, eff: Efficiency | None = None
) -> ReplicaPerf:
    """The step-time constants of one replica; ValueError when the model does not fit or has no architecture."""
    eff = eff or Efficiency()
    arch = spec.model.architecture
    weights, per_token = perf.weights_bytes(spec), perf.kv_bytes_per_token(spec)
    if arch is None or weights is None or per_token is None:
        raise ValueError(
            f"model {spec.model.name}: spec.model.architecture is required to simulate it "
            "(parametersBillions, layers, kvHeads, headDim)"
        )
    fit = perf.fit(spec, cls)
    if not fit.fits:
        raise ValueError(f"model {spec.model.name} does not fit {name}: {fit.message}")
    block = spec.engine.block_size
    capacity = int(fit.kv_gib_available * GIB / per_token) // block * block
    scaling = eff.tensor_parallel_scaling if cls.count > 1 else 1.0
    peak = cls.peak_tflops * 1e12 * cls.count * scaling
    bandwidth = cls.memory_bandwidth_gbps * 1e9 * cls.count * scaling
    return ReplicaPerf(
        accelerator_class=name,
        flop_s_per_token=2 * arch.parameters_billions * 1e9 / (peak * eff.prefill_mfu),
        weights_read_s=weights / (bandwidth * eff.decode_mbu),
        kv_read_s_per_token=per_token / (bandwidth * eff.decode_mbu),
        overhead_s=eff.step_overhead_s,
        kv_capacity_tokens=capacity,
        kv_bytes_per_token=per_token,
        network_gbps=eff.kv_transfer_gbps or cls.network_gbps,
        max_num_batched_tokens=spec.engine.max_num_batched_tokens,
        max_num_seqs=spec.engine.max_num_seqs,
        block_size=block,
        http_hop_s=eff.http_hop_s,
        swap_space_tokens=(
            int(parse_quantity(spec.engine.swap_space) / per_token) if spec.engine.preemption == "swap" else 0
        ),
    )


def decode_tokens_per_s(rp: ReplicaPerf, batch: int, context_per_seq: float) -> float:
    """Tokens per second of a decode-only batch (each sequence gains one token per step)."""
    if batch <= 0:
        return 0.0
    return batch / rp.step_time(batch, batch * context_per_seq)


def max_batch_within(rp: ReplicaPerf, itl_s: float, context_per_seq: float) -> int:
    """The largest decode batch whose step stays within `itl_s` (0 when even batch 1 misses it)."""
    lo, hi = 0, rp.max_num_seqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fits_kv = mid * context_per_seq <= rp.kv_capacity_tokens
        if fits_kv and rp.step_time(mid, mid * context_per_seq) <= itl_s:
            lo = mid
        else:
            hi = mid - 1
    return lo
