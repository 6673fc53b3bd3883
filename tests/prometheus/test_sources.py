"""PrometheusSource against a real Prometheus scraping fake workers, and ScrapeSource against the same workers."""

from __future__ import annotations

import time

import httpx
import pytest

from pdfleet_operator.decide import autoscaler
from pdfleet_operator.decide import metric_names as names
from pdfleet_operator.kube.operator_metrics import OperatorMetrics, serve
from pdfleet_operator.prometheus import PrometheusSource, ScrapeSource, ScrapeTarget
from tests.decide.autoscaler_sim import spec
from tests.prometheus.exporters import WorkerExporter, scrape_config
from tests.support.components import free_port

ROLES = ("prefill", "decode")


@pytest.fixture
def fleet():
    """Replicas of deployment default/demo (1 prefill, 2 decode) and one of another deployment."""
    workers = {
        "prefill": WorkerExporter("demo", "prefill"),
        "decode-a": WorkerExporter("demo", "decode", accelerator="h200"),
        "decode-b": WorkerExporter("demo", "decode", accelerator="ascend-910b-x2"),
        "other": WorkerExporter("other", "prefill"),
    }
    yield workers
    for w in workers.values():
        w.stop()


def play_demo(fleet, prefill_waiting=7.0, prompt_tokens=9000.0):
    fleet["prefill"].play(waiting=prefill_waiting, running=2, kv=0.25, prompt_tokens_waiting=prompt_tokens)
    fleet["decode-a"].play(waiting=1, running=10, kv=0.5)
    fleet["decode-b"].play(waiting=2, running=6, kv=0.7)
    fleet["other"].play(waiting=500, running=500, kv=1.0, prompt_tokens_waiting=1e6)


