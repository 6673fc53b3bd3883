"""What fraction of a class's roofline each engine reaches, per (engine, class kind): measured where measured, assumed
elsewhere, each saying which; `simulator` asks `for_pool`.

The simulator's step time is the roofline of the class (`perf_model`): peak TFLOP/s and GB/s times
these fractions, plus a per-step overhead. The fractions come from the two engines measured on this
machine's CPU with `bench/sim.py calibrate` (the pdfleet engine in-process, vLLM's CPU build through
its offline `LLM`; the same 150M-parameter fp32 model, 2 threads, the same fit), and are carried to
every other class by the roofline: an H100's decode step is its weights over 3,350 GB/s times the
engine's measured bandwidth fraction. That carrying-over is the assumption: no accelerator is
measured here. A `--calibration` file measured on a class replaces its row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from pdfleet_operator.api import AcceleratorClassSpec
from pdfleet_operator.decide import runtimes
from pdfleet_operator.sim.perf_model import DEFAULT_STEP_OVERHEAD_S, Efficiency

CPU, ACCELERATOR = "cpu", "accelerator"

# Measured on this machine's CPU (the `cpu` class: 2 x 0.7 TFLOP/s, 2 x 24 GB/s), the same 149.8M-parameter
# fp32 model (`pdfleet model init --preset small`), 2 threads:
# - pdfleet: bench/engine.py on 2026-11-30 (bench/HISTORY.md, a quiet machine): batch-1 decode at 0.703 of
#   the 51.8 GB/s it measured = 0.76 of the class's 48 GB/s; a 528-token prefill in 339 ms = 467 GFLOP/s
#   = 0.33 of 1.4 TFLOP/s. Its per-step overhead is not separable there: 3 ms (DEFAULT_STEP_OVERHEAD_S).
# - vllm: `bench/sim.py calibrate --engine vllm --preset small --threads 2 --reps 3` (vLLM 0.32.0's CPU
#   build, torch.compile; min of 3; load average 5 from other jobs): prefill 846 us/token = MFU 0.253;
#   batch-1 decode step 22.9 ms = MBU 0.546 (a run at load 8 read 42.6 ms: the machine, not vLLM).
#   Its fit gives no per-step overhead apart from the weight read (0): 3 ms assumed on accelerators.
# NOTE: bench/sim.py calibrate of the pdfleet engine at the same load read 50 ms per decode step and
# 4.9 ms per prefill token (MBU 0.25, MFU 0.044), 3.6x and 15x bench/engine.py's quiet-machine numbers;
# bench/peer.py, which alternates the two engines for a fair ratio, could not run (the working tree's
# engine was mid-change). The quiet-machine numbers stand for the pdfleet engine; no ratio between the
# engines here is a measured one.
MEASURED: Mapping[tuple[str, str], Efficiency] = {
    (runtimes.PDFLEET, CPU): Efficiency(
        prefill_mfu=0.33,
        decode_mbu=0.76,
        step_overhead_s=DEFAULT_STEP_OVERHEAD_S,
        source="measured: bench/engine.py 2026-11-30, pdfleet engine, 149.8M fp32, 2 threads "
        "(step overhead 3 ms assumed)",
    ),
    (runtimes.VLLM, CPU): Efficiency(
        prefill_mfu=0.253,
        decode_mbu=0.546,
        step_overhead_s=0.0,
        source="measured: bench/sim.py calibrate --engine vllm, vLLM 0.32.0 CPU, 149.8M fp32, 2 threads",
    ),
}
# NOTE: an assumption, not a measurement: tensor parallelism over `count` devices (vLLM, count > 1)
# reaches this share of count x one device's roofline (an all-reduce of every layer's activations over
# the card link each step). Published vLLM TP2 decode scaling on PCIe/HCCS-class links is 1.6-1.9x;
# 0.9 x 2 = 1.8x.
TENSOR_PARALLEL_SCALING = 0.9


def kind(cls: AcceleratorClassSpec) -> str:
    """The class kind efficiencies are kept per: the host CPU, or an accelerator (every other vendor)."""
    return CPU if cls.vendor == "cpu" else ACCELERATOR


def for_pool(
    engine: str, name: str, cls: AcceleratorClassSpec, calibrated: Mapping[tuple[str, str], Efficiency] | None = None
) -> Efficiency:
    """The efficiency of `engine` on class `name`: a calibration of that (engine, class) if given, else the
    engine's measured CPU fractions (on an accelerator: carried by the roofline, an assumption), with
    the tensor-parallel scaling of a vLLM replica over `count` devices."""
    if engine not in (runtimes.PDFLEET, runtimes.VLLM):
        raise ValueError(f"efficiency: unknown engine {engine!r} (pdfleet or vllm)")
    got = (calibrated or {}).get((engine, name))
    if got is None:
        got = MEASURED[(engine, CPU)]
        if kind(cls) != CPU:
            got = replace(
                got,
                step_overhead_s=max(got.step_overhead_s, DEFAULT_STEP_OVERHEAD_S),
                source=f"assumption: {engine}'s fractions measured on this CPU, carried to {name}'s "
                f"roofline ({got.source.removeprefix('measured: ')}); step overhead "
                f"{DEFAULT_STEP_OVERHEAD_S * 1000:g} ms assumed",
            )
    if engine == runtimes.VLLM and cls.count > 1 and kind(cls) != CPU and got.tensor_parallel_scaling == 1.0:
        got = replace(
            got,
            tensor_parallel_scaling=TENSOR_PARALLEL_SCALING,
            source=f"{got.source}; TP{cls.count} scaling {TENSOR_PARALLEL_SCALING} (assumption)",
        )
    return got
