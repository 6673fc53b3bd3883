"""Metric contract with the operator, and a real Prometheus scraping workers and router: every name the autoscaler,
alerts and dashboards read comes back through PromQL with the values that were served."""

from __future__ import annotations

import concurrent.futures
import random
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdfleet_operator.decide import metric_names as names
from pdfleet_worker import metrics as m
from tests.worker.kv_transfer.test_kv_transfer import BLOCK, BYTES_PER_BLOCK
from tests.worker.processes import MODEL, pool_whole, wait_until

RULES = Path(__file__).resolve().parents[3] / "dashboards" / "rules" / "pdfleet.rules.yaml"
# The operator's metric_names documents each type in a comment; this is that table.
OPERATOR_TYPES = {
    names.NUM_REQUESTS_WAITING: "gauge",
    names.NUM_REQUESTS_RUNNING: "gauge",
    names.KV_CACHE_USAGE: "gauge",
    names.PROMPT_TOKENS_TOTAL: "counter",
    names.GENERATION_TOKENS_TOTAL: "counter",
    names.NUM_PREEMPTIONS_TOTAL: "counter",
    names.REQUEST_SUCCESS_TOTAL: "counter",
    names.TIME_TO_FIRST_TOKEN: "histogram",
    names.INTER_TOKEN_LATENCY: "histogram",
    names.E2E_REQUEST_LATENCY: "histogram",
    names.PROMPT_TOKENS_WAITING: "gauge",
    names.ROUTER_REQUESTS_TOTAL: "counter",
}
TARGET_LABELS = (names.LABEL_DEPLOYMENT, names.LABEL_ROLE, names.LABEL_ACCELERATOR, names.LABEL_NAMESPACE)
DEPLOYMENT, NAMESPACE = "demo", "serving"
ROLE_OF = {"prefill": "prefill", "decode": "decode", "colo": "colocated"}  # operator role per worker


