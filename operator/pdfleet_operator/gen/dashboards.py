"""Grafana dashboards (fleet cost, deployment, operator health) as code, and `pdfleet dashboards [--check]` that writes
them.

Built with grafana-foundation-sdk from the metric names the operator and the workers define
(`metric_names`, `pdfleet_worker.metrics`, torch-free), so a renamed metric breaks the build instead of a panel. Every
query is scoped by template variables (datasource, namespace, deployment, the operator's job): none hard-codes `job=`.
The chart ships the same JSON as ConfigMaps for Grafana's sidecar (`pdfleet chart`). Pure: nothing here runs a query.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdfleet_operator.decide import metric_names as names
from pdfleet_operator.gen import alerts, generated
from pdfleet_worker import metrics as worker_metrics

ROOT = Path(__file__).resolve().parents[3]
OUT_DIR = Path("dashboards")
DATASOURCE = "${datasource}"

# Label matchers the panels share. Worker and router series carry the target labels the PodMonitor
# sets from pod labels; the operator's own series carry `namespace` and `deployment` (honorLabels).
WORKERS = f'{names.LABEL_NAMESPACE}=~"$namespace", {names.LABEL_DEPLOYMENT}=~"$deployment"'
ALL_WORKERS = f'{names.LABEL_NAMESPACE}=~"$namespace"'
OWN = f'{names.LABEL_NAMESPACE}=~"$namespace", {names.LABEL_DEPLOYMENT_OWN}=~"$deployment"'
ALL_OWN = f'{names.LABEL_NAMESPACE}=~"$namespace"'
SERVING = f'{names.LABEL_ROLE}!="prefill"'  # tokens clients receive: prefill's one discarded token is not served
REVISION_LABEL = "pdfleet_revision"  # the chart's PodMonitor turns pdfleet.io/revision into this target label
ROUTER_TTFT = worker_metrics.ROUTER_TIME_TO_FIRST_TOKEN.name
KV_TRANSFER_SECONDS = worker_metrics.KV_TRANSFER_SECONDS.name
KV_TRANSFER_FAILURES = worker_metrics.KV_TRANSFER_FAILURES_TOTAL.name
KV_TRANSFER_BYTES = worker_metrics.KV_TRANSFER_BYTES_TOTAL.name
KV_OFFLOAD_HITS = worker_metrics.KV_OFFLOAD_HITS_TOTAL.name
KV_OFFLOAD_RECOMPUTED = worker_metrics.KV_OFFLOAD_RECOMPUTED_TOTAL.name
KV_OFFLOAD_USAGE = worker_metrics.KV_OFFLOAD_USAGE.name
PREEMPTIONS_SWAPPED = worker_metrics.PREEMPTIONS_SWAPPED_TOTAL.name
SWAP_FALLBACKS = worker_metrics.PREEMPTION_SWAP_FALLBACKS_TOTAL.name
# The operator's own series (pdfleet_operator.kube.exporter, which needs aiohttp; tests check the names match).
RECONCILES = "pdfleet_operator_reconciles_total"
API_WRITES = "pdfleet_operator_api_writes_total"


@dataclass(frozen=True)
class Query:
    """One PromQL target of a panel; `instant` for stat/bar panels that show one value per series."""

    expr: str
    legend: str = ""
    instant: bool = False


@dataclass(frozen=True)
class Panel:
    """What one panel shows: a kind of Grafana panel, a unit and its queries."""

    title: str
    description: str
    queries: tuple[Query, ...]
    kind: str = "timeseries"  # timeseries | stat | bargauge
    unit: str = "short"
    width: int = 12
    height: int = 8


@dataclass(frozen=True)
class Annotation:
    name: str
    expr: str
    title: str
    color: str


@dataclass(frozen=True)
class Board:
    """A dashboard: stable uid, variables by name, rows of panels, annotations."""

    uid: str
    title: str
    description: str
    variables: tuple[tuple[str, str, str], ...]  # (name, label, label_values query)
    rows: tuple[tuple[str, tuple[Panel, ...]], ...]
    annotations: tuple[Annotation, ...] = ()

    def panels(self) -> Iterator[Panel]:
        for _, panels in self.rows:
            yield from panels


def _as_own(expr: str, *labels: str) -> str:
    """Copy the workers' target labels (pdfleet_deployment, ...) to the operator's names (deployment, ...)."""
    own = {
        names.LABEL_DEPLOYMENT: names.LABEL_DEPLOYMENT_OWN,
        names.LABEL_ROLE: names.LABEL_ROLE_OWN,
        names.LABEL_ACCELERATOR: "accelerator",
    }
    for source in labels:
        expr = f'label_replace({expr}, "{own[source]}", "$1", "{source}", "(.*)")'
    return expr


def _quantile(q: float, metric: str, selector: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{selector}}}[$__rate_interval])))"


# --- fleet cost ------------------------------------------------------------------------------------------


def _cost_per_million(by: str, selector_own: str, selector_workers: str) -> str:
    """$ spent over the dashboard's range / millions of tokens served over it (grouped `by`)."""
    group = f"sum by ({by}) " if by else "sum "
    tokens = f"increase({names.GENERATION_TOKENS_TOTAL}{{{selector_workers}, {SERVING}}}[$__range])"
    if by:
        tokens = _as_own(
            f"sum by ({names.LABEL_NAMESPACE}, {names.LABEL_DEPLOYMENT}) ({tokens})", names.LABEL_DEPLOYMENT
        )
    on = f" on ({by})" if by else ""
    return (
        f"{group}(avg_over_time({names.POOL_COST_PER_HOUR}{{{selector_own}}}[$__range])) * $__range_s / 3600"
        f"\n/{on}\n({group}({tokens}) / 1e6)"
    )


