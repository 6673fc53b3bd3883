"""DES invariants: every request ends, tokens are conserved, pods never exceed the nodes, and the real autoscaler
acts."""

from __future__ import annotations

import numpy as np
import pytest

from pdfleet_operator import trace as tr
from pdfleet_operator.sim import engine as eng
from pdfleet_operator.sim import report, simulator
from pdfleet_operator.sim.perf_model import Efficiency
from tests.sim.support import small


class Checked(simulator.Simulator):
    """Asserts after every bind and removal that no node gives out more units than it has."""

    def _bind(self, d, role, cname, t, warm=False):  # noqa: ANN001, ANN202
        ok = super()._bind(d, role, cname, t, warm)
        self._check()
        return ok

    def _remove(self, rep, t):  # noqa: ANN001, ANN202
        super()._remove(rep, t)
        self._check()

    def _check(self) -> None:
        for node in self.base_nodes:
            for res, units in self.used[node.name].items():
                assert 0 <= units <= node.free.get(res, 0), f"{node.name}: {units} of {node.free.get(res)} {res}"
        live = sum(len(d.replicas) for d in self.deps)
        assert live == sum(1 for r in self.all_replicas if r.removed_at is None)


def surge(duration: float = 900.0, low: float = 2.0, high: float = 40.0, seed: int = 0) -> tr.Trace:
    """`low` req/s, then `high` from a third of the way in to two thirds, then `low` again."""
    rng = np.random.default_rng(seed)
    third = duration / 3
    parts = [
        np.sort(rng.uniform(a, b, rng.poisson(rate * (b - a))))
        for a, b, rate in ((0, third, low), (third, 2 * third, high), (2 * third, duration, low))
    ]
    arrival = np.concatenate(parts)
    n = len(arrival)
    return tr.Trace("surge", arrival, rng.integers(200, 2000, n), rng.integers(20, 400, n), duration)


def run(policy: str, trace: tr.Trace, fleet=None, **kw) -> Checked:  # noqa: ANN001
    f = fleet or small()
    return Checked(f, f.policy(policy), trace, **kw).run()


@pytest.mark.parametrize("policy", ["dynamic", "static", "colocated"])
def test_every_request_ends_and_tokens_are_conserved(policy: str) -> None:
    trace = surge(duration=600.0, low=2.0, high=25.0)
    sim = run(policy, trace)
    status = np.asarray(sim.reqs.status)
    assert not np.any(status == eng.ACTIVE)
    assert np.all(np.isin(status, [eng.DONE, eng.REJECTED, eng.TOO_LONG]))
    done = status == eng.DONE
    assert done.mean() > 0.95
    gen = np.asarray(sim.reqs.gen)
    out = np.asarray(sim.reqs.output)
    assert np.array_equal(gen[done], out[done])  # each finished request got all its tokens
    assert sum(r.gen_tokens for r in sim.all_replicas) == gen.sum()  # workers counted exactly what requests got
    assert sum(r.prompt_tokens for r in sim.all_replicas) == np.asarray(sim.reqs.prompt)[gen > 0].sum()
    first, doneat = np.asarray(sim.reqs.t_first), np.asarray(sim.reqs.t_done)
    arrival = np.asarray(sim.reqs.arrival)
    assert np.all(first[done] >= arrival[done]) and np.all(doneat[done] >= first[done])
    for d in sim.deps:  # nothing left in any engine, no KV held
        for r in d.replicas:
            assert r.idle() and r.kv_used(sim.end) == pytest.approx(0.0, abs=1e-6)


