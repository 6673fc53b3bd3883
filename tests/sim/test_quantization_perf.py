"""engine.quantization int8 in the roofline placement and `pdfleet simulate` share: one byte per parameter, so
the weights leave more room for KV and a memory-bound decode step reads fewer bytes."""

from __future__ import annotations

import pytest

from pdfleet_operator.decide import perf
from pdfleet_operator.sim import perf_model as pm
from tests.sim.test_perf_model import PARAMS, h100, spec


def test_int8_weights_are_one_byte_per_parameter() -> None:
    assert perf.weights_bytes(spec()) == pytest.approx(PARAMS * 2)  # bf16
    assert perf.weights_bytes(spec(quantization="int8")) == pytest.approx(PARAMS)


def test_int8_replicas_hold_more_kv_and_decode_faster_at_the_same_compute() -> None:
    eff = pm.Efficiency()
    bf16, int8 = (pm.replica_perf(spec(**kw), "h100", h100(), eff) for kw in ({}, {"quantization": "int8"}))
    assert int8.weights_read_s == pytest.approx(bf16.weights_read_s / 2)
    assert int8.flop_s_per_token == bf16.flop_s_per_token  # the weights are widened to compute: same FLOPs
    extra_gib = PARAMS / 2**30 * 0.85  # the bytes int8 saves, at the KV fraction
    assert int8.kv_capacity_tokens - bf16.kv_capacity_tokens == pytest.approx(
        extra_gib * 2**30 / bf16.kv_bytes_per_token, rel=0.01
    )
    # a batch-1 decode step is the weights' read (plus the fixed step overhead): half of it
    assert int8.step_time(1, 0) - int8.overhead_s == pytest.approx((bf16.step_time(1, 0) - bf16.overhead_s) / 2)
    assert pm.decode_tokens_per_s(int8, 1, 1024) > 1.4 * pm.decode_tokens_per_s(bf16, 1, 1024)


def test_a_model_that_only_fits_quantized_fits_int8() -> None:
    small = h100(memoryGiB=16)
    assert not perf.fit(spec(), small).fits  # 16 GB of bf16 weights
    assert perf.fit(spec(quantization="int8"), small).fits