def _idle_cost(selector_own: str, selector_workers: str, by: str = "") -> str:
    """$/h of pool replicas with nothing running or waiting, now (grouped `by`)."""
    idle = (
        f"avg by ({names.LABEL_NAMESPACE}, {names.LABEL_DEPLOYMENT}, {names.LABEL_ROLE}, {names.LABEL_ACCELERATOR}) "
        f"(({names.NUM_REQUESTS_RUNNING}{{{selector_workers}}} + {names.NUM_REQUESTS_WAITING}{{{selector_workers}}}) "
        f"== bool 0)"
    )
    idle = _as_own(idle, names.LABEL_DEPLOYMENT, names.LABEL_ROLE, names.LABEL_ACCELERATOR)
    group = f"sum by ({by})" if by else "sum"
    return (
        f"{group} (\n  {names.POOL_COST_PER_HOUR}{{{selector_own}}}\n"
        f"  * on ({names.LABEL_NAMESPACE}, {names.LABEL_DEPLOYMENT_OWN}, {names.LABEL_ROLE_OWN}, accelerator)\n"
        f"  {idle}\n)"
    )


def fleet_cost() -> Board:
    cost = names.POOL_COST_PER_HOUR
    ns_dep = f"{names.LABEL_NAMESPACE}, {names.LABEL_DEPLOYMENT_OWN}"
    return Board(
        uid="pdfleet-fleet-cost",
        title="pdfleet / Fleet cost",
        description="What the fleet costs and what a million served tokens costs, by accelerator class, role and "
        "deployment. Prices are the AcceleratorClasses' costPerHour; tokens are the decode and colocated "
        "workers' vllm:generation_tokens_total.",
        variables=(("namespace", "Namespace", f"label_values({cost}, namespace)"),),
        rows=(
            (
                "Spend",
                (
                    Panel(
                        "Fleet $/h",
                        "Sum of every pool's price at its planned size.",
                        (Query(f"sum({cost}{{{ALL_OWN}}})", "$/h", instant=True),),
                        "stat",
                        "currencyUSD",
                        6,
                        5,
                    ),
                    Panel(
                        "$ per 1M served tokens (time range)",
                        "Dollars spent on the pools over the time range divided by millions of tokens generated for "
                        "clients over it.",
                        (Query(_cost_per_million("", ALL_OWN, ALL_WORKERS), "$/1M", instant=True),),
                        "stat",
                        "currencyUSD",
                        6,
                        5,
                    ),
                    Panel(
                        "Spend over the time range",
                        "Average $/h over the range times its hours.",
                        (
                            Query(
                                f"sum(avg_over_time({cost}{{{ALL_OWN}}}[$__range])) * $__range_s / 3600",
                                "$",
                                instant=True,
                            ),
                        ),
                        "stat",
                        "currencyUSD",
                        6,
                        5,
                    ),
                    Panel(
                        "Cost of idle capacity",
                        "$/h of replicas with no request running or waiting right now.",
                        (Query(_idle_cost(ALL_OWN, ALL_WORKERS), "idle $/h", instant=True),),
                        "stat",
                        "currencyUSD",
                        6,
                        5,
                    ),
                ),
            ),
            (
                "By accelerator class and role",
                (
                    Panel(
                        "$/h by accelerator class and role",
                        "Pool prices at their planned size.",
                        (
                            Query(
                                f"sum by (accelerator, {names.LABEL_ROLE_OWN}) ({cost}{{{ALL_OWN}}})",
                                "{{accelerator}} {{role}}",
                            ),
                        ),
                        unit="currencyUSD",
                    ),
                    Panel(
                        "Accelerator replica-hours by class (time range)",
                        "Replicas planned on each AcceleratorClass, integrated over the time range (one replica holds "
                        "the class's `count` units).",
                        (
                            Query(
                                f"sum by (accelerator) (avg_over_time({names.POOL_REPLICAS}{{{ALL_OWN}}}[$__range])) "
                                f"* $__range_s / 3600",
                                "{{accelerator}}",
                                instant=True,
                            ),
                        ),
                        "bargauge",
                        "h",
                    ),
                ),
            ),
            (
                "By deployment",
                (
                    Panel(
                        "$ per 1M served tokens by deployment (time range)",
                        "Each deployment's pool spend over the time range / its served tokens over it, in millions.",
                        (
                            Query(
                                _cost_per_million(ns_dep, ALL_OWN, ALL_WORKERS),
                                "{{namespace}}/{{deployment}}",
                                instant=True,
                            ),
                        ),
                        "bargauge",
                        "currencyUSD",
                    ),
                    Panel(
                        "$ per 1M served tokens by deployment",
                        "Current $/h over the current token rate.",
                        (
                            Query(
                                f"sum by ({ns_dep}) ({cost}{{{ALL_OWN}}})\n/ on ({ns_dep})\n"
                                + "("
                                + _as_own(
                                    f"sum by ({names.LABEL_NAMESPACE}, {names.LABEL_DEPLOYMENT}) "
                                    f"(rate({names.GENERATION_TOKENS_TOTAL}{{{ALL_WORKERS}, {SERVING}}}"
                                    f"[$__rate_interval]))",
                                    names.LABEL_DEPLOYMENT,
                                )
                                + " * 3600 / 1e6)",
                                "{{namespace}}/{{deployment}}",
                            ),
                        ),
                        unit="currencyUSD",
                    ),
                    Panel(
                        "$/h by deployment",
                        "Pool prices per deployment.",
                        (Query(f"sum by ({ns_dep}) ({cost}{{{ALL_OWN}}})", "{{namespace}}/{{deployment}}"),),
                        unit="currencyUSD",
                    ),
                    Panel(
                        "Cost of idle capacity by deployment",
                        "$/h of replicas with nothing running or waiting.",
                        (Query(_idle_cost(ALL_OWN, ALL_WORKERS, ns_dep), "{{namespace}}/{{deployment}}"),),
                        unit="currencyUSD",
                    ),
                    Panel(
                        "Served tokens/s by deployment",
                        "Tokens generated for clients (decode and colocated workers).",
                        (
                            Query(
                                f"sum by ({names.LABEL_NAMESPACE}, {names.LABEL_DEPLOYMENT}) "
                                f"(rate({names.GENERATION_TOKENS_TOTAL}{{{ALL_WORKERS}, {SERVING}}}"
                                "[$__rate_interval]))",
                                "{{namespace}}/{{pdfleet_deployment}}",
                            ),
                        ),
                        unit="short",
                        width=24,
                    ),
                ),
            ),
        ),
    )


