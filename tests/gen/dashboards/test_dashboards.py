"""Dashboards: generated and current, stable and scoped by variables, every PromQL parsed by promtool (fast tests)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from pdfleet_operator.gen import dashboards
from tests.gen.dashboards import grafana
from tests.support.components import binary

UIDS = ["pdfleet-deployment", "pdfleet-fleet-cost", "pdfleet-operator"]


def test_dashboards_are_current_and_stable() -> None:
    assert dashboards.stale_files() == [], "run `pdfleet dashboards`"
    assert sorted(grafana.models()) == UIDS
    assert dashboards.render_all() == dashboards.render_all(), "generation is deterministic"


def test_sdk_reads_them_back() -> None:
    from grafana_foundation_sdk.models.dashboard import Dashboard

    for uid, model in grafana.models().items():
        parsed = Dashboard.from_json(model)
        assert parsed.uid == uid and parsed.title == model["title"]
        assert len(parsed.panels) == len(model["panels"])


@pytest.mark.parametrize("uid", UIDS)
def test_every_query_is_scoped_by_variables_never_a_hard_coded_job(uid: str) -> None:
    model = grafana.models()[uid]
    variables = [v["name"] for v in model["templating"]["list"]]
    assert variables[0] == "datasource" and model["templating"]["list"][0]["query"] == "prometheus"
    exprs = grafana.exprs(model)
    assert len(exprs) >= 8
    for title, expr in exprs:
        assert not re.search(r'\bjob\s*=~?\s*"(?!\$job")', expr), f"{title}: hard-coded job in {expr}"
        used = set(re.findall(r"\$(namespace|deployment|job)\b", expr))
        assert used <= set(variables), f"{title}: uses {used - set(variables)}"
    panels = [p for p in model["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in model["panels"]]
    assert len(set(ids)) == len(ids)
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        assert panel.get("description"), panel["title"]
    if uid != "pdfleet-operator":  # fleet and deployment panels follow the namespace picker
        assert all("$namespace" in e or "pdfleet_scaling_decisions_total" in e for _, e in exprs)


def test_every_promql_parses_with_promtool(tmp_path) -> None:
    promtool = binary("promtool")
    rules = []
    for uid, model in sorted(grafana.models().items()):
        for i, (title, expr) in enumerate(grafana.exprs(model, annotations=True)):
            rules.append({"record": f"dashboard:{uid.replace('-', '_')}:{i}", "expr": grafana.substitute(expr)})
    path = tmp_path / "dashboards.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}, width=1000))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules)} rules found" in proc.stdout


def test_every_metric_a_panel_reads_is_one_pdfleet_exports() -> None:
    from pdfleet_operator.decide import metric_names as names
    from pdfleet_operator.gen import alerts
    from pdfleet_operator.kube import exporter, operator_metrics
    from pdfleet_worker import metrics as worker_metrics

    def exported(registry) -> set[str]:
        return {f.name + ("_total" if f.type == "counter" else "") for f in registry.collect()}

    known = {getattr(names, n) for n in dir(names) if n.isupper() and isinstance(getattr(names, n), str)}
    known |= set(worker_metrics.ALL_METRICS) | exported(exporter.REGISTRY)
    known |= exported(operator_metrics.OperatorMetrics().registry) | {alerts.SLO_TTFT, alerts.SLO_ITL}
    read = set()
    for model in grafana.models().values():
        for _, expr in grafana.exprs(model, annotations=True):
            read |= {re.sub(r"_bucket$", "", m) for m in re.findall(r"\b(?:vllm:|pdfleet_)[a-z_:]+(?=[{\[)\s])", expr)}
    read -= {names.LABEL_DEPLOYMENT, names.LABEL_ROLE, names.LABEL_ACCELERATOR, dashboards.REVISION_LABEL}
    assert read and read <= known, f"panels read metrics nobody exports: {sorted(read - known)}"
    assert {
        names.POOL_COST_PER_HOUR,
        names.GENERATION_TOKENS_TOTAL,
        names.PD_RATIO,
        dashboards.KV_TRANSFER_SECONDS,
        dashboards.RECONCILES,
        dashboards.API_WRITES,
    } <= read


def test_substitution_keeps_label_replace_references() -> None:
    expr = 'label_replace(x{namespace=~"$namespace"}[$__range], "d", "$1", "s", "(.*)") * $__range_s'
    assert (
        grafana.substitute(expr, namespace="ns", range_s=60)
        == 'label_replace(x{namespace=~"ns"}[60s], "d", "$1", "s", "(.*)") * 60'
    )
    assert json.dumps(grafana.models()["pdfleet-fleet-cost"]).count("$__range_s") >= 3