def until(predicate, timeout=15.0, what="condition"):
    """Poll predicate() until it returns a truthy value; that value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"{what} not reached within {timeout}s")


def ready_prometheus(prometheus_factory, fleet):
    prom = prometheus_factory(extra_scrape_configs=[scrape_config(list(fleet.values()))])
    prom.wait_for(f'count(up{{job="pdfleet-workers"}} == 1) == {len(fleet)}')
    return prom


def test_prometheus_source_reads_back_what_the_workers_play(prometheus_factory, fleet):
    play_demo(fleet)
    prom = ready_prometheus(prometheus_factory, fleet)
    source = PrometheusSource(prom.url)
    snap = until(lambda: (s := source.snapshot("demo", "default", ROLES)).ok and s, what="ok snapshot")
    p, d = snap.roles["prefill"], snap.roles["decode"]
    assert (p.waiting, p.running, p.replicas_reporting, p.prompt_tokens_waiting, p.kv_usage) == (7, 2, 1, 9000, 0.25)
    assert (d.waiting, d.running, d.replicas_reporting) == (3, 16, 2)  # summed over the two decode replicas
    assert d.kv_usage == pytest.approx(0.6)
    # decode split by the replicas' AcceleratorClass; prefill's replica has no class label: no breakdown
    assert {c: (m.replicas_reporting, m.waiting) for c, m in d.classes.items()} == {
        "h200": (1, 1),
        "ascend-910b-x2": (1, 2),
    }
    assert p.classes == {}
    assert abs(p.sample_time - time.time()) < 10
    assert "prometheus" in snap.source

    # the workers play the next numbers of the script; one scrape later the source reads them
    for waiting in (12.0, 0.0, 31.0):
        fleet["prefill"].play(waiting=waiting, running=2, kv=0.25, prompt_tokens_waiting=waiting * 1000)
        snap = until(
            lambda: (s := source.snapshot("demo", "default", ROLES)).ok and s.roles["prefill"].waiting == waiting and s,
            what=f"prefill waiting {waiting}",
        )
        assert snap.roles["prefill"].prompt_tokens_waiting == waiting * 1000
        assert snap.roles["decode"].running == 16  # never the other deployment's 500


def test_vllm_profile_reads_the_same_queues_without_prompt_tokens(prometheus_factory, fleet):
    play_demo(fleet)
    prom = ready_prometheus(prometheus_factory, fleet)
    source = PrometheusSource(prom.url, profile="vllm")
    snap = until(lambda: (s := source.snapshot("demo", "default", ROLES)).ok and s, what="ok snapshot")
    assert (snap.roles["prefill"].waiting, snap.roles["decode"].running) == (7, 16)
    assert snap.roles["prefill"].prompt_tokens_waiting is None
    assert snap.roles["decode"].kv_usage == pytest.approx(0.6)


def test_prometheus_down_is_unavailable_and_recovers(prometheus_factory, fleet):
    play_demo(fleet)
    prom = ready_prometheus(prometheus_factory, fleet)
    source = PrometheusSource(prom.url, timeout=2.0)
    until(lambda: source.snapshot("demo", "default", ROLES).ok, what="ok snapshot")

    prom.stop()
    started = time.monotonic()
    snap = source.snapshot("demo", "default", ROLES)
    assert time.monotonic() - started < 5, "an outage must answer within the interval"
    assert not snap.ok and snap.roles == {} and "Connection" in snap.error
    s = spec()
    decisions, _ = autoscaler.decide(
        s, autoscaler.ScalerState.initial(s, {"prefill": 2, "decode": 3}), snap, time.time(), {}
    )
    assert {(d.desired, d.reason) for d in decisions.values()} == {
        (2, autoscaler.METRICS_UNAVAILABLE),
        (3, autoscaler.METRICS_UNAVAILABLE),
    }

    prom.restart()
    snap = until(lambda: (s := source.snapshot("demo", "default", ROLES)).ok and s, what="recovery")
    assert snap.roles["prefill"].waiting == 7


def test_a_role_without_series_or_with_nan_is_unavailable(prometheus_factory, fleet):
    play_demo(fleet)
    prom = ready_prometheus(prometheus_factory, fleet)
    source = PrometheusSource(prom.url)
    until(lambda: source.snapshot("demo", "default", ROLES).ok, what="ok snapshot")
    assert not (snap := source.snapshot("nope", "default", ROLES)).ok and "no series for role prefill" in snap.error

    fleet["prefill"].play(waiting=float("nan"))
    snap = until(lambda: (s := source.snapshot("demo", "default", ROLES)).error and s, what="NaN seen")
    assert not snap.ok and "nan" in snap.error.lower()
    fleet["prefill"].play(waiting=3)

    # every decode replica gone: Prometheus marks their series stale, the role has no queue to read
    fleet["decode-a"].stop()
    fleet["decode-b"].stop()
    snap = until(
        lambda: (s := source.snapshot("demo", "default", ROLES)).error and "decode" in s.error and s,
        what="decode missing",
    )
    assert "no series for role decode" in snap.error


def test_decisions_follow_the_queues_through_prometheus(prometheus_factory, fleet):
    """Workers play a prefill surge; decide() on real snapshots scales prefill (and decode ahead of it)."""
    play_demo(fleet, prefill_waiting=4, prompt_tokens=100)
    prom = ready_prometheus(prometheus_factory, fleet)
    source = PrometheusSource(prom.url)
    s = spec()
    state = autoscaler.ScalerState.initial(s, {"prefill": 1, "decode": 1})
    snap = until(lambda: (x := source.snapshot("demo", "default", ROLES)).ok and x, what="ok snapshot")
    decisions, state = autoscaler.decide(s, state, snap, time.time(), {})
    assert decisions["prefill"].direction == "hold"

    fleet["prefill"].play(waiting=40, running=2, prompt_tokens_waiting=40_000)
    snap = until(
        lambda: (x := source.snapshot("demo", "default", ROLES)).ok and x.roles["prefill"].waiting == 40 and x,
        what="surge visible",
    )
    decisions, state = autoscaler.decide(s, state, snap, time.time(), {})
    assert (decisions["prefill"].direction, decisions["prefill"].desired) == ("up", 5)
    assert decisions["decode"].reason == autoscaler.PREFILL_BACKLOG

    metrics = OperatorMetrics()
    metrics.record("default", "demo", decisions)
    server = serve(metrics, free_port(), host="127.0.0.1")
    try:
        text = httpx.get(
            f"http://127.0.0.1:{server.server_address[1]}/metrics",
            headers={"Accept": "application/openmetrics-text; version=1.0.0"},
        ).text
    finally:
        server.shutdown()
    assert f'{names.DESIRED_REPLICAS}{{deployment="demo",namespace="default",role="prefill"}} 5.0' in text
    reason = decisions["prefill"].reason
    assert reason in (autoscaler.QUEUE_ABOVE_TARGET, autoscaler.QUEUE_GROWING)
    assert f'{names.SCALING_DECISIONS_TOTAL}{{direction="up",reason="{reason}",role="prefill"}} 1.0' in text
    assert f'{names.PD_RATIO}{{deployment="demo",namespace="default"}}' in text


def test_scrape_source_reads_the_workers_directly(fleet):
    play_demo(fleet)
    targets = [w.scrape_target() for w in fleet.values()]  # the other deployment's replica is left out by its labels
    clock = iter([1000.0, 1010.0, 1020.0])
    source = ScrapeSource(targets, clock=lambda: next(clock))
    snap = source.snapshot("demo", "default", ROLES)
    assert snap.ok, snap.error
    p, d = snap.roles["prefill"], snap.roles["decode"]
    assert (p.waiting, p.running, p.prompt_tokens_waiting, p.kv_usage, p.sample_time) == (7, 2, 9000, 0.25, 1000.0)
    assert (d.waiting, d.running, d.replicas_reporting) == (3, 16, 2)
    assert d.kv_usage == pytest.approx(0.6)
    assert p.prompt_tokens_rate is None  # no previous scrape to difference against

    fleet["prefill"].prompt_tokens.inc(5000)
    fleet["decode-a"].generation_tokens.inc(300)
    fleet["decode-b"].generation_tokens.inc(100)
    snap = source.snapshot("demo", "default", ROLES)
    assert snap.roles["prefill"].prompt_tokens_rate == 500.0  # 5000 tokens over 10 s
    assert snap.roles["decode"].generation_tokens_rate == 40.0
    classes = snap.roles["decode"].classes  # the targets' pdfleet_accelerator label splits decode by class
    assert {c: (m.replicas_reporting, m.waiting, m.generation_tokens_rate) for c, m in classes.items()} == {
        "h200": (1, 1, 30.0),
        "ascend-910b-x2": (1, 2, 10.0),
    }
    assert snap.roles["prefill"].classes == {}

    fleet["decode-b"].play(waiting=float("nan"))
    snap = source.snapshot("demo", "default", ROLES)
    assert not snap.ok and "nan" in snap.error.lower()


def test_scrape_source_reads_each_target_with_its_engines_series(fleet):
    """A vLLM replica exports no prompt-tokens-waiting gauge: its role's sum is unknown, not the pdfleet part."""
    play_demo(fleet)
    vllm = WorkerExporter("demo", "prefill", accelerator="h200", prompt_tokens_gauge=False)
    try:
        vllm.play(waiting=5, running=1, kv=0.75)
        both = [fleet["prefill"].scrape_target(), vllm.scrape_target("vllm")]
        snap = ScrapeSource(both).snapshot("demo", "default", ["prefill"])
        p = snap.roles["prefill"]
        assert (p.waiting, p.running, p.replicas_reporting, p.prompt_tokens_waiting) == (12, 3, 2, None)
        assert p.kv_usage == pytest.approx(0.5)
        assert p.classes == {}, "the pdfleet replica has no class label: no breakdown"
        alone = ScrapeSource([fleet["prefill"].scrape_target()]).snapshot("demo", "default", ["prefill"])
        assert alone.roles["prefill"].prompt_tokens_waiting == 9000
        with pytest.raises(ValueError, match="unknown engine 'tgi'"):
            ScrapeTarget(vllm.url, {}, "tgi")
    finally:
        vllm.stop()