# --- one deployment --------------------------------------------------------------------------------------


def deployment() -> Board:
    role = names.LABEL_ROLE
    rollback_alert = f'ALERTS{{alertname="{alerts.ROLLBACK_ALERT}", alertstate="firing", {WORKERS}}}'
    new_revision = (
        f"count by ({names.LABEL_NAMESPACE}, {names.LABEL_DEPLOYMENT}, {REVISION_LABEL}) "
        f"({names.NUM_REQUESTS_WAITING}{{{WORKERS}}})\nunless\n"
        f"count by ({names.LABEL_NAMESPACE}, {names.LABEL_DEPLOYMENT}, {REVISION_LABEL}) "
        f"({names.NUM_REQUESTS_WAITING}{{{WORKERS}}} offset 5m)"
    )
    return Board(
        uid="pdfleet-deployment",
        title="pdfleet / Deployment",
        description="One InferenceDeployment: queues per role, the autoscaler's P:D ratio and decisions, KV cache, "
        "latency against the SLO, throughput, KV transfer between prefill and decode, and the 5xx "
        "ratio rollback acts on.",
        variables=(
            ("namespace", "Namespace", f"label_values({names.POOL_REPLICAS}, namespace)"),
            (
                "deployment",
                "Deployment",
                f'label_values({names.POOL_REPLICAS}{{namespace=~"$namespace"}}, {names.LABEL_DEPLOYMENT_OWN})',
            ),
        ),
        rows=(
            (
                "Queues and scaling",
                (
                    Panel(
                        "Requests waiting and running per role",
                        "Summed over each role's replicas.",
                        (
                            Query(
                                f"sum by ({role}) ({names.NUM_REQUESTS_WAITING}{{{WORKERS}}})",
                                "waiting {{pdfleet_role}}",
                            ),
                            Query(
                                f"sum by ({role}) ({names.NUM_REQUESTS_RUNNING}{{{WORKERS}}})",
                                "running {{pdfleet_role}}",
                            ),
                        ),
                    ),
                    Panel(
                        "Prompt tokens waiting per role",
                        "What prefill capacity is sized by.",
                        (Query(f"sum by ({role}) ({names.PROMPT_TOKENS_WAITING}{{{WORKERS}}})", "{{pdfleet_role}}"),),
                    ),
                    Panel(
                        "P:D ratio",
                        "Prefill / decode replicas: what the autoscaler asks for and what is planned.",
                        (
                            Query(f"max({names.PD_RATIO}{{{OWN}}})", "desired"),
                            Query(
                                f'sum({names.POOL_REPLICAS}{{{OWN}, role="prefill"}})\n/\n'
                                f'sum({names.POOL_REPLICAS}{{{OWN}, role="decode"}})',
                                "planned",
                            ),
                        ),
                    ),
                    Panel(
                        "Replicas per role",
                        "Desired by the autoscaler vs planned by placement (capacity-capped).",
                        (
                            Query(
                                f"sum by ({names.LABEL_ROLE_OWN}) ({names.DESIRED_REPLICAS}{{{OWN}}})",
                                "desired {{role}}",
                            ),
                            Query(
                                f"sum by ({names.LABEL_ROLE_OWN}) ({names.POOL_REPLICAS}{{{OWN}}})", "planned {{role}}"
                            ),
                        ),
                    ),
                    Panel(
                        "Autoscaler decisions",
                        "Decisions per interval by role, direction and reason (all deployments: "
                        "the counter has no deployment label).",
                        (
                            Query(
                                f"sum by ({names.LABEL_ROLE_OWN}, {names.LABEL_DIRECTION}, {names.LABEL_REASON}) "
                                f"(increase({names.SCALING_DECISIONS_TOTAL}[$__rate_interval]))",
                                "{{role}} {{direction}} ({{reason}})",
                            ),
                        ),
                        width=24,
                    ),
                ),
            ),
            (
                "Latency against the SLO",
                (
                    Panel(
                        "Time to first token",
                        "At the router (what clients see) and at the workers (what the SLO "
                        "alert measures), against the deployment's TTFT target.",
                        (
                            Query(_quantile(0.5, ROUTER_TTFT, WORKERS), "p50 router"),
                            Query(_quantile(0.99, ROUTER_TTFT, WORKERS), "p99 router"),
                            Query(_quantile(0.99, names.TIME_TO_FIRST_TOKEN, WORKERS), "p99 workers"),
                            Query(f"max({alerts.SLO_TTFT}{{{WORKERS}}})", "SLO"),
                        ),
                        unit="s",
                    ),
                    Panel(
                        "Inter-token latency",
                        "Decode and colocated workers, against the ITL target.",
                        (
                            Query(_quantile(0.5, names.INTER_TOKEN_LATENCY, f"{WORKERS}, {SERVING}"), "p50"),
                            Query(_quantile(0.99, names.INTER_TOKEN_LATENCY, f"{WORKERS}, {SERVING}"), "p99"),
                            Query(f"max({alerts.SLO_ITL}{{{WORKERS}}})", "SLO"),
                        ),
                        unit="s",
                    ),
                ),
            ),
            (
                "Throughput and KV cache",
                (
                    Panel(
                        "Tokens/s",
                        "Generated for clients, and prompt tokens computed per role.",
                        (
                            Query(
                                f"sum(rate({names.GENERATION_TOKENS_TOTAL}{{{WORKERS}, {SERVING}}}[$__rate_interval]))",
                                "generated",
                            ),
                            Query(
                                f"sum by ({role}) (rate({names.PROMPT_TOKENS_TOTAL}{{{WORKERS}}}[$__rate_interval]))",
                                "prompt {{pdfleet_role}}",
                            ),
                        ),
                    ),
                    Panel(
                        "KV cache usage per role",
                        "Mean fraction of KV blocks in use.",
                        (Query(f"avg by ({role}) ({names.KV_CACHE_USAGE}{{{WORKERS}}})", "{{pdfleet_role}}"),),
                        unit="percentunit",
                    ),
                    Panel(
                        "Preemptions",
                        "Sequences preempted (recomputed later) per interval.",
                        (
                            Query(
                                f"sum by ({role}) "
                                f"(increase({names.NUM_PREEMPTIONS_TOTAL}{{{WORKERS}}}[$__rate_interval]))",
                                "{{pdfleet_role}}",
                            ),
                        ),
                    ),
                    Panel(
                        "Replicas per revision",
                        "Workers scraped per pod-template revision (a rollout or a rollback moves them).",
                        (
                            Query(
                                f"count by ({REVISION_LABEL}) ({names.NUM_REQUESTS_WAITING}{{{WORKERS}}})",
                                "revision {{pdfleet_revision}}",
                            ),
                        ),
                    ),
                ),
            ),
            (
                "KV transfer (prefill -> decode)",
                (
                    Panel(
                        "KV pull time",
                        "Duration of one KV pull on the decode side.",
                        (
                            Query(_quantile(0.5, KV_TRANSFER_SECONDS, WORKERS), "p50"),
                            Query(_quantile(0.99, KV_TRANSFER_SECONDS, WORKERS), "p99"),
                        ),
                        unit="s",
                    ),
                    Panel(
                        "KV transfer failures",
                        "Failed or refused pulls per interval, by reason.",
                        (
                            Query(
                                f"sum by (reason) (increase({KV_TRANSFER_FAILURES}{{{WORKERS}}}[$__rate_interval]))",
                                "{{reason}}",
                            ),
                        ),
                    ),
                    Panel(
                        "KV bytes/s",
                        "Received by decode workers.",
                        (
                            Query(
                                f'sum(rate({KV_TRANSFER_BYTES}{{{WORKERS}, direction="received"}}[$__rate_interval]))',
                                "received",
                            ),
                        ),
                        unit="Bps",
                        width=24,
                    ),
                ),
            ),
            (
                "KV offload tiers and swap preemption",
                (
                    Panel(
                        "Offload hits per tier",
                        "Prefix-cache blocks loaded back from host RAM or disk per interval, "
                        "and those found there but recomputed (loading would have cost more).",
                        (
                            Query(
                                f"sum by (tier) (increase({KV_OFFLOAD_HITS}{{{WORKERS}}}[$__rate_interval]))",
                                "loaded from {{tier}}",
                            ),
                            Query(
                                f"sum by (tier) (increase({KV_OFFLOAD_RECOMPUTED}{{{WORKERS}}}[$__rate_interval]))",
                                "recomputed, in {{tier}}",
                            ),
                        ),
                    ),
                    Panel(
                        "Offload tier usage",
                        "Mean fraction of each tier's blocks holding KV.",
                        (Query(f"avg by (tier) ({KV_OFFLOAD_USAGE}{{{WORKERS}}})", "{{tier}}"),),
                        unit="percentunit",
                    ),
                    Panel(
                        "Swap preemptions",
                        "Preemptions whose KV went to swap space, and those that found it full and "
                        "recomputed instead, per interval.",
                        (
                            Query(f"sum(increase({PREEMPTIONS_SWAPPED}{{{WORKERS}}}[$__rate_interval]))", "swapped"),
                            Query(
                                f"sum(increase({SWAP_FALLBACKS}{{{WORKERS}}}[$__rate_interval]))",
                                "swap full: recomputed",
                            ),
                        ),
                        width=24,
                    ),
                ),
            ),
            (
                "Errors and rollback",
                (
                    Panel(
                        "5xx ratio at the router",
                        "Share of client requests answered 5xx (rollback acts on this; red marks are rollback alerts).",
                        (
                            Query(
                                f'sum(rate({names.ROUTER_REQUESTS_TOTAL}{{{WORKERS}, code=~"5.."}}'
                                "[$__rate_interval]))\n/\n"
                                f"sum(rate({names.ROUTER_REQUESTS_TOTAL}{{{WORKERS}}}[$__rate_interval]))",
                                "5xx ratio",
                            ),
                        ),
                        unit="percentunit",
                    ),
                    Panel(
                        "Requests/s by code",
                        "Answered by the router.",
                        (
                            Query(
                                f"sum by (code) (rate({names.ROUTER_REQUESTS_TOTAL}{{{WORKERS}}}[$__rate_interval]))",
                                "{{code}}",
                            ),
                        ),
                    ),
                ),
            ),
        ),
        annotations=(
            Annotation("Rollback alert", rollback_alert, "5xx ratio above the rollback threshold", "red"),
            Annotation("New revision", new_revision, "revision {{pdfleet_revision}} started", "blue"),
        ),
    )


