"""Disaggregate only where it pays: the prompt length below which a PD request skips the prefill pool (pure).

A decode worker can compute a short prompt itself (the router's local-prefill path). Sending the prompt through
the prefill pool instead costs a hand-off and the KV's trip over the network; it buys protection of the decode
batch from a long prefill. For a prompt of n tokens, with the roofline of `decide.perf`:

    local   TTFT n x p_d                       (p_d: seconds per prompt token on the decode class)
    PD      TTFT n x p_p + HANDOFF + n x x     (p_p: on the prefill class; x: KV bytes per token / link bandwidth)

and the local prefill stalls the decode step it joins by n x p_d. The threshold is the largest n for which both
hold: the local path is no slower to the first token, and the decode step that absorbs the prompt still meets the
ITL SLO (the reference decode step, `perf.itl_seconds`, plus n x p_d <= slo.itl), capped at one engine step's token
budget. Over several classes per role, the smallest threshold of every pair. A spec without
`model.architecture` gets 0 (every PD request goes through the prefill pool, as before this existed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pdfleet_operator.api import AcceleratorClassSpec, InferenceDeploymentSpec, parse_duration
from pdfleet_operator.decide import perf

# The fixed cost of a hand-off beyond the prompt's compute: the prefill answer, the decode call and the pull's
# setup (the simulator's default KV transfer latency is the same 2 ms).
HANDOFF_S = 0.002


def prefill_s_per_token(spec: InferenceDeploymentSpec, cls: AcceleratorClassSpec) -> float | None:
    arch = spec.model.architecture
    if arch is None:
        return None
    return 2 * arch.parameters_billions * 1e9 / (cls.peak_tflops * 1e12 * cls.count * perf.PREFILL_MFU)


def pair_threshold(spec: InferenceDeploymentSpec, prefill: AcceleratorClassSpec, decode: AcceleratorClassSpec) -> int:
    """The threshold for one prefill class and one decode class (see the module docstring)."""
    p_p, p_d = prefill_s_per_token(spec, prefill), prefill_s_per_token(spec, decode)
    kv, step = perf.kv_bytes_per_token(spec), perf.itl_seconds(spec, decode)
    if p_p is None or p_d is None or kv is None or step is None:
        return 0
    x = kv / (min(prefill.network_gbps, decode.network_gbps) * 1e9)
    extra = p_d - p_p - x  # what a local prompt token costs the first token beyond the PD path's
    ttft_bound = math.inf if extra <= 0 else HANDOFF_S / extra
    itl_bound = (parse_duration(spec.slo.itl) - step) / p_d
    return max(0, math.floor(min(ttft_bound, itl_bound, spec.engine.max_num_batched_tokens)))


def default_threshold(spec: InferenceDeploymentSpec, classes: Mapping[str, AcceleratorClassSpec]) -> int:
    """The cost model's threshold for a disaggregated spec over the classes its roles list (0: colocated)."""
    if not spec.disaggregation or spec.prefill is None or spec.decode is None:
        return 0
    pairs = [
        pair_threshold(spec, classes[p], classes[d])
        for p in spec.prefill.accelerator_classes
        for d in spec.decode.accelerator_classes
        if p in classes and d in classes
    ]
    return min(pairs, default=0)


def threshold(spec: InferenceDeploymentSpec, classes: Mapping[str, AcceleratorClassSpec]) -> int:
    """spec.router.pdMinPromptTokens when set, else the cost model's default."""
    explicit = spec.router.pd_min_prompt_tokens
    return explicit if explicit is not None else default_threshold(spec, classes)