def test_scrape_source_with_a_replica_down_is_unavailable(fleet):
    play_demo(fleet)
    fleet["decode-b"].stop()
    source = ScrapeSource(
        lambda deployment, namespace: [fleet[w].scrape_target() for w in ("prefill", "decode-a", "decode-b")],
        timeout=1.0,
    )
    snap = source.snapshot("demo", "default", ROLES)
    assert not snap.ok and fleet["decode-b"].address in snap.error
    assert not (snap := ScrapeSource([fleet["prefill"].scrape_target()]).snapshot("demo", "default", ROLES)).ok
    assert "no /metrics targets for role decode" in snap.error


def test_prometheus_source_reads_each_role_with_its_pools_profile(prometheus_factory, fleet):
    """engines= per role: a role mixing engines drops what one engine lacks; one named once uses its profile."""
    play_demo(fleet)
    prom = ready_prometheus(prometheus_factory, fleet)
    source = PrometheusSource(prom.url)
    snap = until(
        lambda: (
            (
                s := source.snapshot(
                    "demo", "default", ROLES, engines={"prefill": ["pdfleet", "vllm"], "decode": ["vllm"]}
                )
            ).ok
            and s
        ),
        what="ok snapshot",
    )
    p, d = snap.roles["prefill"], snap.roles["decode"]
    assert (p.waiting, p.running, p.kv_usage, p.prompt_tokens_waiting) == (7, 2, 0.25, None)
    assert (d.waiting, d.running) == (3, 16) and d.kv_usage == pytest.approx(0.6)
    assert set(d.classes) == {"h200", "ascend-910b-x2"}
    plain = source.snapshot("demo", "default", ROLES)
    assert plain.roles["prefill"].prompt_tokens_waiting == 9000, "without engines=: the source's own profile"


def test_prometheus_for_reuses_one_source_per_url_and_rejects_unknown_profiles():
    from pdfleet_operator.prometheus import prometheus_for

    assert prometheus_for("http://prom:9090/") is prometheus_for("http://prom:9090")
    assert prometheus_for("http://prom:9090", "vllm").profile.name == "vllm"
    with pytest.raises(ValueError, match="unknown metrics profile"):
        PrometheusSource("http://prom:9090", profile="tgi")


def test_every_profile_query_parses_with_promtool(tmp_path):
    import subprocess

    import yaml

    from tests.support.components import binary

    rules = [
        {"record": f"pdfleet:test_{profile}_{field}", "expr": promql}
        for profile, p in [*names.PROFILES.items(), ("mixed", names.profile_for(names.PROFILES))]
        for field, promql in p.queries("demo", 'odd"ns\\').items()
    ]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "autoscaler", "rules": rules}]}))
    out = subprocess.run([binary("promtool"), "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(rules)} rules found" in out.stdout