# --- the operator ------------------------------------------------------------------------------------------


def operator() -> Board:
    job = 'job=~"$job"'
    return Board(
        uid="pdfleet-operator",
        title="pdfleet / Operator",
        description="Health of the pdfleet operator: scrape, reconciles, API writes, what it manages, scaling "
        "decisions and the worker targets Prometheus reaches.",
        variables=(("job", "Operator job", f"label_values({RECONCILES}, job)"),),
        rows=(
            (
                "Operator",
                (
                    Panel(
                        "Operator up",
                        "1 when Prometheus scrapes the operator.",
                        (Query(f"max({'up'}{{{job}}})", "up", instant=True),),
                        "stat",
                        "short",
                        6,
                        5,
                    ),
                    Panel(
                        "InferenceDeployments managed",
                        "Deployments with planned pools.",
                        (
                            Query(
                                f"count(count by (namespace, {names.LABEL_DEPLOYMENT_OWN}) "
                                f"({names.POOL_REPLICAS}{{{job}}}))",
                                "deployments",
                                instant=True,
                            ),
                        ),
                        "stat",
                        "short",
                        6,
                        5,
                    ),
                    Panel(
                        "Replicas planned",
                        "Across every pool.",
                        (Query(f"sum({names.POOL_REPLICAS}{{{job}}})", "replicas", instant=True),),
                        "stat",
                        "short",
                        6,
                        5,
                    ),
                    Panel(
                        "Reconcile errors (time range)",
                        "Reconciles that failed.",
                        (
                            Query(
                                f'sum(increase({RECONCILES}{{{job}, result="error"}}[$__range])) or vector(0)',
                                "errors",
                                instant=True,
                            ),
                        ),
                        "stat",
                        "short",
                        6,
                        5,
                    ),
                    Panel(
                        "Reconciles/s by result",
                        "ok, skipped (covered by a later run) or error.",
                        (Query(f"sum by (result) (rate({RECONCILES}{{{job}}}[$__rate_interval]))", "{{result}}"),),
                    ),
                    Panel(
                        "API writes/s by kind",
                        "Writes to the API server; zero in a steady state.",
                        (Query(f"sum by (kind) (rate({API_WRITES}{{{job}}}[$__rate_interval]))", "{{kind}}"),),
                    ),
                    Panel(
                        "Replicas planned by accelerator class",
                        "What placement asks the cluster for.",
                        (Query(f"sum by (accelerator) ({names.POOL_REPLICAS}{{{job}}})", "{{accelerator}}"),),
                    ),
                    Panel(
                        "Scaling decisions/s by direction",
                        "up, down or hold.",
                        (
                            Query(
                                f"sum by ({names.LABEL_DIRECTION}) (rate({names.SCALING_DECISIONS_TOTAL}{{{job}}}"
                                f"[$__rate_interval]))",
                                "{{direction}}",
                            ),
                        ),
                    ),
                    Panel(
                        "Worker and router targets up by role",
                        "Targets carrying pdfleet's deployment label that Prometheus scrapes successfully.",
                        (
                            Query(
                                f'sum by ({names.LABEL_ROLE}) (up{{{names.LABEL_DEPLOYMENT}!=""}})', "{{pdfleet_role}}"
                            ),
                        ),
                        width=24,
                    ),
                ),
            ),
        ),
    )


