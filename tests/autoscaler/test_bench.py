"""bench/autoscaler.py's queueing model and its comparison, on one seed (the full bench prints the numbers)."""

from __future__ import annotations

import json

from bench import autoscaler as bench
from pdfleet_operator.autoscaler import PDFLEET, PER_ROLE


def test_bursty_trace_pdfleet_underprovisions_less_at_no_more_replica_hours():
    bursty = next(t for t in bench.traces() if t.name == "bursty")
    base, ours = bench.run(bursty, PER_ROLE, seed=1), bench.run(bursty, PDFLEET, seed=1)
    assert ours.under["decode"] < base.under["decode"]  # the look-ahead's whole point
    assert ours.under_total < 0.9 * base.under_total
    assert ours.replica_seconds <= base.replica_seconds
    assert len(base.reactions) >= len(bursty.surges) and ours.reaction < base.reaction


def test_long_output_grows_decode_and_short_prompt_shrinks_prefill():
    traces = {t.name: t for t in bench.traces()}
    long_output = bench.run(traces["long-output"], PDFLEET, seed=1)
    start = traces["long-output"].needed(0)
    assert long_output.final_replicas["decode"] >= traces["long-output"].needed(1500)["decode"] > start["decode"]
    assert long_output.final_replicas["prefill"] <= start["prefill"] + 1
    short = bench.run(traces["short-prompt"], PDFLEET, seed=1)
    assert short.final_replicas["prefill"] < traces["short-prompt"].needed(0)["prefill"]


def test_bench_ends_with_the_json_line(capsys):
    assert bench.main(["--seeds", "1"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    assert {"underprovisioned_reduction", "replica_hours_ratio", "direction_changes_noisy"} <= set(summary)
