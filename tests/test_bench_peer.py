"""bench/peer.py's bookkeeping without engines: verdicts only where every repetition agrees, preloads named or refused,
the cold request new to both engines, and the summary's keys and spreads from synthetic samples (the end-to-end
smoke run is in test_bench_scripts.py)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def peer():
    spec = importlib.util.spec_from_file_location("bench_peer", BENCH / "peer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_verdict_needs_every_repetition_on_one_side_of_the_target(peer):
    assert peer.verdict("mixed_vs_vllm", [1.02, 1.10, 1.05]) == "met"
    assert peer.verdict("mixed_vs_vllm", [0.80, 0.95, 0.99]) == "missed"
    assert peer.verdict("mixed_vs_vllm", [0.95, 1.10, 1.05]).startswith("no verdict")
    assert peer.verdict("cold_ttft_vs_vllm", [1.2, 1.4, 1.5]) == "met", "<= 1.5 includes 1.5"
    assert peer.verdict("cold_ttft_vs_vllm", [1.6, 2.0, 4.0]) == "missed"
    assert peer.verdict("cold_ttft_vs_vllm", [1.4, 1.6, 1.3]).startswith("no verdict")
    assert peer.verdict("bs1_vs_vllm", [1.5, 1.6]).startswith("no verdict"), "two repetitions are too few"


def test_preloads_are_named_libraries_or_a_clear_refusal(peer):
    found = {"tcmalloc": "/lib/libtcmalloc_minimal.so.4", "iomp5": None}
    assert peer.preload("none", found, strict=True) == []
    assert peer.preload("tcmalloc", found, strict=True) == ["/lib/libtcmalloc_minimal.so.4"]
    with pytest.raises(SystemExit, match="make vllm"):
        peer.preload("tcmalloc,iomp5", found, strict=True)
    assert peer.preload("tcmalloc,iomp5", found, strict=False) == ["/lib/libtcmalloc_minimal.so.4"]
    with pytest.raises(SystemExit, match="jemalloc"):
        peer.preload("jemalloc", found, strict=False)


def test_the_cold_request_is_new_each_repetition_and_shares_no_block_with_anything_before_it(peer):
    a = peer.parse_args(["--reps", "3", "--requests", "8"])
    plans = peer.make_plans(a, vocab=32000)
    assert all(p["warm_up"] == plans[0]["warm_up"] and p["work"] == plans[0]["work"] for p in plans)
    assert [len(p) for p, _ in plans[0]["warm_up"]] == [length for length, _ in peer.WARM_UP]
    colds = [tuple(p["cold"]) for p in plans]
    assert len(set(colds)) == 3 and all(len(c) == a.prefix + 16 for c in colds)
    for plan in plans:
        before = [p for p, _ in plan["warm_up"]]
        assert all(plan["cold"][:16] != p[:16] for p in before), "the cold prompt's first block is its own"


def _sample(scale: float, rep: int) -> dict:
    """One engine's answers in one repetition; `scale` multiplies every time (so pdfleet/vLLM ratios are known)."""
    return {
        "startup_s": 10.0 * scale,
        "own_warm_up_s": None,
        "idle_cpu_s": 0.1,
        "warm_up_s": 0.5 * scale,
        "cold_s": (0.3 + 0.01 * rep) * scale,
        "mixed_tok_s": 600.0 / scale,
        "mixed_tokens": [[1, 2]],
        "read_gbs": 30.0,
        "dec_s": 0.016 * scale,
        "bs1_tokens": [3],
        "fresh_s": 0.3 * scale,
        "shared_s": 0.02 * scale,
    }


def test_the_summary_holds_every_interface_key_with_its_spread_and_verdict(peer):
    a = argparse.Namespace(vllm_engine_core="inprocess", vllm_eager=False)
    reps = range(5)
    runs = {
        d: {
            "pdfleet": [_sample(1.2 if d == "float32" else 0.9, r) for r in reps],
            "vllm": [_sample(1.0, r) for r in reps],
            "bad": [],
            "compared": 2,
        }
        for d in ("float32", "bfloat16")
    }
    libs = {"vllm": ["/x/libtcmalloc_minimal.so.4", "/y/libiomp5.so"], "pdfleet": []}
    result, rows = peer.summarize(a, runs, weight_bytes=480_000_000, version="0.32.0", libs=libs)
    for key in ("mixed_vs_vllm", "bs1_vs_vllm", "prefix_ttft_vs_vllm", "cold_ttft_vs_vllm"):
        assert {f"{key}_fp32", f"{key}_bf16"} <= set(result)
    assert {"bs1_mbu", "prefix_ttft_vs_vllm", "cold_ttft_vs_vllm", "token_disagreements", "vllm_version"} <= set(result)
    assert result["cold_ttft_vs_vllm"] == result["cold_ttft_vs_vllm_fp32"] == pytest.approx(1.2)
    assert result["mixed_vs_vllm_fp32"] == pytest.approx(1 / 1.2, abs=1e-3)
    assert result["spread"]["cold_ttft_vs_vllm_bf16"] == [pytest.approx(0.9), pytest.approx(0.9)]
    verdicts = result["verdicts"]
    assert verdicts["cold_ttft_vs_vllm_fp32"] == "met" and verdicts["mixed_vs_vllm_fp32"] == "missed"
    assert verdicts["mixed_vs_vllm_bf16"] == "met"
    assert result["bs1_mbu"] == pytest.approx(480_000_000 / 30e9 / (0.016 * 1.2), abs=1e-3)
    assert result["vllm_preload"] == ["libtcmalloc_minimal.so.4", "libiomp5.so"] and result["pdfleet_preload"] == []
    assert result["pdfleet_cold_ttft_ms_fp32"] == pytest.approx(1.2 * 320, abs=0.1), "the median repetition"
    assert any("cold TTFT" in name for name, _, _ in rows)
