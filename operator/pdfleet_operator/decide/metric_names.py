"""Every metric and label name the operator queries or exports, and the PromQL built from them.

The operator's own metrics are defined here once. The workers' and routers' names are copies of
`pdfleet_worker.metrics` (the worker's catalogue; the operator's image does not ship the worker), and
tests/decide/test_metric_names.py fails when a copy names something no worker, router or operator exports."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from string import Template

# --- labels ----------------------------------------------------------------------------------------
# Target labels the scrape config / PodMonitor puts on every worker series (from the pod's labels).
LABEL_DEPLOYMENT = "pdfleet_deployment"
LABEL_ROLE = "pdfleet_role"
LABEL_ACCELERATOR = "pdfleet_accelerator"
LABEL_NAMESPACE = "namespace"
# Labels the worker itself sets (vLLM's own label name for the served model).
LABEL_MODEL = "model_name"
# Labels of the operator's and router's own series. NOTE: the operator's series carry the
# deployment's `namespace`; its ServiceMonitor sets honorLabels (as kube-state-metrics' does) so the
# operator pod's own namespace does not overwrite it.
LABEL_DEPLOYMENT_OWN = "deployment"
LABEL_ROLE_OWN = "role"
LABEL_DIRECTION = "direction"
LABEL_REASON = "reason"
LABEL_CODE = "code"
LABEL_TIER = "tier"

# --- worker metrics: vLLM-compatible, so vLLM pods are scaled and charted the same way -------------
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"  # gauge: requests queued, not yet scheduled
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"  # gauge: requests in the running batch
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"  # gauge: fraction of KV blocks in use (0..1)
KV_CACHE_USAGE_LEGACY = "vllm:gpu_cache_usage_perc"  # the same gauge in vLLM before v1
PROMPT_TOKENS_TOTAL = "vllm:prompt_tokens_total"  # counter: prompt tokens prefilled
GENERATION_TOKENS_TOTAL = "vllm:generation_tokens_total"  # counter: tokens generated
NUM_PREEMPTIONS_TOTAL = "vllm:num_preemptions_total"  # counter: sequences preempted
REQUEST_SUCCESS_TOTAL = "vllm:request_success_total"  # counter: finished requests (finished_reason)
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"  # histogram
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"  # histogram
E2E_REQUEST_LATENCY = "vllm:e2e_request_latency_seconds"  # histogram

# --- worker and router metrics only pdfleet exports ------------------------------------------------
PROMPT_TOKENS_WAITING = "pdfleet_prompt_tokens_waiting"  # gauge: prompt tokens of waiting requests
ROUTER_REQUESTS_TOTAL = "pdfleet_router_requests_total"  # counter {code, tier}
# counter {revision, code, shed}: by the pod template revision of the worker that answered ("none": no worker
# did), shed="true" for the designed 503 + Retry-After load shedding. Rollback analysis reads this one.
ROUTER_REVISION_REQUESTS_TOTAL = "pdfleet_router_revision_requests_total"
NO_REVISION = "none"

# --- the operator's own metrics --------------------------------------------------------------------
POOL_REPLICAS = "pdfleet_pool_replicas"  # gauge {deployment, role, accelerator}
POOL_COST_PER_HOUR = "pdfleet_pool_cost_per_hour"  # gauge {deployment, role, accelerator}
DESIRED_REPLICAS = "pdfleet_desired_replicas"  # gauge {deployment, role}
PD_RATIO = "pdfleet_pd_ratio"  # gauge {deployment}: prefill / decode replicas
SCALING_DECISIONS_TOTAL = "pdfleet_scaling_decisions_total"  # counter {role, direction, reason}

WORKER_METRICS = (
    NUM_REQUESTS_WAITING,
    NUM_REQUESTS_RUNNING,
    KV_CACHE_USAGE,
    PROMPT_TOKENS_TOTAL,
    GENERATION_TOKENS_TOTAL,
    NUM_PREEMPTIONS_TOTAL,
    REQUEST_SUCCESS_TOTAL,
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    E2E_REQUEST_LATENCY,
    PROMPT_TOKENS_WAITING,
)
OPERATOR_METRICS = (POOL_REPLICAS, POOL_COST_PER_HOUR, DESIRED_REPLICAS, PD_RATIO, SCALING_DECISIONS_TOTAL)


# --- PromQL ----------------------------------------------------------------------------------------


def label_value(text: str) -> str:
    """`text` as a double-quoted PromQL string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


