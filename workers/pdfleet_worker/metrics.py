"""Every metric the worker and the router export (vLLM-compatible names where vLLM has one), defined once; the server,
router and tests import it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

# NOTE: served as the classic text format whatever the Accept header says: prometheus_client
# >= 0.22 answers Prometheus' OpenMetrics Accept header with `:` escaped to `_`, which would turn
# `vllm:num_requests_waiting` into `vllm_num_requests_waiting` and break every vLLM dashboard.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# --- labels --------------------------------------------------------------------------------------
# The worker labels its own series with these; the scrape config adds pdfleet_deployment,
# pdfleet_role, pdfleet_accelerator and namespace as target labels, so none of those are used here.
LABEL_MODEL = "model_name"  # vLLM's label for the served model
LABEL_ROLE = "role"  # prefill | decode | both
LABEL_ACCELERATOR = "accelerator"  # the AcceleratorClass (or "cpu")
WORKER_LABELS = (LABEL_MODEL, LABEL_ROLE, LABEL_ACCELERATOR)
LABEL_FINISHED_REASON = "finished_reason"
LABEL_REASON = "reason"
LABEL_DIRECTION = "direction"  # sent | received
LABEL_CODE = "code"
LABEL_TIER = "tier"  # router: the deployment's tier; worker KV offload: host | disk
LABEL_UPSTREAM_ROLE = "upstream_role"  # prefill | decode | both (the router's view of a worker)
LABEL_STATE = "state"  # healthy | unhealthy
LABEL_ROUTE = "route"  # small | default (query routing: router/routing.py); prefill_pool | short_prompt (PD)
LABEL_REVISION = "revision"  # router: the pod template revision of the worker that answered
LABEL_SHED = "shed"  # router: true for the designed 503 + Retry-After load shedding

# vLLM's buckets, so its dashboards' histogram_quantile panels read the same.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
KV_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclasses.dataclass(frozen=True)
class MetricSpec:
    """One exported metric: its exposed name (counters end in _total), type, help, labels, buckets."""

    name: str
    type: str  # gauge | counter | histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        assert self.type in ("gauge", "counter", "histogram"), f"{self.name}: unknown type {self.type}"
        assert (self.type == "counter") == self.name.endswith("_total"), (
            f"{self.name}: counters and only counters end in _total"
        )
        assert (self.type == "histogram") == (self.buckets is not None), f"{self.name}: buckets iff histogram"

    @property
    def base_name(self) -> str:
        """The family name prometheus_client wants (a counter without its _total)."""
        return self.name[: -len("_total")] if self.type == "counter" else self.name


def _w(name: str, type_: str, help_: str, extra: tuple[str, ...] = (), buckets=None) -> MetricSpec:
    return MetricSpec(name, type_, help_, WORKER_LABELS + extra, buckets)


# --- worker: vLLM-compatible ---------------------------------------------------------------------
NUM_REQUESTS_WAITING = _w("vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled.")
NUM_REQUESTS_RUNNING = _w("vllm:num_requests_running", "gauge", "Requests in the running batch.")
KV_CACHE_USAGE = _w("vllm:kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks in use (1 = full).")
PROMPT_TOKENS_TOTAL = _w("vllm:prompt_tokens_total", "counter", "Prompt tokens computed (prefilled).")
GENERATION_TOKENS_TOTAL = _w("vllm:generation_tokens_total", "counter", "Tokens generated.")
NUM_PREEMPTIONS_TOTAL = _w("vllm:num_preemptions_total", "counter", "Sequences preempted (recomputed later).")
REQUEST_SUCCESS_TOTAL = _w(
    "vllm:request_success_total", "counter", "Finished requests by finish reason.", (LABEL_FINISHED_REASON,)
)
PREFIX_CACHE_QUERIES_TOTAL = _w(
    "vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache."
)
PREFIX_CACHE_HITS_TOTAL = _w("vllm:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.")
TIME_TO_FIRST_TOKEN = _w(
    "vllm:time_to_first_token_seconds", "histogram", "Time from arrival to the first token.", buckets=TTFT_BUCKETS
)
INTER_TOKEN_LATENCY = _w(
    "vllm:inter_token_latency_seconds", "histogram", "Time between consecutive tokens.", buckets=ITL_BUCKETS
)
E2E_REQUEST_LATENCY = _w(
    "vllm:e2e_request_latency_seconds", "histogram", "Time from arrival to finish.", buckets=REQUEST_LATENCY_BUCKETS
)
REQUEST_QUEUE_TIME = _w(
    "vllm:request_queue_time_seconds",
    "histogram",
    "Time from arrival to first scheduling.",
    buckets=REQUEST_LATENCY_BUCKETS,
)
REQUEST_PROMPT_TOKENS = _w(
    "vllm:request_prompt_tokens", "histogram", "Prompt length of finished requests.", buckets=TOKEN_COUNT_BUCKETS
)
REQUEST_GENERATION_TOKENS = _w(
    "vllm:request_generation_tokens", "histogram", "Generated tokens of finished requests.", buckets=TOKEN_COUNT_BUCKETS
)

# --- worker: PD transfer and admission (pdfleet only) --------------------------------------------
PROMPT_TOKENS_WAITING = _w(
    "pdfleet_prompt_tokens_waiting", "gauge", "Prompt tokens of requests waiting to be scheduled."
)
DEFERRED_PREFILLS_TOTAL = _w(
    "pdfleet_deferred_prefills_total",
    "counter",
    "Steps whose next waiting prompt was left whole for the next step rather than cut (partial prefill auto).",
)
NUM_REQUESTS_WAITING_FOR_REMOTE_KV = _w(
    "pdfleet_num_requests_waiting_for_remote_kv",
    "gauge",
    "Decode requests admitted and waiting for KV from a prefill worker.",
)
KV_BLOCKS_HELD = _w("pdfleet_kv_blocks_held", "gauge", "KV blocks held under a lease for a decode worker to pull.")
KV_LEASES_ACTIVE = _w("pdfleet_kv_leases_active", "gauge", "Prefilled requests whose KV is held under a lease.")
KV_LEASES_EXPIRED_TOTAL = _w(
    "pdfleet_kv_leases_expired_total", "counter", "Leases freed because no decode worker acked before they expired."
)
KV_LEASES_RELEASED_TOTAL = _w("pdfleet_kv_leases_released_total", "counter", "Leases freed by a decode worker's ack.")
KV_TRANSFER_SECONDS = _w(
    "pdfleet_kv_transfer_seconds", "histogram", "Duration of one KV pull (decode side).", buckets=KV_TRANSFER_BUCKETS
)
KV_TRANSFER_BYTES_TOTAL = _w(
    "pdfleet_kv_transfer_bytes_total", "counter", "KV bytes moved between workers.", (LABEL_DIRECTION,)
)
KV_TRANSFER_FAILURES_TOTAL = _w(
    "pdfleet_kv_transfer_failures_total", "counter", "KV pulls that failed or were refused, by reason.", (LABEL_REASON,)
)
ADMISSION_REJECTIONS_TOTAL = _w(
    "pdfleet_admission_rejections_total", "counter", "Requests refused at admission (503), by reason.", (LABEL_REASON,)
)

# --- worker: tiered KV offload and swap preemption (pdfleet only; zero when off) -----------------------
KV_OFFLOAD_HITS_TOTAL = _w(
    "pdfleet_kv_offload_hits_total",
    "counter",
    "Prefix-cache blocks loaded back into the device KV pool from an offload tier.",
    (LABEL_TIER,),
)
KV_OFFLOAD_RECOMPUTED_TOTAL = _w(
    "pdfleet_kv_offload_recomputed_total",
    "counter",
    "Prefix-cache blocks found in an offload tier but recomputed (loading would cost more).",
    (LABEL_TIER,),
)
KV_OFFLOAD_EVICTIONS_TOTAL = _w(
    "pdfleet_kv_offload_evictions_total",
    "counter",
    "Blocks an offload tier pushed out when full (host: to disk; disk: dropped).",
    (LABEL_TIER,),
)
KV_OFFLOAD_BYTES_TOTAL = _w(
    "pdfleet_kv_offload_bytes_total",
    "counter",
    "KV bytes written into (stored) or read back from (loaded) an offload tier.",
    (LABEL_TIER, LABEL_DIRECTION),
)
KV_OFFLOAD_USAGE = _w(
    "pdfleet_kv_offload_usage_perc",
    "gauge",
    "Fraction of an offload tier's blocks holding KV (1 = full).",
    (LABEL_TIER,),
)
KV_OFFLOAD_CAPACITY_BYTES = _w(
    "pdfleet_kv_offload_capacity_bytes", "gauge", "Size of an offload tier (0: off).", (LABEL_TIER,)
)
PREEMPTIONS_SWAPPED_TOTAL = _w(
    "pdfleet_preemptions_swapped_total", "counter", "Preemptions whose KV went to swap space (preemption swap)."
)
PREEMPTION_SWAP_FALLBACKS_TOTAL = _w(
    "pdfleet_preemption_swap_fallbacks_total",
    "counter",
    "Preemptions that wanted swap but found the swap space full: recomputed instead.",
)
SWAP_BYTES_TOTAL = _w(
    "pdfleet_swap_bytes_total",
    "counter",
    "KV bytes swapped out of (sent) and back into (received) the device.",
    (LABEL_DIRECTION,),
)
SWAP_SPACE_USAGE = _w("pdfleet_swap_space_usage_perc", "gauge", "Fraction of the swap space in use (1 = full).")
NUM_REQUESTS_SWAPPED = _w("pdfleet_num_requests_swapped", "gauge", "Preempted requests waiting in swap space.")
OFFLOAD_METRICS = (
    KV_OFFLOAD_HITS_TOTAL,
    KV_OFFLOAD_RECOMPUTED_TOTAL,
    KV_OFFLOAD_EVICTIONS_TOTAL,
    KV_OFFLOAD_BYTES_TOTAL,
    KV_OFFLOAD_USAGE,
    KV_OFFLOAD_CAPACITY_BYTES,
    PREEMPTIONS_SWAPPED_TOTAL,
    PREEMPTION_SWAP_FALLBACKS_TOTAL,
    SWAP_BYTES_TOTAL,
    SWAP_SPACE_USAGE,
    NUM_REQUESTS_SWAPPED,
)

WORKER_METRICS: tuple[MetricSpec, ...] = (
    NUM_REQUESTS_WAITING,
    NUM_REQUESTS_RUNNING,
    KV_CACHE_USAGE,
    PROMPT_TOKENS_TOTAL,
    GENERATION_TOKENS_TOTAL,
    NUM_PREEMPTIONS_TOTAL,
    REQUEST_SUCCESS_TOTAL,
    PREFIX_CACHE_QUERIES_TOTAL,
    PREFIX_CACHE_HITS_TOTAL,
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    E2E_REQUEST_LATENCY,
    REQUEST_QUEUE_TIME,
    REQUEST_PROMPT_TOKENS,
    REQUEST_GENERATION_TOKENS,
    PROMPT_TOKENS_WAITING,
    NUM_REQUESTS_WAITING_FOR_REMOTE_KV,
    KV_BLOCKS_HELD,
    KV_LEASES_ACTIVE,
    KV_LEASES_EXPIRED_TOTAL,
    KV_LEASES_RELEASED_TOTAL,
    KV_TRANSFER_SECONDS,
    KV_TRANSFER_BYTES_TOTAL,
    KV_TRANSFER_FAILURES_TOTAL,
    ADMISSION_REJECTIONS_TOTAL,
) + OFFLOAD_METRICS

# --- router --------------------------------------------------------------------------------------
ROUTER_REQUESTS_TOTAL = MetricSpec(
    "pdfleet_router_requests_total",
    "counter",
    "Client requests answered by the router, by HTTP code and tier (a stream that failed midway counts as 502).",
    (LABEL_CODE, LABEL_TIER),
)
ROUTER_REQUEST_DURATION = MetricSpec(
    "pdfleet_router_request_duration_seconds",
    "histogram",
    "Time from the client's request to the end of the response.",
    (LABEL_TIER,),
    REQUEST_LATENCY_BUCKETS,
)
ROUTER_TIME_TO_FIRST_TOKEN = MetricSpec(
    "pdfleet_router_time_to_first_token_seconds",
    "histogram",
    "Time from the client's request to the first streamed event it received.",
    (LABEL_TIER,),
    TTFT_BUCKETS,
)
ROUTER_UPSTREAM_ERRORS_TOTAL = MetricSpec(
    "pdfleet_router_upstream_errors_total",
    "counter",
    "Failed calls to workers, by worker role and reason.",
    (LABEL_UPSTREAM_ROLE, LABEL_REASON),
)
ROUTER_RETRIES_TOTAL = MetricSpec(
    "pdfleet_router_retries_total",
    "counter",
    "Calls retried on another worker before any byte reached the client.",
    (LABEL_UPSTREAM_ROLE,),
)
ROUTER_WORKERS = MetricSpec(
    "pdfleet_router_workers",
    "gauge",
    "Workers the router knows, by tier, role and health.",
    (LABEL_TIER, LABEL_UPSTREAM_ROLE, LABEL_STATE),
)
ROUTER_ROUTED_REQUESTS_TOTAL = MetricSpec(
    "pdfleet_router_routed_requests_total",
    "counter",
    "Requests judged by query routing: route small (sent to the smaller "
    "model's router) or default (served here), by the reason that decided.",
    (LABEL_ROUTE, LABEL_REASON),
)

ROUTER_LOCAL_PREFILLS_TOTAL = MetricSpec(
    "pdfleet_router_local_prefills_total",
    "counter",
    "PD requests sent straight to a decode worker, which computed the prompt itself, because no prefill worker "
    "was in rotation (a rollout or rollback replacing the prefill pool) or none of a decode worker's revision and "
    "KV layout: served, not failed, without PD's benefit.",
    (LABEL_TIER,),
)

ROUTER_PD_FALLBACKS_TOTAL = MetricSpec(
    "pdfleet_router_pd_fallbacks_total",
    "counter",
    "PD requests one role served whole, by why: no_prefill (no prefill worker in rotation: a decode worker "
    "computed the prompt), no_pair (no prefill worker of a decode worker's revision and KV layout: the same), "
    "no_decode (no decode worker in rotation, or every one failed before answering: a prefill worker decoded).",
    (LABEL_TIER, LABEL_REASON),
)

ROUTER_REVISION_REQUESTS_TOTAL = MetricSpec(
    "pdfleet_router_revision_requests_total",
    "counter",
    "Client requests by the pod template revision of the worker that answered (none: no worker did: none in "
    "rotation, a timeout, the router's own refusals), HTTP code, and shed (true: every worker tried answered 503 "
    "busy or draining, the router's designed load shedding). Rollback analysis reads the 5xx of the revision "
    "under test (and none) without shedding.",
    (LABEL_REVISION, LABEL_CODE, LABEL_SHED),
)

ROUTER_PD_ROUTES_TOTAL = MetricSpec(
    "pdfleet_router_pd_routes_total",
    "counter",
    "PD requests by the path chosen for them: prefill_pool (a prefill worker computed the prompt and handed its KV "
    "to a decode worker) or short_prompt (fewer prompt tokens than --pd-min-prompt-tokens: a decode worker "
    "computed the prompt itself, by design). Fallbacks are counted in pdfleet_router_pd_fallbacks_total.",
    (LABEL_TIER, LABEL_ROUTE),
)

ROUTER_METRICS: tuple[MetricSpec, ...] = (
    ROUTER_REQUESTS_TOTAL,
    ROUTER_REQUEST_DURATION,
    ROUTER_TIME_TO_FIRST_TOKEN,
    ROUTER_UPSTREAM_ERRORS_TOTAL,
    ROUTER_RETRIES_TOTAL,
    ROUTER_WORKERS,
    ROUTER_ROUTED_REQUESTS_TOTAL,
    ROUTER_LOCAL_PREFILLS_TOTAL,
    ROUTER_PD_FALLBACKS_TOTAL,
    ROUTER_PD_ROUTES_TOTAL,
    ROUTER_REVISION_REQUESTS_TOTAL,
)

ALL_METRICS: dict[str, MetricSpec] = {m.name: m for m in WORKER_METRICS + ROUTER_METRICS}
assert len(ALL_METRICS) == len(WORKER_METRICS) + len(ROUTER_METRICS), "metric names must be unique"


# --- building them ---------------------------------------------------------------------------------
def new_registry() -> CollectorRegistry:
    # NOTE: no `_created` series: they double every counter family and no dashboard reads them.
    import prometheus_client

    prometheus_client.disable_created_metrics()
    return CollectorRegistry(auto_describe=True)


def make(spec: MetricSpec, registry: CollectorRegistry):
    """A prometheus_client metric object for a spec whose values the caller sets or observes."""
    if spec.type == "counter":
        return Counter(spec.base_name, spec.help, spec.labels, registry=registry)
    if spec.type == "gauge":
        return Gauge(spec.base_name, spec.help, spec.labels, registry=registry)
    return Histogram(spec.name, spec.help, spec.labels, registry=registry, buckets=spec.buckets)


def family(spec: MetricSpec, labels: Iterable[str] | None = None):
    """A metric family for a custom collector (values read from a snapshot at scrape time)."""
    names = list(spec.labels if labels is None else labels)
    if spec.type == "counter":
        return CounterMetricFamily(spec.base_name, spec.help, labels=names)
    assert spec.type == "gauge", f"{spec.name}: only gauges and counters come from snapshots"
    return GaugeMetricFamily(spec.name, spec.help, labels=names)


def exposition(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


class SnapshotCollector(Collector):
    """Yields families built by `build()` at scrape time (engine gauges and cumulative counters)."""

    def __init__(self, build: Callable[[], list]):
        self._build = build

    def collect(self):
        return self._build()

    def describe(self):
        return []
