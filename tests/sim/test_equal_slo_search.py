"""The equal-SLO search: bisection over a policy's variants ordered by headroom runs about log2(n) of them and finds
what running them all finds."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml

from pdfleet_operator import trace as tr
from pdfleet_operator.sim import cli, fleet, report, simulator
from pdfleet_operator.sim.search import Bisection
from tests.sim.support import ROOT, doc, small
from tests.sim.test_simulator import surge


def run_search(attainments: list[float], goal: float) -> Bisection:
    b = Bisection(len(attainments), goal)
    while (i := b.next()) is not None:
        b.attained[i] = attainments[i]
    return b


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13])
def test_bisection_finds_the_first_variant_reaching_the_goal_in_about_log2_runs(n: int) -> None:
    attainments = [0.80 + 0.01 * i for i in range(n)]  # more headroom, more attainment
    for goal in [0.75] + attainments + [attainments[-1] + 0.001]:
        b = run_search(attainments, goal)
        first = next((i for i, a in enumerate(attainments) if a >= goal), None)
        assert b.found() == first, (n, goal)
        assert len(b.attained) <= 1 + math.ceil(math.log2(n)), (n, goal, sorted(b.attained))
        assert b.monotone()
    assert len(run_search(attainments, 0.999).attained) == 1  # the most headroom misses: nothing else is run


def test_bisection_waits_for_the_goal_and_reports_a_list_out_of_order() -> None:
    b = Bisection(4)
    assert b.next() is None  # no target attainment yet
    b.goal = 0.95
    b.attained.update({3: 0.96, 1: 0.97})  # variant 1 reaches the goal ...
    assert b.next() == 0
    b.attained[0] = 0.90
    assert b.next() is None and b.found() == 1
    b.attained[2] = 0.93  # ... and a variant after it does not
    assert not b.monotone()
    with pytest.raises(ValueError):
        Bisection(0)


SEARCH = [{"name": f"{p}P", "spec": {"prefill": {"minReplicas": p, "maxReplicas": p}}} for p in (1, 2, 3, 4)]


def write_fleet(tmp_path, equal_slo: dict) -> str:  # noqa: ANN001
    f = doc(
        equalSlo=equal_slo,
        trace={"preset": "conversation", "meanRatePerSecond": 6, "duration": "5m"},
        policies=[
            {
                "name": "static",
                "description": "1 prefill",
                "spec": {
                    "autoscaling": {"enabled": False},
                    "prefill": {"minReplicas": 4, "maxReplicas": 4},
                    "decode": {"minReplicas": 2, "maxReplicas": 2},
                },
            },
            {
                "name": "small",
                "description": "fewer prefill",
                "spec": {
                    "autoscaling": {"enabled": False},
                    "prefill": {"minReplicas": 1, "maxReplicas": 1},
                    "decode": {"minReplicas": 2, "maxReplicas": 2},
                },
            },
        ],
        compare=["static", "small"],
    )
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(f))
    return str(path)


def simulate(tmp_path, name: str, equal_slo: dict, *extra: str) -> dict:  # noqa: ANN001
    out = tmp_path / name
    args = [
        "simulate",
        "--fleet",
        write_fleet(tmp_path, equal_slo),
        "--trace",
        "conversation",
        "--compare",
        "--out",
        str(out),
        "--warmup",
        "1m",
        "--start-hour",
        "20",
        "--no-plots",
        "--quiet",
        "--jobs",
        "2",
        *extra,
    ]
    assert cli.main(args) == 0
    return json.loads((out / "report.json").read_text())


def test_the_search_runs_fewer_variants_and_answers_as_the_full_sweep(tmp_path) -> None:  # noqa: ANN001
    searched = simulate(tmp_path, "search", {"target": "static", "search": {"small": SEARCH}})
    swept = simulate(tmp_path, "sweep", {"target": "static", "sweep": {"small": SEARCH}}, "--full-variants")
    got, full = searched["equal_slo"], swept["equal_slo"]
    attained = {r["variant"]: r["slo_attainment"] for r in full["policies"]["small"]["runs"][1:]}
    assert [attained[f"{p}P"] for p in (1, 2, 3, 4)] == sorted(attained.values())  # the list's order holds here
    assert not any("stopped" in r for r in full["policies"]["small"]["runs"])
    goal = got["target_attainment"]
    assert goal == full["target_attainment"]
    search = got["search"]["small"]
    assert search["variants"] == ["1P", "2P", "3P", "4P"] and search["monotone"]
    assert len(search["ran"]) < 4
    assert any("stopped" in r for r in search["ran"])  # a variant that misses stops early ...
    for r in search["ran"]:  # ... and what the search ran is what the sweep measured, or a true bound of it
        if "stopped" in r:
            assert r["slo_attainment"] is None
            assert attained[r["variant"]] <= r["stopped"]["slo_attainment_at_most"] < goal
            assert r["stopped"]["misses"] > r["stopped"]["allowed_misses"]
            assert r["stopped"]["at_s"] < searched["trace"]["duration_s"]
        else:
            assert r["slo_attainment"] == attained[r["variant"]]
    assert got["policies"]["small"]["variant"] == full["policies"]["small"]["variant"]
    assert got["policies"]["small"]["cost_per_1m_tokens"] == full["policies"]["small"]["cost_per_1m_tokens"]
    assert searched["policies"]["small"]["equal_slo_variant"] == swept["policies"]["small"]["equal_slo_variant"]


def test_search_variants_are_validated_like_policies() -> None:
    ok = fleet.parse(doc(equalSlo={"target": "static", "search": {"dynamic": SEARCH}}), source="x.yaml", base_dir=ROOT)
    assert [v.variant for v in ok.equal_slo.search["dynamic"]] == ["1P", "2P", "3P", "4P"]
    assert ok.equal_slo.variants == {}
    bad = [{"name": "u2", "spec": {"autoscaling": {"targetUtilization": 2}}}]
    with pytest.raises(fleet.FleetError, match=r"equalSlo.search.dynamic\[0\].*targetUtilization"):
        fleet.parse(doc(equalSlo={"target": "static", "search": {"dynamic": bad}}), source="x.yaml", base_dir=ROOT)
    twice = {"target": "static", "search": {"dynamic": SEARCH[:1]}, "sweep": {"dynamic": SEARCH[:1]}}
    with pytest.raises(fleet.FleetError, match="1P both in sweep and search"):
        fleet.parse(doc(equalSlo=twice), source="x.yaml", base_dir=ROOT)
    with pytest.raises(fleet.FleetError, match="variant names must differ"):
        fleet.parse(
            doc(equalSlo={"target": "static", "search": {"dynamic": SEARCH[:1] * 2}}), source="x.yaml", base_dir=ROOT
        )


@pytest.mark.parametrize("policy", ["dynamic", "static", "colocated"])
def test_the_attainment_watch_counts_the_reports_misses_exactly(policy: str) -> None:
    # PD hand-offs, rejections (full queues) and too-long prompts all in one run; a goal of 0 never stops it
    f = small(deployment={"spec": {"engine": {"maxWaitingRequests": 4}}})
    trace = surge(duration=300.0, low=5.0, high=60.0)
    trace = tr.Trace(
        "t", trace.arrival, np.where(np.arange(len(trace)) % 40 == 0, 9000, trace.prompt), trace.output, trace.duration
    )
    sim = simulator.Simulator(f, f.policy(policy), trace, warmup_s=30.0, stop_below=0.0).run()
    assert sim.stopped is None
    entry = report.summarize(sim)
    assert 0 < entry["slo_met"] < entry["slo_counted"]
    assert entry["rejected"] > 0 and entry["too_long"] > 0
    assert sim.watch.count() == entry["slo_counted"] - entry["slo_met"]
    assert sim.watch.counted == entry["slo_counted"]


def test_a_run_stops_once_its_goal_is_out_of_reach_and_says_so() -> None:
    f = small(deployment={"spec": {"engine": {"maxWaitingRequests": 4}}})
    trace = surge(duration=600.0, low=5.0, high=60.0)
    full = report.summarize(simulator.Simulator(f, f.policy("static"), trace, warmup_s=30.0).run())
    goal = round(full["slo_attainment"] + 0.02, 4)
    sim = simulator.Simulator(f, f.policy("static"), trace, warmup_s=30.0, stop_below=goal).run()
    assert sim.stopped is not None and sim.stopped.t < trace.duration
    assert sim.stopped.misses > sim.stopped.allowed
    entry = report.summarize(sim)
    assert entry["slo_attainment"] is None and entry["cost_per_1m_tokens"] is None
    assert full["slo_attainment"] <= entry["stopped"]["slo_attainment_at_most"] < goal
    reachable = simulator.Simulator(f, f.policy("static"), trace, warmup_s=30.0, stop_below=full["slo_attainment"])
    assert report.summarize(reachable.run())["slo_attainment"] == full["slo_attainment"]  # its own goal: no stop
