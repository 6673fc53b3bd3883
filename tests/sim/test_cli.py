"""`pdfleet simulate`: --compare writes report.json with every policy's keys and non-empty PNGs; bad input exits 2."""

from __future__ import annotations

import argparse
import json

from pdfleet_operator.sim import cli, report
from tests.sim.support import EXAMPLE

SHORT = ["--duration", "6m", "--warmup", "2m", "--rate", "1.5", "--start-hour", "20", "--quiet"]


def test_register_adds_the_simulate_subcommand() -> None:
    parser = argparse.ArgumentParser(prog="pdfleet")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", "--fleet", "f.yaml", "--trace", "code", "--out", "o", "--policy", "a", "b"])
    assert args.func is cli.run and args.policy == ["a", "b"] and not args.compare


def test_compare_writes_report_json_and_plots(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    csv = tmp_path / "trace.csv"
    code = cli.main(
        [
            "simulate",
            "--fleet",
            str(EXAMPLE),
            "--trace",
            "conversation",
            "--compare",
            "--out",
            str(out),
            "--save-trace",
            str(csv),
            *SHORT,
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    doc = json.loads((out / "report.json").read_text())
    assert list(doc["policies"]) == ["static-nvidia", "dynamic-nvidia", "dynamic-mixed", "colocated-mixed"]
    for name, entry in doc["policies"].items():
        for key in report.REQUIRED_KEYS:
            assert key in entry, f"{name} lacks {key}"
        assert entry["cost_per_1m_tokens"] > 0 and entry["accelerator_hours"]
        assert 0 <= entry["slo_attainment"] <= 1 and entry["ttft_p99_s"] > 0 and entry["itl_p99_s"] > 0
    assert doc["comparison"]["baseline"] == "static-nvidia" and doc["comparison"]["candidate"] == "dynamic-mixed"
    assert "Conditions:" in doc["comparison"]["text"]
    for png in ("replicas.png", "queues.png", "cost.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert "per policy" in printed and "efficiency per (engine, AcceleratorClass)" in printed
    # cost at equal SLO attainment (the fleet file's equalSlo sweep): every policy says its cheapest run that
    # reaches the target's attainment, or None
    eq = doc["equal_slo"]
    assert (
        eq["target"] == "static-nvidia"
        and eq["target_attainment"] == doc["policies"]["static-nvidia"]["slo_attainment"]
    )
    for name, entry in doc["policies"].items():
        assert "equal_slo_cost_per_1m_tokens" in entry and "equal_slo_attainment" in entry
        if entry["equal_slo_cost_per_1m_tokens"] is not None:
            assert entry["equal_slo_attainment"] >= eq["target_attainment"]
        assert eq["policies"][name]["runs"][0]["variant"] == "as configured"
    assert "equal_slo_saving" in doc["comparison"]
    assert "cheaper" in printed or "more expensive" in printed
    # The replay path: the same requests from the CSV give the same keys (what `pdfleet up` will be compared on).
    replay = tmp_path / "replay"
    assert (
        cli.main(
            [
                "simulate",
                "--fleet",
                str(EXAMPLE),
                "--trace",
                str(csv),
                "--policy",
                "static-nvidia",
                "--warmup",
                "2m",
                "--out",
                str(replay),
                "--no-plots",
                "--quiet",
            ]
        )
        == 0
    )
    again = json.loads((replay / "report.json").read_text())["policies"]["static-nvidia"]
    first = doc["policies"]["static-nvidia"]
    assert set(again) == set(first) - {"equal_slo_cost_per_1m_tokens", "equal_slo_attainment", "equal_slo_variant"}
    # A CSV trace starts at its first request, so the warm-up boundary moves by that first gap.
    assert abs(again["requests"] - first["requests"]) <= 0.01 * first["requests"] + 2
    assert abs(again["cost_per_1m_tokens"] - first["cost_per_1m_tokens"]) < 0.02 * first["cost_per_1m_tokens"]


def test_bad_inputs_exit_2_with_the_reason(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("0,10,5\n1,ten,5\n")
    assert cli.main(["simulate", "--fleet", str(EXAMPLE), "--trace", str(bad), "--out", str(tmp_path), "--quiet"]) == 2
    assert "bad.csv:2: prompt_tokens 'ten' is not a number" in capsys.readouterr().err
    assert (
        cli.main(["simulate", "--fleet", str(tmp_path / "none.yaml"), "--trace", "code", "--out", str(tmp_path)]) == 2
    )
    assert "no such fleet file" in capsys.readouterr().err
    assert (
        cli.main(
            ["simulate", "--fleet", str(EXAMPLE), "--trace", "code", "--policy", "cheapest", "--out", str(tmp_path)]
        )
        == 2
    )
    assert "no policy 'cheapest'" in capsys.readouterr().err