BOARDS = (fleet_cost, deployment, operator)


# --- building with the SDK ---------------------------------------------------------------------------------


def build(board: Board) -> dict[str, Any]:
    """The Grafana dashboard JSON model of `board` (nulls dropped, so the SDK can read it back)."""
    from grafana_foundation_sdk.builders import bargauge, dashboard, prometheus, stat, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

    ds = DataSourceRef(type_val="prometheus", uid=DATASOURCE)
    out = (
        dashboard.Dashboard(board.title)
        .uid(board.uid)
        .description(board.description)
        .tags(["pdfleet"])
        .time("now-6h", "now")
        .refresh("30s")
        .timezone("browser")
        .editable()
        .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    )
    for name, label, query in board.variables:
        out = out.with_variable(
            dashboard.QueryVariable(name)
            .label(label)
            .datasource(ds)
            .query(query)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .sort(1)
        )
    kinds = {"timeseries": timeseries.Panel, "stat": stat.Panel, "bargauge": bargauge.Panel}
    panel_id = 0
    for title, panels in board.rows:
        panel_id += 1
        out = out.with_row(dashboard.Row(title).id(panel_id))
        for p in panels:
            panel_id += 1
            built = kinds[p.kind]().id(panel_id).title(p.title).description(p.description).datasource(ds)
            built = built.unit(p.unit).span(p.width).height(p.height)
            for i, q in enumerate(p.queries):
                target = prometheus.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i))
                built = built.with_target(target.instant() if q.instant else target.range())
            out = out.with_panel(built)
    for a in board.annotations:
        out = out.annotation(
            dashboard.AnnotationQuery().name(a.name).datasource(ds).enable(True).expr(a.expr).icon_color(a.color)
        )
    model = json.loads(json.dumps(out.build(), cls=JSONEncoder))
    for annotation, spec in zip(model.get("annotations", {}).get("list", []), board.annotations):
        annotation["titleFormat"] = spec.title
    for variable in model["templating"]["list"]:
        variable.pop("id", None)  # the SDK writes one all-zero UUID for every variable
    return _drop_nulls(model)


