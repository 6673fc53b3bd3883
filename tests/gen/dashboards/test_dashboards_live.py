"""Every dashboard query returns data from a real Prometheus scraping a real router, prefill and decode worker and the
operator under a short load; the $ per 1M tokens panels equal the number computed by hand from the served tokens and
the class prices the chart installed.

The fleet: `pdfleet model init` (tiny), `pdfleet worker --role prefill|decode` and `pdfleet router`, one torch thread
each; the operator exactly as the chart describes it (tests/gen/chart/operator_process.py), pointed at the test's
Prometheus through the chart's `operator.prometheusUrl`, against the API emulator with the chart installed and
examples/local-tiny.yaml applied: its pool $/h comes from the chart's AcceleratorClasses, its autoscaler decides
from the live queues (pdfleet_desired_replicas, pdfleet_pd_ratio, pdfleet_scaling_decisions_total). Workers are
scraped with the target labels the chart's PodMonitor relabelings produce from the pod labels `render` gives the
local-tiny pods.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import yaml

from pdfleet_operator.api import InferenceDeployment
from pdfleet_operator.decide import inventory, placement
from pdfleet_operator.decide import metric_names as names
from pdfleet_operator.gen import dashboards
from pdfleet_operator.kube import render
from tests.gen.chart import helm
from tests.gen.chart.operator_process import OperatorProcess, free_ports
from tests.gen.dashboards import grafana
from tests.kube import harness
from tests.kube.cluster import EXAMPLES, classes, node, pod, standard_nodes
from tests.support.components import free_port

CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
NAMESPACE, NAME = "default", "local-tiny"
PDFLEET = [sys.executable, "-m", "pdfleet_operator.cli"]
REQUESTS, CONCURRENCY, MAX_TOKENS = 16, 4, 16


class Child:
    """A `pdfleet worker`/`pdfleet router` process on a free loopback port, stopped by PID."""

    def __init__(self, name: str, args: list[str], logdir) -> None:
        self.name, self.port = name, free_port()
        self.log_path = logdir / f"{name}.log"
        self.proc = subprocess.Popen(
            PDFLEET + args + ["--host", "127.0.0.1", "--port", str(self.port)],
            env={**os.environ, **CHILD_ENV},
            stdout=open(self.log_path, "wb"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready: {self.log_path.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def relabel(meta: dict[str, str], relabelings: list[dict[str, Any]]) -> dict[str, str]:
    """Prometheus' `replace` relabeling (default regex `(.*)`, replacement `$1`) over discovered meta labels."""
    labels = dict(meta)
    for rule in relabelings:
        assert rule.get("action", "replace") == "replace" and "regex" not in rule, rule
        value = rule.get("separator", ";").join(labels.get(s, "") for s in rule["sourceLabels"])
        labels[rule["targetLabel"]] = value
    return {k: v for k, v in labels.items() if not k.startswith("__")}


def scrape_labels(pod_labels: dict[str, str], relabelings: list[dict[str, Any]]) -> dict[str, str]:
    """The target labels the chart's PodMonitor gives a pod with these labels in NAMESPACE."""
    meta = {"__meta_kubernetes_namespace": NAMESPACE}
    meta.update({"__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", k): v for k, v in pod_labels.items()})
    return relabel(meta, relabelings)


def pod_labels_of_local_tiny() -> dict[str, dict[str, str]]:
    """role -> pod template labels of what the operator renders for local-tiny (pools and router)."""
    doc = next(d for d in yaml.safe_load_all((EXAMPLES / "local-tiny.yaml").read_text()) if d)
    spec = InferenceDeployment.model_validate(doc).spec
    plan = placement.plan(spec, classes(), inventory.build(standard_nodes(), []))
    objs = render.render(render.Owner(NAME, NAMESPACE, "uid"), spec, plan, classes(), revision=1)
    return {
        o["metadata"]["labels"][render.LABEL_ROLE]: o["spec"]["template"]["metadata"]["labels"]
        for o in objs
        if o["kind"] == "Deployment"
    }


def query_at(prom: Any, promql: str, at: float | None = None) -> list[dict[str, Any]]:
    params = {"query": promql} if at is None else {"query": promql, "time": f"{at:.3f}"}
    body = httpx.get(f"{prom.url}/api/v1/query", params=params, timeout=10).json()
    assert body["status"] == "success", (promql, body)
    return body["data"]["result"]


