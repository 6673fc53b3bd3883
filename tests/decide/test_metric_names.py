"""The operator's metric catalogue against the exporters: the names it reads from workers and routers are the ones
`pdfleet_worker.metrics` exports (the operator's image does not ship the worker, so it keeps a copy), and the ones
it exports are registered by the operator."""

from __future__ import annotations

from pdfleet_operator.decide import metric_names as names
from pdfleet_operator.kube import exporter, operator_metrics
from pdfleet_worker import metrics as worker_metrics


def test_every_metric_name_the_operator_uses_is_exported_by_a_worker_a_router_or_the_operator() -> None:
    catalogue = {getattr(names, k) for k in dir(names) if k.isupper() and isinstance(getattr(names, k), str)}
    metrics = {n for n in catalogue if n.startswith(("vllm:", "pdfleet_"))}
    labels = {names.LABEL_DEPLOYMENT, names.LABEL_ROLE, names.LABEL_ACCELERATOR}
    operator = {
        f.name + ("_total" if f.type == "counter" else "")
        for registry in (exporter.REGISTRY, operator_metrics.OperatorMetrics().registry)
        for f in registry.collect()
    }
    unknown = metrics - labels - set(worker_metrics.ALL_METRICS) - operator
    # vLLM before v1 named its KV gauge this way; the autoscaler still reads it from older vLLM pools.
    assert unknown == {names.KV_CACHE_USAGE_LEGACY}, f"read or exported by nobody: {sorted(unknown)}"
    assert {names.NUM_REQUESTS_WAITING, names.ROUTER_REQUESTS_TOTAL} <= set(worker_metrics.ALL_METRICS)
    assert names.POOL_COST_PER_HOUR in operator