def test_a_surge_grows_the_pools_through_the_autoscaler_and_the_quiet_shrinks_them() -> None:
    sim = run("dynamic", surge(duration=1200.0, low=1.0, high=40.0))
    ups = [e for e in sim.scale_events if e.desired > e.current]
    downs = [e for e in sim.scale_events if e.desired < e.current]
    assert {e.role for e in ups} == {"prefill", "decode"}
    assert downs, "the quiet third brings replicas down after the stabilization window"
    # a surge from cold: the queues, or the token rate once a first saturated interval gave it a throughput
    assert {e.reason for e in ups} <= {
        "QueueAboveTarget",
        "QueueGrowing",
        "PrefillBacklog",
        "RatioBound",
        "MaxReplicas",
        "ScalingLimited",
        "TokenRateAboveCapacity",
    }
    peak = max(sum(v for k, v in s.replicas.items() if "/decode/" in k) for s in sim.samples)
    assert peak > 1
    assert all(e.t >= 400 for e in ups), "nothing grows before the surge starts at 400 s"
    # The decode pool spilled from MIG slices (ranked first in the cost tier) onto Ascend when the slices ran out.
    classes = {k.split("/")[2] for s in sim.samples for k in s.replicas if "/decode/" in k}
    assert "h100-mig-3g-40gb" in classes


def test_static_policy_never_scales_and_holds_its_size() -> None:
    sim = run("static", surge(duration=600.0))
    assert sim.scale_events == []
    assert {sum(s.replicas.values()) for s in sim.samples} == {4}


def test_pods_wait_for_start_up_before_serving() -> None:
    sim = run("dynamic", surge(duration=900.0, low=1.0, high=40.0))
    late = [r for r in sim.all_replicas if r.created_at > 0]
    assert late
    for r in late:
        assert r.ready_at == pytest.approx(r.created_at + sim.settings.startup(r.accelerator_class))
        assert r.busy_s == 0 or r.removed_at is None or r.removed_at > r.ready_at


def test_capacity_bounds_the_pools() -> None:
    # Four H100 units in all: prefill (max 4) and colocated growth can never bind a fifth.
    f = small(
        nodes=[
            {"name": "h100", "count": 1, "accelerators": {"h100-80gb": 2}},
            {"name": "mig", "count": 1, "devices": 1, "accelerators": {"h100-mig-3g-40gb": 2}},
        ],
        deployment={"spec": {"decode": {"acceleratorClasses": ["h100-mig-3g-40gb"]}}},
    )
    sim = run("dynamic", surge(duration=900.0, low=1.0, high=60.0), fleet=f)
    assert max(sum(v for k, v in s.replicas.items() if "/prefill/" in k) for s in sim.samples) <= 2
    assert max(sum(v for k, v in s.replicas.items() if "/decode/" in k) for s in sim.samples) <= 2
    assert (
        any(e.reason == "ScalingLimited" for e in sim.scale_events)
        or any(e.reason == "MaxReplicas" for e in sim.scale_events)
        or sim.scale_events
    )


def test_full_queues_answer_503_and_long_prompts_400() -> None:
    f = small(deployment={"spec": {"engine": {"maxWaitingRequests": 2}}})
    trace = surge(duration=300.0, low=30.0, high=80.0)
    trace = tr.Trace(
        "t", trace.arrival, np.where(np.arange(len(trace)) % 50 == 0, 9000, trace.prompt), trace.output, trace.duration
    )
    sim = run("static", trace, fleet=f)
    status = np.asarray(sim.reqs.status)
    assert (status == eng.TOO_LONG).sum() == (np.asarray(sim.reqs.prompt) == 9000).sum()
    assert (status == eng.REJECTED).sum() > 0
    entry = report.summarize(sim)
    assert entry["rejected"] == (status == eng.REJECTED).sum()
    assert entry["slo_attainment"] < 1.0
    assert any(a["kind"] == "page" for a in entry["rollback_actions"]), "a 5xx storm reaches the rollback analysis"


def test_traffic_tiers_split_the_trace_between_deployments() -> None:
    f = small(
        policies=[
            {
                "name": "tiers",
                "deployments": [
                    {"name": "latency", "share": 0.3, "spec": {"slo": {"ttft": "500ms"}}},
                    {
                        "name": "cost",
                        "share": 0.7,
                        "spec": {"tier": "cost", "decode": {"acceleratorClasses": ["ascend-910b"]}},
                    },
                ],
            }
        ]
    )
    sim = run("tiers", surge(duration=300.0, low=5.0, high=5.0), fleet=f)
    share = np.mean(np.asarray(sim.reqs.deployment) == 0)
    assert 0.25 < share < 0.35
    entry = report.summarize(sim)
    assert [d["name"] for d in entry["deployments"]] == ["latency", "cost"]
    assert {k.split("/")[0] for s in sim.samples for k in s.replicas} == {"latency", "cost"}