def _drop_nulls(value: Any) -> Any:
    # NOTE: the SDK encodes unset options as null and its own from_json cannot read them back.
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def render_all() -> dict[str, str]:
    """File name -> dashboard JSON text, for every dashboard."""
    out = {}
    for make in BOARDS:
        board = make()
        out[f"{board.uid}.json"] = json.dumps(build(board), indent=2, sort_keys=True) + "\n"
    return out


def queries(model: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) for every panel target of a dashboard JSON model, annotations excluded."""
    found = []
    for panel in model.get("panels", []):
        for target in panel.get("targets") or []:
            found.append((panel["title"], target["expr"]))
    return found


def stale_files(root: Path = ROOT, out: Path = OUT_DIR) -> list[Path]:
    wanted = render_all()
    stale = [
        out / n for n, text in wanted.items() if not (root / out / n).exists() or (root / out / n).read_text() != text
    ]
    stale += [p.relative_to(root) for p in sorted((root / out).glob("*.json")) if p.name not in wanted]
    return stale


def write(root: Path = ROOT, out: Path = OUT_DIR) -> list[Path]:
    (root / out).mkdir(parents=True, exist_ok=True)
    wanted = render_all()
    written = []
    for name, text in wanted.items():
        path = root / out / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            written.append(out / name)
    for path in sorted((root / out).glob("*.json")):
        if path.name not in wanted:
            path.unlink()
            written.append(path.relative_to(root))
    return written


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("dashboards", help="regenerate the Grafana dashboards in dashboards/")
    p.add_argument("--root", default=str(ROOT), help="repository root (default: this checkout)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a dashboard is stale")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    root = Path(args.root)
    return generated.regenerate("dashboards", args.check, lambda: stale_files(root), lambda: write(root))


def main(argv: list[str] | None = None) -> int:
    return generated.standalone(register, argv)


if __name__ == "__main__":
    raise SystemExit(main())