@dataclass(frozen=True)
class QueryProfile:
    """The PromQL the autoscaler runs for one engine kind, as templates over `$sel` and `$by`.

    `$sel` becomes the label matchers scoping a deployment (`namespace="x",pdfleet_deployment="y"`),
    `$by` the role label, `$cls` the accelerator label. Every role query answers one series per role;
    the `class_` queries one per (role, AcceleratorClass), the breakdown the autoscaler learns each
    class's throughput from. A template of None means the engine does not export that signal (the
    snapshot leaves it None; it is never read as zero).
    """

    name: str
    waiting: str
    running: str
    replicas: str
    sample_time: str
    kv_usage: str | None
    prompt_tokens_waiting: str | None
    prompt_tokens_rate: str | None
    generation_tokens_rate: str | None
    class_replicas: str | None = None
    class_waiting: str | None = None
    class_prompt_tokens_rate: str | None = None
    class_generation_tokens_rate: str | None = None
    deployment_label: str = LABEL_DEPLOYMENT
    namespace_label: str = LABEL_NAMESPACE
    role_label: str = LABEL_ROLE
    accelerator_label: str = LABEL_ACCELERATOR

    def selector(self, deployment: str, namespace: str) -> str:
        return f"{self.namespace_label}={label_value(namespace)},{self.deployment_label}={label_value(deployment)}"

    def render(self, template: str, deployment: str, namespace: str) -> str:
        return Template(template).substitute(
            sel=self.selector(deployment, namespace), by=self.role_label, cls=self.accelerator_label
        )

    def queries(self, deployment: str, namespace: str) -> dict[str, str]:
        """Snapshot field -> PromQL, for the signals this engine exports (`CLASS_FIELDS` by role and class)."""
        return {
            f: self.render(getattr(self, f), deployment, namespace)
            for f in ROLE_FIELDS + CLASS_FIELDS
            if getattr(self, f) is not None
        }


# QueryProfile fields answered by role (RoleMetrics), and by role and AcceleratorClass (ClassMetrics,
# named without the `class_` prefix).
ROLE_FIELDS = (
    "waiting",
    "running",
    "replicas",
    "sample_time",
    "kv_usage",
    "prompt_tokens_waiting",
    "prompt_tokens_rate",
    "generation_tokens_rate",
)
CLASS_FIELDS = ("class_replicas", "class_waiting", "class_prompt_tokens_rate", "class_generation_tokens_rate")


# The window of the token-rate queries; the autoscaler reads a rate as this long an average.
RATE_WINDOW_S = 60
_RATE_WINDOW = f"{RATE_WINDOW_S // 60}m"

# NOTE: the replica count and the sample age come from the waiting gauge because every engine exports
# it on every replica; `min(timestamp(...))` is the oldest replica's last scrape, so one stale replica
# makes the whole role stale rather than silently under-counting its queue.
_COMMON = dict(
    waiting=f"sum by ($by) ({NUM_REQUESTS_WAITING}{{$sel}})",
    running=f"sum by ($by) ({NUM_REQUESTS_RUNNING}{{$sel}})",
    replicas=f"count by ($by) ({NUM_REQUESTS_WAITING}{{$sel}})",
    sample_time=f"min by ($by) (timestamp({NUM_REQUESTS_WAITING}{{$sel}}))",
    prompt_tokens_rate=f"sum by ($by) (rate({PROMPT_TOKENS_TOTAL}{{$sel}}[{_RATE_WINDOW}]))",
    generation_tokens_rate=f"sum by ($by) (rate({GENERATION_TOKENS_TOTAL}{{$sel}}[{_RATE_WINDOW}]))",
    # NOTE: per class as well: a role spread over accelerators of different speed has no single
    # per-replica throughput (series without the accelerator label give no breakdown, not an error).
    class_replicas=f"count by ($by, $cls) ({NUM_REQUESTS_WAITING}{{$sel}})",
    class_waiting=f"sum by ($by, $cls) ({NUM_REQUESTS_WAITING}{{$sel}})",
    class_prompt_tokens_rate=f"sum by ($by, $cls) (rate({PROMPT_TOKENS_TOTAL}{{$sel}}[{_RATE_WINDOW}]))",
    class_generation_tokens_rate=f"sum by ($by, $cls) (rate({GENERATION_TOKENS_TOTAL}{{$sel}}[{_RATE_WINDOW}]))",
)