def exposed(text: str) -> dict[str, tuple[str, set[str], set[str]]]:
    """Exposed name (counters with _total) -> (type, sample names, label names)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        labels = set().union(*(s.labels for s in fam.samples)) if fam.samples else set()
        out[name] = (fam.type, {s.name for s in fam.samples}, labels)
    return out


def test_every_metric_the_operator_queries_is_exported_with_its_type(pipeline):
    assert set(names.WORKER_METRICS) | {names.ROUTER_REQUESTS_TOTAL, names.PROMPT_TOKENS_WAITING} == set(OPERATOR_TYPES)
    for name, kind in OPERATOR_TYPES.items():
        spec = m.ALL_METRICS.get(name)
        assert spec is not None, f"{name} is queried by the operator but not defined in pdfleet_worker.metrics"
        assert spec.type == kind, f"{name}: the operator expects a {kind}, the worker defines a {spec.type}"
    assert names.LABEL_MODEL == m.LABEL_MODEL
    for proc in pipeline.workers:
        resp = httpx.get(f"{proc.url}/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        assert resp.headers["content-type"].startswith("text/plain; version=0.0.4"), (
            "classic format, whatever Accept says"
        )
        text = resp.text
        assert "vllm:num_requests_waiting{" in text, "`:` must not be escaped"
        got = exposed(text)
        for name in names.WORKER_METRICS + (names.PROMPT_TOKENS_WAITING,):
            assert name in got, f"{proc.name} does not export {name}"
            kind, samples, labels = got[name]
            assert kind == OPERATOR_TYPES[name], f"{proc.name}: {name} is a {kind}"
            assert names.LABEL_MODEL in labels and m.LABEL_ROLE in labels and m.LABEL_ACCELERATOR in labels
            if kind == "histogram":
                assert {name + "_bucket", name + "_sum", name + "_count"} <= samples
        for spec in m.WORKER_METRICS:
            assert spec.name in got and got[spec.name][0] == spec.type, f"{proc.name}: {spec.name} missing or mistyped"
        # Nothing the worker sets collides with the target labels the scrape config adds.
        assert not any(set(TARGET_LABELS) & labels for _, _, labels in got.values())
    got = exposed(httpx.get(f"{pipeline.router.url}/metrics").text)
    for spec in m.ROUTER_METRICS:
        assert spec.name in got and got[spec.name][0] == spec.type, f"router: {spec.name} missing or mistyped"
    assert {names.LABEL_CODE, names.LABEL_TIER} <= got[names.ROUTER_REQUESTS_TOTAL][2]
    assert not any(set(TARGET_LABELS) & labels for _, _, labels in got.values())


def scrape_config(pipeline) -> list[dict]:
    def target(proc, role: str | None) -> dict:
        labels = {names.LABEL_DEPLOYMENT: DEPLOYMENT, names.LABEL_NAMESPACE: NAMESPACE}
        if role is not None:
            labels.update({names.LABEL_ROLE: role, names.LABEL_ACCELERATOR: "cpu"})
        return {"targets": [f"127.0.0.1:{proc.port}"], "labels": labels}

    return [
        {
            "job_name": "pdfleet-workers",
            "static_configs": [target(getattr(pipeline, k), r) for k, r in ROLE_OF.items()],
        },
        {"job_name": "pdfleet-router", "static_configs": [target(pipeline.router, None)]},
    ]


def test_prometheus_reads_back_what_was_served(pipeline, prometheus_factory):
    prom = prometheus_factory(extra_scrape_configs=scrape_config(pipeline), rule_files=[RULES], interval="1s")
    prom.wait_for("up == 1", lambda r: len(r) == 4)

    def value(promql: str) -> float | None:
        result = prom.query(promql)
        assert len(result) <= 1, f"{promql}: {result}"
        return float(result[0]["value"][1]) if result else None

    def sel(role: str) -> str:
        return (
            f'{names.LABEL_NAMESPACE}="{NAMESPACE}",{names.LABEL_DEPLOYMENT}="{DEPLOYMENT}",{names.LABEL_ROLE}="{role}"'
        )

    def direct(proc, name: str, **labels: str) -> float:
        return sum(
            s.value
            for fam in text_string_to_metric_families(proc.metrics_text())
            for s in fam.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    p, d, colo, r = pipeline.prefill, pipeline.decode, pipeline.colo, pipeline.router
    watched = {  # (process, operator role or None, exposed sample name, extra labels)
        "gen_decode": (d, "decode", names.GENERATION_TOKENS_TOTAL, {}),
        "gen_prefill": (p, "prefill", names.GENERATION_TOKENS_TOTAL, {}),
        "prompt_prefill": (p, "prefill", names.PROMPT_TOKENS_TOTAL, {}),
        "prompt_decode": (d, "decode", names.PROMPT_TOKENS_TOTAL, {}),
        "length_decode": (d, "decode", names.REQUEST_SUCCESS_TOTAL, {"finished_reason": "length"}),
        "ttft_decode": (d, "decode", names.TIME_TO_FIRST_TOKEN + "_count", {}),
        "itl_decode": (d, "decode", names.INTER_TOKEN_LATENCY + "_count", {}),
        "e2e_decode": (d, "decode", names.E2E_REQUEST_LATENCY + "_count", {}),
        "gen_colo": (colo, "colocated", names.GENERATION_TOKENS_TOTAL, {}),
        "kv_sent": (p, "prefill", m.KV_TRANSFER_BYTES_TOTAL.name, {"direction": "sent"}),
        "router_ok": (r, None, names.ROUTER_REQUESTS_TOTAL, {"code": "200", "tier": "default"}),
        "router_colo": (r, None, names.ROUTER_REQUESTS_TOTAL, {"code": "200", "tier": "colo"}),
    }

    def promql(key: str) -> str:
        proc, role, name, labels = watched[key]
        matchers = [f'{names.LABEL_NAMESPACE}="{NAMESPACE}"', f'{names.LABEL_DEPLOYMENT}="{DEPLOYMENT}"']
        if role is not None:
            matchers.append(f'{names.LABEL_ROLE}="{role}"')
        matchers += [f'{k}="{v}"' for k, v in labels.items()]
        return f"sum({name}{{{','.join(matchers)}}})"

    def settled() -> dict[str, float]:
        """Prometheus and the processes agree on every watched value (a scrape after the last change)."""
        want = {k: direct(proc, name, **labels) for k, (proc, _, name, labels) in watched.items()}
        wait_until(
            lambda: all(value(promql(k)) == v for k, v in want.items()),
            timeout=20,
            what="Prometheus catching up with the workers",
        )
        return want

    base = settled()
    rng = random.Random(99)
    lengths, max_tokens = [23, 41, 64], 7
    for n in lengths:
        prompt = [rng.randrange(4, 4096) for _ in range(n)]
        resp = httpx.post(
            f"{r.url}/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
            timeout=30,
        )
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == max_tokens
    for _ in range(2):
        resp = httpx.post(
            f"{r.url}/v1/completions",
            json={"model": "tiny-colo", "prompt": "hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True},
            timeout=30,
        )
        assert resp.status_code == 200
    wait_until(lambda: pool_whole(p) and pool_whole(d), what="acks")
    after = settled()
    served = {
        "gen_decode": 3 * max_tokens,
        "gen_prefill": 3,  # the prefill worker samples one token, then hands over
        "prompt_prefill": sum(lengths),
        "prompt_decode": 3,  # the decode worker computes the last prompt token
        "length_decode": 3,
        "ttft_decode": 3,
        "itl_decode": 3 * (max_tokens - 1),
        "e2e_decode": 3,
        "gen_colo": 10,
        "kv_sent": sum(-(-(n - 1) // BLOCK) for n in lengths) * BYTES_PER_BLOCK,
        "router_ok": 3,
        "router_colo": 2,
    }
    assert {k: after[k] - base[k] for k in served} == served

    # Gauges while a request runs, and after. The request is sustained (each stream that ends is replaced)
    # until a scrape has seen both: one 1,800-token stream can end between two 1 s scrapes on a fast machine.
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1800, "temperature": 0, "ignore_eos": True, "stream": True}
    stop = threading.Event()

    def sustain() -> tuple[int, int]:
        """(streams served whole, streams left when told to stop); each one checked."""
        whole = left = 0
        while not stop.is_set():
            with httpx.stream("POST", f"{colo.url}/v1/completions", json=body, timeout=60) as resp:
                assert resp.status_code == 200, resp.read()
                events = []
                for line in resp.iter_lines():
                    if stop.is_set():
                        break
                    if line:
                        events.append(line)
            if stop.is_set():
                left += 1
                continue
            assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2], events[-3:]
            whole += 1
        return whole, left

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(sustain)
        try:
            prom.wait_for(f"{names.NUM_REQUESTS_RUNNING}{{{sel('colocated')}}} == 1")
            prom.wait_for(f"{names.KV_CACHE_USAGE}{{{sel('colocated')}}} > 0")
        finally:
            stop.set()
        whole, left = running.result(timeout=120)
    print(f"gauges seen during stream {whole + left}: {whole} served whole before it, {left} left unfinished")
    prom.wait_for(f"{names.NUM_REQUESTS_RUNNING}{{{sel('colocated')}}} == 0")
    for role in ("prefill", "decode", "colocated"):
        for name in (names.NUM_REQUESTS_WAITING, names.PROMPT_TOKENS_WAITING, names.NUM_PREEMPTIONS_TOTAL):
            assert value(f"{name}{{{sel(role)}}}") == 0.0, (name, role)
        assert value(f"{names.KV_CACHE_USAGE}{{{sel(role)}}}") == 0.0 or role == "colocated"
    prom.wait_for(f"{names.KV_CACHE_USAGE}{{{sel('colocated')}}} == 0")

    # The autoscaler's own queries (operator/pdfleet_operator/decide/metric_names.py) answer one series per role.
    for field, query in names.PROFILES["pdfleet"].queries(DEPLOYMENT, NAMESPACE).items():
        result = prom.query(query)
        roles = {s["metric"].get(names.LABEL_ROLE) for s in result}
        assert roles == {"prefill", "decode", "colocated"}, (field, query, result)
        if field == "replicas":
            assert all(float(s["value"][1]) == 1 for s in result)
        if field in ("waiting", "running", "kv_usage", "prompt_tokens_waiting"):
            assert all(float(s["value"][1]) == 0 for s in result), (field, result)
    # The generated alerting/recording rules evaluate over these series.
    for record in ("pdfleet:router_5xx_ratio:1m", "pdfleet:ttft_p99:5m", "pdfleet:itl_p99:5m"):
        result = prom.wait_for(f'{record}{{pdfleet_deployment="{DEPLOYMENT}",namespace="{NAMESPACE}"}}', timeout=20)
        assert len(result) == 1, (record, result)
    ratio = float(prom.query(f'pdfleet:router_5xx_ratio:1m{{pdfleet_deployment="{DEPLOYMENT}"}}')[0]["value"][1])
    assert ratio == 0.0


@pytest.mark.parametrize("spec", m.WORKER_METRICS + m.ROUTER_METRICS, ids=lambda s: s.name)
def test_metric_specs_are_well_formed(spec):
    assert spec.name.startswith(("vllm:", "pdfleet_")) and spec.help.endswith((".", ")"))
    if spec.name.startswith("vllm:"):
        assert spec.labels[:3] == m.WORKER_LABELS
