"""Calibration from benchmark JSON: the shapes understood, the errors, and what the printed table says."""

from __future__ import annotations

import json

import pytest

from pdfleet_operator.sim import calibration, efficiency
from tests.sim.support import small


def test_sim_calibration_line_sets_every_factor(tmp_path) -> None:
    classes = small().classes
    path = tmp_path / "cal.txt"
    path.write_text(
        "step overhead   1.2 ms\n"
        + json.dumps(
            {
                "kind": calibration.CALIBRATION_KIND,
                "class": "cpu",
                "prefill_mfu": 0.31,
                "decode_mbu": 0.62,
                "step_overhead_s": 0.0012,
                "kv_transfer_gbps": 1.5,
                "http_hop_s": 0.004,
                "model": "tiny",
            }
        )
        + "\n"
    )
    effs = calibration.load([path], classes)
    e = effs[("pdfleet", "cpu")]  # a calibration without "engine" is the pdfleet engine's (bench/sim.py calibrate)
    assert (e.prefill_mfu, e.decode_mbu, e.step_overhead_s, e.kv_transfer_gbps, e.http_hop_s) == (
        0.31,
        0.62,
        0.0012,
        1.5,
        0.004,
    )
    assert "measured" in e.source and "tiny" in e.source
    rows = calibration.rows([("pdfleet", "cpu"), ("vllm", "h100-80gb")], effs, classes)
    assert rows[0][:6] == ("cpu", "pdfleet", "0.310", "0.620", "1.20 ms", "4.00 ms")
    # not calibrated: vLLM's fractions measured on this CPU, carried to the H100 (an assumption, and it says so)
    assert rows[1][:4] == ("h100-80gb", "vllm", "0.253", "0.546") and rows[1][5] == "0.00 ms"
    assert rows[1][8].startswith("assumption")
    vllm = tmp_path / "vllm.json"
    vllm.write_text(
        json.dumps(
            {
                "kind": calibration.CALIBRATION_KIND,
                "class": "cpu",
                "engine": "vllm",
                "prefill_mfu": 0.2,
                "decode_mbu": 0.5,
                "step_overhead_s": 0.0,
            }
        )
    )
    both = calibration.load([path, vllm], classes)
    assert both[("vllm", "cpu")].decode_mbu == 0.5 and both[("pdfleet", "cpu")].decode_mbu == 0.62


def test_engine_and_pd_bench_lines_refine_the_cpu_class(tmp_path) -> None:
    classes = small().classes
    engine = tmp_path / "engine.txt"
    engine.write_text(
        "engine mixed  100 tok/s\n" + json.dumps({"bs1_mbu": 0.74, "read_gbs": 24.0, "engine_tok_s": 100}) + "\n"
    )
    pd = tmp_path / "pd.json"
    pd.write_text(
        json.dumps({"pd_ttft_overhead_ms": 30, "kv_bytes": 1 << 20, "transfer_gbps": 2.5, "loopback_gbps": 5})
    )
    effs = calibration.load([engine, pd], classes)
    e = effs[("pdfleet", "cpu")]
    # the bandwidth bench/engine.py measured over the class's (count x memoryBandwidthGBps, as the roofline uses)
    assert e.decode_mbu == pytest.approx(0.74 * 24.0 / (classes["cpu"].memory_bandwidth_gbps * classes["cpu"].count))
    assert e.kv_transfer_gbps == 2.5
    # not measured there: the table's value, and the source says which came from where
    assert e.prefill_mfu == efficiency.MEASURED[("pdfleet", "cpu")].prefill_mfu
    assert "bench/engine.py" in e.source and "bench/pd.py" in e.source


@pytest.mark.parametrize(
    "content, message",
    [
        ("no json here\n", "no calibration in it"),
        (
            json.dumps(
                {
                    "kind": calibration.CALIBRATION_KIND,
                    "class": "tpu",
                    "prefill_mfu": 0.5,
                    "decode_mbu": 0.5,
                    "step_overhead_s": 0.001,
                }
            ),
            "class 'tpu', not an AcceleratorClass",
        ),
        (
            json.dumps(
                {
                    "kind": calibration.CALIBRATION_KIND,
                    "class": "cpu",
                    "prefill_mfu": 2,
                    "decode_mbu": 0.5,
                    "step_overhead_s": 0.001,
                }
            ),
            "prefill_mfu must be a number in",
        ),
    ],
)
def test_bad_calibration(tmp_path, content, message) -> None:
    path = tmp_path / "c.json"
    path.write_text(content)
    with pytest.raises(calibration.CalibrationError, match=message):
        calibration.load([path], small().classes)