def test_summary_has_the_report_keys_and_sane_values() -> None:
    sim = run("dynamic", surge(duration=600.0, low=3.0, high=10.0), warmup_s=60.0)
    e = report.summarize(sim)
    for key in report.REQUIRED_KEYS:
        assert key in e
    assert e["cost_per_1m_tokens"] > 0 and 0 < e["slo_attainment"] <= 1
    assert 0 < e["ttft_p99_s"] and e["itl_p50_s"] <= e["itl_p99_s"]
    assert set(e["accelerator_hours"]) <= {"h100-80gb", "h100-mig-3g-40gb", "ascend-910b"}
    assert e["requests"] == int((np.asarray(sim.reqs.arrival) >= 60.0).sum())
    times, cum = report.cost_series(sim)
    assert cum[-1] == pytest.approx(e["cost_usd"], rel=0.02)
    assert np.all(np.diff(cum) >= -1e-9)


@pytest.mark.parametrize("policy, hops", [("static", 3), ("colocated", 2)])
def test_http_hops_delay_the_first_token_and_pd_ttft_includes_the_hand_off(policy: str, hops: int) -> None:
    """Sparse requests (no queueing): a measured HTTP hop adds 3 hops to a PD request's TTFT (client -> router ->
    prefill, router -> decode) and 2 to a colocated one's; in PD the first token the client sees is the decode
    worker's, so TTFT covers the KV hand-off and the ITL does not."""
    n = 20
    trace = tr.Trace("sparse", np.arange(n) * 10.0, np.full(n, 500), np.full(n, 50), n * 10.0)
    f = small()
    hop = 0.05
    plain = {(engine, c): Efficiency() for c in f.classes for engine in ("pdfleet", "vllm")}
    base = report.summarize(run(policy, trace, f, efficiencies=plain))
    effs = {key: Efficiency(http_hop_s=hop) for key in plain}
    slow = report.summarize(run(policy, trace, f, efficiencies=effs))
    assert slow["completed"] == base["completed"] == n
    assert slow["ttft_p50_s"] - base["ttft_p50_s"] == pytest.approx(hops * hop, abs=2e-3)
    assert slow["itl_p99_s"] == pytest.approx(base["itl_p99_s"], rel=0.05)  # hops are not inter-token gaps
    sim = run(policy, trace, f, efficiencies=plain)
    first = np.asarray(sim.reqs.t_first) - np.asarray(sim.reqs.arrival)
    if policy == "static":  # the hand-off (KV pull, one decode step) comes after the prefill's token
        assert base["ttft_p50_s"] > float(np.median(first))
    else:
        assert base["ttft_p50_s"] == pytest.approx(float(np.median(first)), abs=1e-4)


def test_the_generation_counter_counts_tokens_as_they_are_made_not_when_a_request_ends(monkeypatch) -> None:
    """The autoscaler learns decode throughput from this counter's rate; counting at completion made it lag."""
    from pdfleet_operator.sim import metrics_source

    seen: dict[int, float] = {}
    ahead = []
    original = metrics_source.SimulatedMetricsSource.scrape

    def scrape(self, now: float) -> None:  # noqa: ANN001
        for reps in self.replicas().values():
            for r in reps:
                value = r.generated(now)
                assert value >= seen.get(id(r), 0.0) - 1e-6, "a counter never goes down"
                assert value >= r.gen_tokens - 1e-9
                seen[id(r)] = value
                ahead.append(value - r.gen_tokens)
        original(self, now)

    monkeypatch.setattr(metrics_source.SimulatedMetricsSource, "scrape", scrape)
    sim = run("dynamic", surge(duration=600.0, low=2.0, high=25.0))
    assert max(ahead) > 100, "running sequences' tokens show before they finish"
    for r in sim.all_replicas:
        assert r.generated(sim.end) == pytest.approx(r.gen_tokens)  # all finished: the two agree
