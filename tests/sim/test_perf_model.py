"""The per-replica roofline against numbers worked out by hand (Llama-3.1-8B-shaped model, bf16)."""

from __future__ import annotations

import pytest

from pdfleet_operator.api import AcceleratorClassSpec, InferenceDeploymentSpec
from pdfleet_operator.decide import perf
from pdfleet_operator.sim import perf_model as pm

PARAMS = 8.03e9
KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V x layers x kv heads x head dim x bf16 bytes = 131072


def spec(**engine) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate(
        {
            "model": {
                "name": "m",
                "source": {"local": {"path": "m"}},
                "maxModelLen": 8192,
                "architecture": {"parametersBillions": 8.03, "layers": 32, "kvHeads": 8, "headDim": 128},
            },
            "engine": {"maxNumSeqs": 256, "maxNumBatchedTokens": 4096, "blockSize": 16, **engine},
            "prefill": {"acceleratorClasses": ["h100"]},
            "decode": {"acceleratorClasses": ["h100"]},
        }
    )


def h100(**kw) -> AcceleratorClassSpec:
    return AcceleratorClassSpec.model_validate(
        {
            "vendor": "nvidia",
            "resourceName": "nvidia.com/gpu",
            "memoryGiB": 80,
            "peakTflops": 989,
            "memoryBandwidthGBps": 3350,
            "networkGBps": 50,
            "costPerHour": 2.99,
            **kw,
        }
    )


def test_constants_are_the_roofline_by_hand() -> None:
    eff = pm.Efficiency(prefill_mfu=0.5, decode_mbu=0.8, step_overhead_s=0.003)
    rp = pm.replica_perf(spec(), "h100", h100(), eff)
    assert rp.flop_s_per_token == pytest.approx(2 * PARAMS / (989e12 * 0.5))  # 32.5 us per token
    assert rp.weights_read_s == pytest.approx(PARAMS * 2 / (3350e9 * 0.8))  # 5.99 ms
    assert rp.kv_read_s_per_token == pytest.approx(KV_PER_TOKEN / (3350e9 * 0.8))  # 48.9 ns
    assert rp.kv_bytes_per_token == KV_PER_TOKEN
    # KV slots: (80 GiB - weights - 1 GiB runtime reserve) x 0.85, in whole 16-token blocks.
    weights_gib = PARAMS * 2 / 2**30
    slots = int((80 - weights_gib - 1) * 0.85 * 2**30 / KV_PER_TOKEN) // 16 * 16
    assert rp.kv_capacity_tokens == slots


def test_prefill_step_is_compute_bound_and_decode_step_bandwidth_bound() -> None:
    rp = pm.replica_perf(spec(), "h100", h100(), pm.Efficiency(0.5, 0.8, 0.003))
    # A full 4096-token prefill chunk: 4096 x 32.47 us = 133 ms of compute >> 6 ms of weight reads.
    assert rp.step_time(4096, 4096) == pytest.approx(0.003 + 4096 * 2 * PARAMS / (989e12 * 0.5))
    assert rp.step_time(4096, 4096) == pytest.approx(0.1360, abs=2e-4)
    # Decode, batch 8 at 2000 tokens of context each: weights + 16,000 tokens of KV, read once.
    expected = 0.003 + (PARAMS * 2 + 16_000 * KV_PER_TOKEN) / (3350e9 * 0.8)
    assert rp.step_time(8, 16_000) == pytest.approx(expected)
    assert rp.step_time(8, 16_000) == pytest.approx(0.00977, abs=1e-5)


def test_batch_effects_slow_each_step_but_raise_throughput_until_compute_bound() -> None:
    rp = pm.replica_perf(spec(), "h100", h100(), pm.Efficiency(0.5, 0.8, 0.003))
    steps = [rp.step_time(b, b * 1000) for b in (1, 8, 64, 256)]
    assert steps == sorted(steps) and steps[-1] > 2 * steps[0]
    rates = [pm.decode_tokens_per_s(rp, b, 1000) for b in (1, 8, 64, 256)]
    assert rates == sorted(rates) and rates[-1] > 30 * rates[0]
    # At 256 sequences x 1000 tokens the step reads 33.5 GB of KV: 12.5 ms beside 6 ms of weights.
    assert rp.step_time(256, 256_000) == pytest.approx(0.003 + (PARAMS * 2 + 256_000 * KV_PER_TOKEN) / 2680e9)


def test_count_scales_peak_and_bandwidth() -> None:
    one = pm.replica_perf(spec(), "h100", h100(), pm.Efficiency())
    two = pm.replica_perf(spec(), "h100x2", h100(count=2), pm.Efficiency())
    assert two.flop_s_per_token == pytest.approx(one.flop_s_per_token / 2)
    assert two.weights_read_s == pytest.approx(one.weights_read_s / 2)
    assert two.kv_capacity_tokens > 2 * one.kv_capacity_tokens  # the weights are paid once


def test_kv_transfer_is_bytes_over_the_slower_link_plus_latency() -> None:
    fast = pm.replica_perf(spec(), "h100", h100(), pm.Efficiency())
    slow = pm.replica_perf(spec(), "h100", h100(networkGBps=12.5), pm.Efficiency())
    # 2000 tokens x 128 KiB = 262 MB: 5.2 ms at 50 GB/s, 21 ms at 12.5 GB/s, plus 2 ms.
    assert pm.kv_transfer_s(2000, fast, fast, 0.002) == pytest.approx(0.002 + 2000 * KV_PER_TOKEN / 50e9)
    assert pm.kv_transfer_s(2000, fast, slow, 0.002) == pytest.approx(0.002 + 2000 * KV_PER_TOKEN / 12.5e9)
    measured = pm.replica_perf(spec(), "h100", h100(), pm.Efficiency(kv_transfer_gbps=2.0))
    assert measured.network_gbps == 2.0


def test_defaults_are_the_operators_perf_factors() -> None:
    e = pm.Efficiency()
    assert (e.prefill_mfu, e.decode_mbu) == (perf.PREFILL_MFU, perf.DECODE_MBU)


def test_int8_kv_halves_kv_bytes() -> None:
    rp = pm.replica_perf(spec(kvCacheDtype="int8"), "h100", h100(), pm.Efficiency())
    assert rp.kv_bytes_per_token == KV_PER_TOKEN / 2


def test_bad_inputs_raise_with_the_reason() -> None:
    with pytest.raises(ValueError, match="does not fit tiny"):
        pm.replica_perf(spec(), "tiny", h100(memoryGiB=10), pm.Efficiency())
    with pytest.raises(ValueError, match="prefill_mfu must be in"):
        pm.Efficiency(prefill_mfu=1.5)
    no_arch = spec().model_copy(update={"model": spec().model.model_copy(update={"architecture": None})})
    with pytest.raises(ValueError, match="architecture is required"):
        pm.replica_perf(no_arch, "h100", h100(), pm.Efficiency())


def test_max_batch_within_an_itl() -> None:
    rp = pm.replica_perf(spec(), "h100", h100(), pm.Efficiency(0.5, 0.8, 0.003))
    b = pm.max_batch_within(rp, 0.010, 1000)
    assert rp.step_time(b, b * 1000) <= 0.010 < rp.step_time(b + 1, (b + 1) * 1000)
    assert pm.max_batch_within(rp, 0.001, 1000) == 0
