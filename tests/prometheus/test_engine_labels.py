"""One label vocabulary for both engines, checked against their real /metrics: a pdfleet worker and a vLLM CPU server
(`make vllm`) as two pools of one colocated role, read by the direct-scrape source and by a real Prometheus with the
same target labels; each class of the role is seen, with exact token rates from the scrape source."""

from __future__ import annotations

import re

import httpx
import pytest

from pdfleet_operator.decide import metric_names as names
from pdfleet_operator.prometheus import PrometheusSource, ScrapeSource, ScrapeTarget
from tests.prometheus.test_sources import until
from tests.support.vllm import VllmServer
from tests.worker.processes import CHILD_ENV, MODEL, PDFLEET, worker

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

NS, DEPLOYMENT, ROLE = "default", "mixed", "colocated"
CLASSES = {"pdfleet": "cpu", "vllm": "cpu-vllm"}  # one pool per engine, each on its own class


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    import os
    import subprocess

    path = tmp_path_factory.mktemp("models") / MODEL
    subprocess.run(
        PDFLEET + ["model", "init", str(path), "--preset", "tiny"],
        check=True,
        capture_output=True,
        env=dict(os.environ, **CHILD_ENV),
        timeout=300,
    )
    return str(path)


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    """{engine: base URL}: a real pdfleet worker (told its class as `pdfleet up` tells it) and a real vLLM server."""
    logdir = tmp_path_factory.mktemp("engine-logs")
    vllm = VllmServer(model_dir, logdir, MODEL)
    pdfleet = worker(logdir, model_dir, "both", "--accelerator", CLASSES["pdfleet"]).start()
    try:
        vllm.start()
        pdfleet.wait_ready()
        yield {"pdfleet": pdfleet.url, "vllm": vllm.url}
    finally:
        pdfleet.stop()
        vllm.stop()


def targets(urls: dict[str, str]) -> list[ScrapeTarget]:
    return [
        ScrapeTarget(f"{url}/metrics", names.target_labels(NS, DEPLOYMENT, ROLE, CLASSES[engine]), engine)
        for engine, url in urls.items()
    ]


def generate(urls: dict[str, str]) -> dict[str, tuple[int, int]]:
    """Two greedy completions on each engine; engine -> (prompt tokens, generated tokens) as its usage says."""
    out = {}
    for engine, url in urls.items():
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=60)
        used = [
            client.completions.create(
                model=MODEL,
                prompt=f"{engine} prompt number {i}",
                max_tokens=7 + i,
                temperature=0,
                extra_body={"ignore_eos": True},
            ).usage
            for i in range(2)
        ]
        out[engine] = (sum(u.prompt_tokens for u in used), sum(u.completion_tokens for u in used))
    return out


def test_the_engines_own_labels_are_not_the_vocabulary(engines):
    """Why target labels: vLLM's series carry engine and model_name only; the pdfleet worker's its own role and
    accelerator (named so, not pdfleet_accelerator: the direct-scrape source that looked for that label never
    found a class)."""
    series = {}
    for engine, url in engines.items():
        text = httpx.get(f"{url}/metrics", timeout=10).text
        m = re.search(rf"^{re.escape(names.NUM_REQUESTS_WAITING)}\{{([^}}]*)\}}", text, re.MULTILINE)
        assert m, f"{engine} exports no {names.NUM_REQUESTS_WAITING}"
        series[engine] = {kv.split("=")[0] for kv in m.group(1).split(",")}
    assert series["vllm"] == {"engine", "model_name"}
    assert series["pdfleet"] == {"model_name", "role", "accelerator"}
    assert not any(label.startswith("pdfleet_") for labels in series.values() for label in labels)


def test_the_scrape_source_splits_a_mixed_role_by_class_with_exact_rates(engines):
    clock = iter([1000.0, 1010.0, 1020.0])
    source = ScrapeSource(targets(engines), clock=lambda: next(clock), timeout=10.0)
    first = source.snapshot(DEPLOYMENT, NS, [ROLE])
    assert first.ok, first.error
    r = first.roles[ROLE]
    assert (r.waiting, r.running, r.replicas_reporting) == (0, 0, 2)
    assert r.kv_usage is not None, "both engines export vllm:kv_cache_usage_perc"
    assert r.prompt_tokens_waiting is None, "vLLM has no prompt-tokens-waiting gauge: the role's sum is unknown"
    assert {c: m.replicas_reporting for c, m in r.classes.items()} == {"cpu": 1, "cpu-vllm": 1}

    used = generate(engines)
    second = source.snapshot(DEPLOYMENT, NS, [ROLE])
    assert second.ok, second.error
    by_class = {c: (m.prompt_tokens_rate, m.generation_tokens_rate) for c, m in second.roles[ROLE].classes.items()}
    assert by_class == {CLASSES[e]: (p / 10.0, g / 10.0) for e, (p, g) in used.items()}, (by_class, used)
    total = second.roles[ROLE].generation_tokens_rate
    assert total == pytest.approx(sum(g for _, g in used.values()) / 10.0)
    assert source.snapshot("other", NS, [ROLE]).error == f"no /metrics targets for role {ROLE} of {NS}/other"


def test_prometheus_with_the_same_target_labels_reads_the_same_role(engines, prometheus_factory):
    config = {
        "job_name": "pdfleet-workers",
        "scrape_interval": "1s",
        "static_configs": [
            {"targets": [t.url.removeprefix("http://").removesuffix("/metrics")], "labels": dict(t.labels)}
            for t in targets(engines)
        ],
    }
    prom = prometheus_factory(extra_scrape_configs=[config])
    prom.wait_for('count(up{job="pdfleet-workers"} == 1) == 2', timeout=30)
    source = PrometheusSource(prom.url)
    snap = until(
        lambda: (s := source.snapshot(DEPLOYMENT, NS, [ROLE], engines={ROLE: ["pdfleet", "vllm"]})).ok and s,
        what="ok snapshot",
    )
    r = snap.roles[ROLE]
    assert (r.waiting, r.running, r.replicas_reporting) == (0, 0, 2)
    assert r.kv_usage is not None and r.prompt_tokens_waiting is None
    assert {c: m.replicas_reporting for c, m in r.classes.items()} == {"cpu": 1, "cpu-vllm": 1}
    scraped = ScrapeSource(targets(engines), timeout=10.0).snapshot(DEPLOYMENT, NS, [ROLE]).roles[ROLE]
    assert (scraped.waiting, scraped.running, scraped.replicas_reporting, set(scraped.classes)) == (
        r.waiting,
        r.running,
        r.replicas_reporting,
        set(r.classes),
    )