def complete(router_url: str, i: int) -> int:
    """One streamed completion through the router; the completion tokens its usage reports."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0, timeout=120)
    usage = None
    stream = client.completions.create(
        model="tiny",
        prompt=f"request {i}: " + "tell me about fleets " * (1 + i % 5),
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and usage.completion_tokens > 0
    return usage.completion_tokens


@pytest.mark.slow
def test_every_panel_has_data_and_cost_per_million_tokens_is_exact(kube, tmp_path, prometheus_factory) -> None:
    children: list[Child] = []
    operator = None
    try:
        # --- the data plane ---
        model = tmp_path / "tiny"
        subprocess.run(
            PDFLEET + ["model", "init", str(model), "--preset", "tiny"],
            check=True,
            capture_output=True,
            env={**os.environ, **CHILD_ENV},
            timeout=300,
        )
        common = [
            "--model",
            str(model),
            "--served-model-name",
            "tiny",
            "--num-kv-blocks",
            "256",
            "--num-threads",
            "1",
            "--log-level",
            "warning",
            "--accelerator",
            "cpu",
        ]
        prefill = Child("prefill", ["worker", "--role", "prefill", *common], tmp_path)
        decode = Child("decode", ["worker", "--role", "decode", *common], tmp_path)
        children += [prefill, decode]
        for c in (prefill, decode):
            c.wait_ready()
        router = Child(
            "router", ["router", "--prefill", prefill.url, "--decode", decode.url, "--log-level", "warning"], tmp_path
        )
        children.append(router)
        router.wait_ready()

        # --- Prometheus: the workers with the PodMonitor's target labels, the operator's port picked ahead ---
        rendered = helm.render({})
        relabelings = helm.the(rendered, "PodMonitor")["spec"]["podMetricsEndpoints"][0]["relabelings"]
        pods = pod_labels_of_local_tiny()
        targets = {"prefill": prefill, "decode": decode, render.ROUTER_ROLE: router}
        worker_job = {
            "job_name": "pdfleet-workers",
            "static_configs": [
                {"targets": [f"127.0.0.1:{child.port}"], "labels": scrape_labels(pods[role], relabelings)}
                for role, child in targets.items()
            ],
        }
        assert worker_job["static_configs"][1]["labels"] == {
            "namespace": NAMESPACE,
            "pdfleet_deployment": NAME,
            "pdfleet_role": "decode",
            "pdfleet_accelerator": "cpu",
            "pdfleet_revision": "1",
        }
        ports = free_ports()
        operator_job = {
            "job_name": "pdfleet-operator",
            "honor_labels": True,  # as the chart's ServiceMonitor
            "static_configs": [{"targets": [f"127.0.0.1:{ports['--metrics-port']}"]}],
        }
        started = time.time()
        prom = prometheus_factory(extra_scrape_configs=[worker_job, operator_job])

        # --- the operator, installed by the chart and pointed at that Prometheus, planning local-tiny on the
        # chart's classes; its autoscaler decides from the live queues (bounded to one replica per role, so the
        # pool $/h stays what the hand computation below assumes) ---
        helm.install(kube, {"monitoring": {"enabled": False}, "operator": {"prometheusUrl": prom.url}}, [])
        cpu = next(o["spec"] for o in helm.by_kind(rendered, "AcceleratorClass") if o["metadata"]["name"] == "cpu")
        doc = yaml.safe_load((EXAMPLES / "local-tiny.yaml").read_text())
        for role in ("prefill", "decode"):
            doc["spec"][role]["maxReplicas"] = 1
        kube.apply(doc)
        # The pools' pods, bound to a node before the operator starts (the workers above play them): the operator
        # bills what runs (bound pods), so the pool $/h is the hand computation's from the first scrape on.
        # NOTE: on a node that exists: pods bound to a vanished node are replaced make-before-break (issue 24), and the
        # autoscaler holds while that move runs (whichever came first decided this test before).
        kube.apply(node("cpu-0", "cpu", 32))
        for role in ("prefill", "decode"):
            kube.apply(pod(f"{NAME}-{role}-0", "cpu-0", {"cpu": "2"}, namespace=NAMESPACE, labels=pods[role]))
        operator = OperatorProcess(
            kube.get("deployments.apps", f"{helm.RELEASE}-operator", helm.NAMESPACE),
            kube.kubeconfig,
            tmp_path / "operator.log",
            ports=ports,
        )
        assert f"--prometheus-url={prom.url}" in operator.args
        operator.start()
        cr = harness.wait_reconciled(kube, NAME)
        # The workers above are the pools' replicas: their Deployments report ready (the autoscaler waits for that).
        harness.mark_ready(kube, NAME)
        planned = {p["role"]: p["desired"] for p in cr["status"]["pools"]}
        assert planned == {"prefill": 1, "decode": 1} and {p["acceleratorClass"] for p in cr["status"]["pools"]} == {
            "cpu"
        }
        prom.wait_for('count(up{job=~"pdfleet-.*"} == 1) == 4', timeout=30)
        prom.wait_for('vllm:generation_tokens_total{pdfleet_role="decode"} == 0', timeout=30)
        # The autoscaler's first tick waits until the status says a pool serves (loops.starting).
        harness.wait_reconciled(
            kube, NAME, timeout=60, check=lambda cr: all(p.get("ready", 0) >= 1 for p in cr["status"]["pools"])
        )
        try:
            prom.wait_for(f'{names.SCALING_DECISIONS_TOTAL}{{direction="hold"}}', timeout=60)
        except AssertionError as exc:
            conditions = (kube.get("infdep", NAME) or {}).get("status", {}).get("conditions", [])
            raise AssertionError(f"{exc}; the CR's conditions: {conditions}") from exc

        # --- a burst through the router ---
        # NOTE: the router creates its per-tier latency histograms on first use; one request first, scraped, so
        # the burst's observations are increases Prometheus can see (the first sample of a series is not one).
        served = complete(router.url, REQUESTS)
        prom.wait_for(f"{dashboards.ROUTER_TTFT}_count", timeout=20)
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            served += sum(pool.map(lambda i: complete(router.url, i), range(REQUESTS)))
        prom.wait_for(f'sum(vllm:generation_tokens_total{{pdfleet_role="decode"}}) == {served}', timeout=20)
        # NOTE: every request counted, whatever its code: the router can count a stream the client closed right
        # after [DONE] as 499 (its code is settled only when the worker's stream ends), which is not this test's.
        prom.wait_for("sum(pdfleet_router_requests_total) == %d" % (REQUESTS + 1), timeout=20)
        time.sleep(3)  # a few more scrapes: counters flat, decisions seen again

        # --- every panel of every dashboard returns data ---
        # NOTE: $__rate_interval covers the whole run: on a loaded machine the burst may end over a minute ago.
        range_s = math.ceil(time.time() - started) + 5
        empty = []
        for uid, model_json in grafana.models().items():
            for title, expr in grafana.exprs(model_json):
                promql = grafana.substitute(
                    expr,
                    namespace=NAMESPACE,
                    deployment=NAME,
                    job="pdfleet-operator",
                    rate_interval=f"{range_s}s",
                    range_s=range_s,
                )
                result = query_at(prom, promql)
                values = [float(s["value"][1]) for s in result]
                if not values or not any(math.isfinite(v) for v in values):
                    empty.append(f"{uid} / {title}: {promql} -> {result}")
        assert empty == [], "panels without data:\n" + "\n".join(empty)

        # --- $ per 1M served tokens, against the hand computation ---
        # At the decode worker's last scrape, over a range that starts before its first one, Prometheus'
        # increase() is exact: the counter starts at 0 (no extrapolation back) and the range ends on a sample.
        at = float(query_at(prom, 'timestamp(vllm:generation_tokens_total{pdfleet_role="decode"})')[0]["value"][1])
        range_s = math.ceil(at - started) + 5
        dollars_per_hour = sum(planned.values()) * cpu["count"] * cpu["costPerHour"]  # 2 replicas x 2 cores x $0.10
        by_hand = dollars_per_hour * range_s / 3600 / (served / 1e6)
        panels = dict(grafana.exprs(grafana.models()["pdfleet-fleet-cost"]))
        overall = grafana.substitute(
            panels["$ per 1M served tokens (time range)"], namespace=NAMESPACE, range_s=range_s
        )
        per_deployment = grafana.substitute(
            panels["$ per 1M served tokens by deployment (time range)"], namespace=NAMESPACE, range_s=range_s
        )
        (value,) = [float(s["value"][1]) for s in query_at(prom, overall, at)]
        (row,) = query_at(prom, per_deployment, at)
        assert row["metric"] == {"namespace": NAMESPACE, "deployment": NAME}
        print(
            f"served {served} tokens; ${dollars_per_hour:.2f}/h over {range_s}s; by hand ${by_hand:.4f}/1M, "
            f"panel ${value:.4f}/1M"
        )
        assert value == pytest.approx(by_hand, rel=1e-9)
        assert float(row["value"][1]) == pytest.approx(by_hand, rel=1e-9)
    finally:
        for c in reversed(children):
            c.stop()
        if operator is not None:
            operator.stop()