PROFILES: dict[str, QueryProfile] = {
    "pdfleet": QueryProfile(
        name="pdfleet",
        kv_usage=f"avg by ($by) ({KV_CACHE_USAGE}{{$sel}})",
        prompt_tokens_waiting=f"sum by ($by) ({PROMPT_TOKENS_WAITING}{{$sel}})",
        **_COMMON,
    ),
    # vLLM pods: the same names and target labels; no prompt-tokens-waiting gauge, and older vLLM
    # versions name the KV gauge gpu_cache_usage_perc.
    "vllm": QueryProfile(
        name="vllm",
        kv_usage=(f"avg by ($by) ({KV_CACHE_USAGE}{{$sel}} or {KV_CACHE_USAGE_LEGACY}{{$sel}})"),
        prompt_tokens_waiting=None,
        **_COMMON,
    ),
}


def target_labels(namespace: str, deployment: str, role: str, accelerator: str) -> dict[str, str]:
    """The target labels every worker's series carries, whatever its engine: what a PodMonitor relabels
    from the pod's labels, what `pdfleet up` writes in its file_sd targets, and what the direct-scrape
    source attaches to each scraped series (vLLM's own series carry only `engine` and `model_name`;
    the pdfleet worker's own `role`/`accelerator` labels are not part of this vocabulary)."""
    return {LABEL_NAMESPACE: namespace, LABEL_DEPLOYMENT: deployment, LABEL_ROLE: role, LABEL_ACCELERATOR: accelerator}


def profile_for(engines: Iterable[str]) -> QueryProfile:
    """The profile that reads a role whose pools run these engines (a deployment may mix engines).

    One engine: its profile. Several: a signal every engine queries the same way keeps its query; one
    that some engine does not export is None (a sum over part of the role's replicas would under-count
    it); one the engines query differently is read by the first query that answers (PromQL `or`:
    both are instant vectors by the same labels).
    """
    names = sorted(set(engines))
    unknown = [n for n in names if n not in PROFILES]
    if not names or unknown:
        raise ValueError(f"unknown metrics profile {unknown or names!r}; known: {', '.join(PROFILES)}")
    if len(names) == 1:
        return PROFILES[names[0]]
    profiles = [PROFILES[n] for n in names]
    merged: dict[str, str | None] = {}
    for f in ROLE_FIELDS + CLASS_FIELDS:
        templates = [getattr(p, f) for p in profiles]
        if any(t is None for t in templates):
            merged[f] = None
        elif len(set(templates)) == 1:
            merged[f] = templates[0]
        else:
            merged[f] = " or ".join(f"({t})" for t in dict.fromkeys(templates))
    assert merged["waiting"] and merged["running"] and merged["replicas"] and merged["sample_time"], (
        f"every profile reads the queue: {merged}"
    )
    return QueryProfile(name="+".join(names), **merged)  # type: ignore[arg-type]


# The series the direct-scrape source reads per engine (snapshot field -> names, the first one a replica
# exports wins), the scrape-side twin of PROFILES. A field an engine lacks is unknown for its role.
SCRAPED_SERIES: dict[str, dict[str, tuple[str, ...]]] = {
    "pdfleet": {
        "waiting": (NUM_REQUESTS_WAITING,),
        "running": (NUM_REQUESTS_RUNNING,),
        "kv_usage": (KV_CACHE_USAGE,),
        "prompt_tokens_waiting": (PROMPT_TOKENS_WAITING,),
        "prompt_tokens_total": (PROMPT_TOKENS_TOTAL,),
        "generation_tokens_total": (GENERATION_TOKENS_TOTAL,),
    },
    "vllm": {
        "waiting": (NUM_REQUESTS_WAITING,),
        "running": (NUM_REQUESTS_RUNNING,),
        "kv_usage": (KV_CACHE_USAGE, KV_CACHE_USAGE_LEGACY),
        "prompt_tokens_total": (PROMPT_TOKENS_TOTAL,),
        "generation_tokens_total": (GENERATION_TOKENS_TOTAL,),
    },
}
assert set(SCRAPED_SERIES) == set(PROFILES), "a scrape twin for every query profile"
