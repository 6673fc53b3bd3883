"""`InferenceDeployment`: the ML engineer's description of one served model as prefill and decode pools.

Namespaced. The operator reconciles it into worker Deployments per (role, AcceleratorClass), a
router, Services, PDBs and monitoring objects; `pdfleet up` runs the same spec as local processes
and `pdfleet simulate` plans it against a simulated cluster.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from pdfleet_operator.api.meta import (
    ApiModel,
    Condition,
    DnsLabel,
    Duration,
    ObjectMeta,
    Quantity,
    Resource,
    Rule,
    parse_duration,
)

Role = Literal["prefill", "decode", "colocated"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "colocated")
# What each role's worker is started with (`pdfleet worker --role ...`).
WORKER_ROLE: dict[str, str] = {"prefill": "prefill", "decode": "decode", "colocated": "both"}
# Per-replica queue targets when the spec leaves them out.
DEFAULT_TARGET_QUEUE: dict[str, float] = {"prefill": 4.0, "decode": 16.0, "colocated": 16.0}


def _or(path: str, default: object) -> str:
    """CEL for a field that the API server defaults: its value, or the default when absent."""
    head, _, leaf = path.rpartition(".")
    owner = f"self.{head}" if head else "self"
    return f"(has({owner}.{leaf}) ? {owner}.{leaf} : {default})"


# --- model -----------------------------------------------------------------------------------------


class PvcSource(ApiModel):
    """Weights on a PersistentVolumeClaim in the deployment's namespace."""

    claim_name: DnsLabel = Field(description="Name of the PersistentVolumeClaim.")
    path: str = Field(
        "",
        description="Directory inside the volume holding config.json and *.safetensors.",
        pattern=r"^[^/].*$|^$",
        max_length=1024,
    )


class HostPathSource(ApiModel):
    """Weights on the node's filesystem (pre-staged by the admin)."""

    path: str = Field(description="Absolute directory on the node.", pattern=r"^/.*$", max_length=1024)


class LocalSource(ApiModel):
    """Weights already inside the worker image, or on this machine for `pdfleet up`."""

    path: str = Field(
        description="Directory in the image (absolute) or, for `pdfleet up`, relative to the spec file.",
        min_length=1,
        max_length=1024,
    )


class ModelSource(ApiModel):
    """Where the weights come from; exactly one of pvc, hostPath, local."""

    pvc: PvcSource | None = Field(None, description="A PersistentVolumeClaim holding the model directory.")
    host_path: HostPathSource | None = Field(None, description="A directory on the node.")
    local: LocalSource | None = Field(None, description="A directory baked into the image or on this machine.")

    cel_rules: ClassVar = (
        Rule(
            rule="(has(self.pvc) ? 1 : 0) + (has(self.hostPath) ? 1 : 0) + (has(self.local) ? 1 : 0) == 1",
            message="exactly one of pvc, hostPath, local must be set",
        ),
    )


class ModelArchitecture(ApiModel):
    """The numbers placement needs to know whether a replica fits an accelerator (from config.json)."""

    parameters_billions: float = Field(
        gt=0, le=10000, description="Parameter count in billions (weights bytes = this x dtype bytes)."
    )
    layers: int = Field(ge=1, le=1024, description="Transformer layers (num_hidden_layers).")
    kv_heads: int = Field(ge=1, le=1024, description="Key/value heads (num_key_value_heads).")
    head_dim: int = Field(ge=1, le=1024, description="Dimension of one attention head.")


class ModelSpec(ApiModel):
    """The model this deployment serves."""

    name: str = Field(
        description="Served model name: what clients put in the OpenAI `model` field.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$",
        max_length=128,
    )
    source: ModelSource = Field(description="Where the Hugging Face model directory comes from.")
    max_model_len: int = Field(
        4096, ge=16, le=1048576, description="Longest prompt + output a request may have, in tokens."
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="Weights and activation dtype.")
    architecture: ModelArchitecture | None = Field(
        None,
        description="Size of the model for placement; `pdfleet up` reads it from config.json when omitted. "
        "Without it the operator cannot check that a replica fits and says so in a condition.",
    )


# --- engine ----------------------------------------------------------------------------------------


class KvTransferSpec(ApiModel):
    """How decode workers pull KV blocks from prefill workers."""

    timeout: Duration = Field("10s", description="Give up on one KV pull after this long.")
    lease: Duration = Field(
        "30s", description="How long a prefill worker holds blocks for a decode worker that has not acked."
    )
    on_failure: Literal["recompute", "fail"] = Field(
        "recompute", description="After a failed pull: recompute the prompt on the decode worker, or fail the request."
    )


class KvOffloadSpec(ApiModel):
    """Tiered KV offload (pdfleet engine): prefix-cache blocks the device pool evicts move to host RAM, blocks the
    host tier evicts to a memory-mapped file on an emptyDir; least recently used first in each tier. A later
    prefix hit copies them back instead of recomputing them, unless the engine's cost model says recomputing
    is cheaper (docs/engine.md, "Tiered KV offload")."""

    host_memory: Quantity | None = Field(
        None,
        description="Host RAM per worker for evicted blocks, e.g. 8Gi; added to the worker's memory request "
        "(and limit). Empty: no host tier. vLLM pools on a GPU class get --kv-offloading-size "
        "(its native CPU offload); vLLM has it on CUDA/XPU only and not next to a PD KV connector.",
    )
    disk: Quantity | None = Field(
        None,
        description="Size of the disk tier, e.g. 32Gi: a file in an emptyDir of this sizeLimit mounted at "
        "diskPath. Its pages are the node's page cache, charged to the pod like any file it "
        "writes. Empty: no disk tier. pdfleet engine only.",
    )
    disk_path: str = Field(
        "/var/cache/pdfleet/kv",
        pattern=r"^/[A-Za-z0-9._/-]+$",
        max_length=256,
        description="Where the disk tier's emptyDir is mounted in the worker container.",
    )

    @field_validator("disk_path")
    @classmethod
    def _own_mount(cls, path: str) -> str:
        norm = "/" + "/".join(p for p in path.split("/") if p)
        if norm in ("/", "/tmp", "/dev", "/dev/shm", "/etc", "/models") or ".." in path.split("/"):
            raise ValueError(f"Invalid value: {path!r} is used by the pod itself; pick a directory of its own")
        return path

    cel_rules: ClassVar = (
        Rule(
            rule="has(self.hostMemory) || has(self.disk)",
            message="kvOffload needs hostMemory, disk or both",
            field_path=".hostMemory",
        ),
    )
    # NOTE: absent means no offload; the CRD must not default it into an empty (refused) object.
    absent_is_unset: ClassVar = True


class VllmEngineSpec(ApiModel):
    """Settings only vLLM pools read (spec.engine.runtime vllm, or a class whose default is vllm)."""

    image: str | None = Field(
        None,
        description="vLLM image for every pool of this deployment; empty: each "
        "AcceleratorClass's spec.runtimes.vllm.image (the vendor's build).",
        min_length=1,
        max_length=512,
    )
    kv_connector: str | None = Field(
        None,
        description="KV connector for prefill/decode pools; empty: the classes' spec.runtimes.vllm.kvConnector.",
        pattern=r"^[A-Za-z][A-Za-z0-9_]*$",
        max_length=64,
    )
    extra_args: list[str] = Field(
        default_factory=list, description="Extra flags appended to `vllm serve`.", max_length=64
    )

    # NOTE: absent means "no vLLM settings" (a CEL rule refuses them next to runtime pdfleet): the CRD must not
    # default it to {} as it does other optional objects whose fields all have defaults.
    absent_is_unset: ClassVar = True


class EngineSpec(ApiModel):
    """The engine every pool runs and its settings: `pdfleet worker` flags, or `vllm serve` flags for vLLM pools."""

    runtime: Literal["pdfleet", "vllm"] | None = Field(
        None,
        description="The engine: pdfleet (the pdfleet worker) or vllm (vLLM or the vendor's build of it, "
        "from the AcceleratorClass). Empty: each class's spec.runtimes.default. Prefill and "
        "decode must run the same engine; vLLM needs every class to offer it (spec.runtimes.vllm); "
        "a class with count > 1 needs vLLM (tensor parallelism over the count).",
    )
    image: str | None = Field(
        None,
        description="pdfleet worker image for every pool (a class's spec.runtimes.pdfleet.image overrides it): "
        "a build for the platform of each class it runs on (an image tagged -<platform> for "
        "another platform is refused). Empty: the operator's default for each class's platform "
        "(its --worker-image PLATFORM=IMAGE, the chart's workerImage).",
        min_length=1,
        max_length=512,
    )
    block_size: int = Field(16, ge=1, le=256, description="Tokens per KV cache block.")
    kv_cache_memory_fraction: float = Field(
        0.85, gt=0, le=1, description="Fraction of device memory left after weights that the KV cache may use."
    )
    max_num_seqs: int = Field(256, ge=1, le=65536, description="Most sequences running in one batch.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, le=1048576, description="Token budget of one engine step (chunked prefill splits longer prompts)."
    )
    max_waiting_requests: int = Field(
        1024, ge=1, le=1048576, description="Admission limit: more waiting requests are answered 503 with Retry-After."
    )
    kv_cache_dtype: Literal["auto", "int8"] = Field(
        "auto", description="KV cache element type; int8 halves KV memory with per-block scales."
    )
    quantization: Literal["none", "int8"] = Field(
        "none",
        description="Weights: none (the checkpoint's, in model.dtype) or int8: weight-only INT8 per output "
        "channel, quantized from the normal (float) checkpoint when the worker loads it; the "
        "linear layers and the LM head take 1 byte per parameter (more room for KV, faster "
        "memory-bound decode), embeddings, norms, activations and KV stay in model.dtype. "
        "pdfleet engine only: vLLM has no weight-only INT8 for an unquantized checkpoint "
        "(serve a pre-quantized checkpoint through vllm.extraArgs instead).",
    )
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of identical prompt prefixes.")
    kv_transfer: KvTransferSpec = Field(
        default_factory=KvTransferSpec, description="KV transfer between prefill and decode."
    )
    kv_offload: KvOffloadSpec | None = Field(
        None,
        description="Tiered KV offload of evicted prefix-cache blocks to host RAM and disk. Empty: evicted "
        "blocks are dropped. Needs enablePrefixCaching.",
    )
    preemption: Literal["recompute", "swap"] = Field(
        "recompute",
        description="A running sequence preempted for want of KV blocks: recompute its KV when it is "
        "rescheduled, or swap its blocks to host RAM (swapSpace) and back; when the swap "
        "space is full it is recomputed (counted in pdfleet_preemption_swap_fallbacks_total). "
        "swap: pdfleet engine only (vLLM V1 always recomputes).",
    )
    swap_space: Quantity = Field(
        "1Gi",
        description="Host RAM per worker for swapped-out sequences (preemption swap); "
        "added to the worker's memory request then.",
    )
    shm_size: Quantity = Field("1Gi", description="Size of the /dev/shm volume of worker pods.")
    extra_args: list[str] = Field(
        default_factory=list, description="Extra flags appended to the pdfleet worker command line.", max_length=64
    )
    vllm: VllmEngineSpec | None = Field(None, description="Settings only vLLM pools read.")

    cel_rules: ClassVar = (
        Rule(
            rule="!has(self.runtime) || self.runtime != 'pdfleet' || !has(self.vllm)",
            message="vllm settings need runtime vllm (or empty, for classes whose default is vllm)",
            field_path=".vllm",
        ),
        Rule(
            rule=(
                "!has(self.runtime) || self.runtime != 'vllm' || !has(self.kvCacheDtype) || self.kvCacheDtype != 'int8'"
            ),
            message="kvCacheDtype int8 is the pdfleet engine's; vLLM pools take auto",
            field_path=".kvCacheDtype",
        ),
        Rule(
            rule=(
                "!has(self.runtime) || self.runtime != 'vllm' || !has(self.quantization) || self.quantization == 'none'"
            ),
            message="quantization int8 is the pdfleet engine's (quantized at load); vLLM pools take none",
            field_path=".quantization",
        ),
        Rule(
            rule="!has(self.runtime) || self.runtime != 'vllm' || !has(self.preemption) || self.preemption != 'swap'",
            message="preemption swap is the pdfleet engine's; vLLM (V1) always recomputes",
            field_path=".preemption",
        ),
        Rule(
            rule="!has(self.runtime) || self.runtime != 'vllm' || !has(self.kvOffload) || !has(self.kvOffload.disk)",
            message="the disk tier is the pdfleet engine's; vLLM offloads to host memory only (hostMemory)",
            field_path=".kvOffload.disk",
        ),
        Rule(
            rule="!has(self.kvOffload) || !has(self.enablePrefixCaching) || self.enablePrefixCaching",
            message="kvOffload keeps evicted prefix-cache blocks: it needs enablePrefixCaching",
            field_path=".kvOffload",
        ),
        Rule(
            rule=f"{_or('maxNumBatchedTokens', 2048)} >= {_or('maxNumSeqs', 256)}",
            message="maxNumBatchedTokens must be at least maxNumSeqs (every running sequence needs a token per step)",
            field_path=".maxNumBatchedTokens",
        ),
    )


# --- roles -----------------------------------------------------------------------------------------


class Resources(ApiModel):
    """CPU/memory requests and limits for a container (accelerators come from the AcceleratorClass)."""

    requests: dict[str, Quantity] = Field(default_factory=dict, description="Requests, e.g. {cpu: '4', memory: 32Gi}.")
    limits: dict[str, Quantity] = Field(default_factory=dict, description="Limits, e.g. {memory: 48Gi}.")


class RoleSpec(ApiModel):
    """One pool role: where it may run and how far it may scale."""

    accelerator_classes: list[DnsLabel] = Field(
        min_length=1,
        max_length=16,
        description="AcceleratorClass names this role may use, in order of preference (ties are broken by this order).",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    min_replicas: int = Field(1, ge=0, le=10000, description="Fewest replicas of this role across all its classes.")
    max_replicas: int = Field(4, ge=1, le=10000, description="Most replicas of this role across all its classes.")
    target_queue_per_replica: float | None = Field(
        None,
        gt=0,
        le=100000,
        description="Queue each replica should carry: waiting requests for prefill (default 4), running + waiting "
        "requests for decode and colocated (default 16).",
    )
    target_prompt_tokens_per_replica: int | None = Field(
        None,
        ge=1,
        description="Prefill only: waiting prompt tokens per replica; scales on whichever target needs more.",
    )
    resources: Resources = Field(default_factory=Resources, description="CPU/memory of each worker container.")

    @field_validator("accelerator_classes")
    @classmethod
    def _unique(cls, names: list[str]) -> list[str]:
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"Duplicate value: {', '.join(dupes)} listed more than once")
        return names

    cel_rules: ClassVar = (
        Rule(
            rule=f"{_or('minReplicas', 1)} <= {_or('maxReplicas', 4)}",
            message="minReplicas must be less than or equal to maxReplicas",
            field_path=".minReplicas",
        ),
    )


# --- policies --------------------------------------------------------------------------------------


class RatioBounds(ApiModel):
    """Bounds on prefill replicas / decode replicas."""

    min: float = Field(0.125, gt=0, le=1000, description="Lowest allowed prefill:decode replica ratio.")
    max: float = Field(8.0, gt=0, le=1000, description="Highest allowed prefill:decode replica ratio.")

    cel_rules: ClassVar = (
        Rule(
            rule=f"{_or('min', 0.125)} <= {_or('max', 8.0)}",
            message="min must be less than or equal to max",
            field_path=".min",
        ),
    )


class AutoscalingSpec(ApiModel):
    """How the operator sets replicas per role from queue metrics."""

    enabled: bool = Field(True, description="Scale roles from metrics; when false every role runs minReplicas.")
    prometheus_url: str | None = Field(
        None,
        pattern=r"^https?://[^\s]+$",
        max_length=2048,
        description="Prometheus to query; empty uses the operator's default (or scrapes workers directly).",
    )
    interval: Duration = Field("15s", description="How often to decide.")
    tolerance: float = Field(0.1, ge=0, lt=1, description="Relative deviation from target ignored, as in the HPA.")
    scale_up_stabilization: Duration = Field(
        "0s", description="Window over which scale-up recommendations are smoothed."
    )
    scale_down_stabilization: Duration = Field(
        "300s", description="Window over which the highest recommendation wins before scaling down."
    )
    scale_down_delay_after_scale_up: Duration = Field(
        "60s", description="Grace period after a role scales up before it may scale down."
    )
    max_scale_up_step: int = Field(4, ge=1, le=10000, description="Most replicas added to one role per interval.")
    max_scale_down_step: int = Field(1, ge=1, le=10000, description="Most replicas removed from one role per interval.")
    metrics_max_age: Duration = Field("60s", description="Older samples count as missing (the size is held).")
    target_utilization: float = Field(
        0.7,
        gt=0,
        le=1,
        description="Share of a replica's measured saturated token throughput each role is sized to run at "
        "(the rest is headroom for a burst while new replicas start).",
    )
    drain_time: Duration = Field(
        "60s",
        description="Once prefill's saturated throughput is measured, the prompt tokens queued at it are sized "
        "to drain within this long, on top of the arrivals, for prefill and for what they will make "
        "decode generate; prefill's targetQueuePerReplica and targetPromptTokensPerReplica then "
        "apply only until a throughput is measured.",
    )
    drained_scale_down_stabilization: Duration = Field(
        "30s",
        description="The scale-down window instead of scaleDownStabilization while a role has nothing waiting "
        "and its served token rate has fallen well below its peak of the last "
        "scaleDownStabilization (the end of a burst).",
    )
    pd_ratio: RatioBounds = Field(default_factory=RatioBounds, description="Bounds on the prefill:decode ratio.")


class SloSpec(ApiModel):
    """Latency targets (p99) the placement tier and dashboards measure against."""

    ttft: Duration = Field("2s", description="Time to first token, p99.")
    itl: Duration = Field("100ms", description="Inter-token latency, p99.")


class RollbackSpec(ApiModel):
    """Automated rollback of a new revision whose 5xx ratio stays too high."""

    enabled: bool = Field(True, description="Roll back automatically.")
    error_ratio_threshold: float = Field(
        0.01, gt=0, le=1, description="5xx responses / all responses above which a revision is failing."
    )
    window: Duration = Field(
        "1m",
        description="Window the ratio is measured over. Keep it shorter than `for`: a burst of errors stays in "
        "the ratio for one window after it ends, so a burst shorter than for - window never rolls back.",
    )
    for_: Duration = Field("2m", alias="for", description="How long the ratio must stay above the threshold.")
    min_requests: int = Field(
        20, ge=0, description="Fewer requests in the window is inconclusive, neither healthy nor failing."
    )
    soak_time: Duration = Field("10m", description="A revision serving this long with a healthy ratio becomes stable.")
    revision_history_limit: int = Field(
        10,
        ge=1,
        le=100,
        description=(
            "Superseded revisions kept as ControllerRevisions (the served one is recorded on the engine ConfigMap)."
        ),
    )


class NetworkPeer(ApiModel):
    """A source allowed to reach the router: a namespace (all its pods, or those with podLabels) or an IP range."""

    namespace: DnsLabel | None = Field(None, description="Pods of this namespace (with podLabels: only those).")
    pod_labels: dict[str, str] = Field(default_factory=dict, description="With namespace: only pods with these labels.")
    cidr: str | None = Field(
        None,
        description="Clients in this IP range, e.g. 10.0.0.0/8.",
        pattern=r"^[0-9a-fA-F.:]+/[0-9]{1,3}$",
        max_length=64,
    )

    cel_rules: ClassVar = (
        Rule(
            rule="has(self.namespace) != has(self.cidr)",
            message="name exactly one of namespace and cidr",
            field_path=".namespace",
        ),
        Rule(
            rule="!has(self.podLabels) || size(self.podLabels) == 0 || has(self.namespace)",
            message="podLabels needs namespace",
            field_path=".podLabels",
        ),
    )


class RouterSpec(ApiModel):
    """The router in front of the pools (the deployment's endpoint)."""

    replicas: int = Field(
        2,
        ge=1,
        le=100,
        description="Router replicas, spread across nodes with a PodDisruptionBudget "
        "(one at a time goes): the request path has no single pod.",
    )
    allow_from: list[NetworkPeer] = Field(
        default_factory=list,
        max_length=32,
        description="Who may reach the router (its NetworkPolicy); empty: any source. Workers accept traffic only "
        "from this deployment's router and workers and from the operator's scraper namespaces.",
    )
    image: str | None = Field(None, min_length=1, max_length=512, description="Router image; defaults to engine.image.")
    resources: Resources = Field(
        # (a default, not a default_factory: the CRD carries it, so the API server fills in what the operator reads)
        Resources(requests={"cpu": "1", "memory": "512Mi"}, limits={"memory": "1Gi"}),
        description="CPU/memory of each router container (requested, so the router is never the first pod evicted "
        "under node pressure).",
    )
    heartbeat_interval: Duration = Field(
        "10s",
        description="A streaming request that waits this long for its next event (queued, prefilling, KV in "
        "flight, a prefill hand-off) gets an SSE comment `: keep-alive`, and again each interval, "
        "so proxies with idle timeouts keep long-TTFT streams open; OpenAI clients skip comments. "
        "Router and pdfleet workers both send them; 0s: never. A stream's status code waits for "
        "its first token up to one interval, so a fast error keeps its code.",
    )
    pd_min_prompt_tokens: int | None = Field(
        None,
        ge=0,
        le=1048576,
        description="Disaggregated deployments: a request whose prompt has fewer tokens skips the prefill pool and a "
        "decode worker computes the prompt itself (PD buys nothing for a short prompt and pays the KV hand-off). "
        "Unset: the cost model's threshold for the classes the roles list (no slower to the first token, and the "
        "decode step that takes the prompt in still meets slo.itl); 0: every request goes through the prefill "
        "pool. The router counts the prompt with the model's tokenizer when it has one (--route-tokenizer), else "
        "estimates 4 characters per token.",
    )


class RoutingRules(ApiModel):
    """What makes a request simple: every rule that is set must hold."""

    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="At most this many prompt tokens (the model's tokenizer, in the router; a chat "
        "request: its messages' text, without the chat template).",
    )
    max_prompt_chars: int | None = Field(None, ge=1, description="At most this many prompt characters.")
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="The request sets max_tokens (or max_completion_tokens) to at most this; a request "
        "that sets neither is not simple.",
    )
    patterns: list[str] = Field(
        default_factory=list,
        max_length=32,
        description="The prompt matches at least one of these regular expressions (Python `re`, searched anywhere).",
        json_schema_extra={"items": {"type": "string", "maxLength": 1024}},
    )
    exclude_patterns: list[str] = Field(
        default_factory=list,
        max_length=32,
        description="The prompt matches none of these regular expressions.",
        json_schema_extra={"items": {"type": "string", "maxLength": 1024}},
    )

    @field_validator("patterns", "exclude_patterns")
    @classmethod
    def _compiles(cls, patterns: list[str]) -> list[str]:
        for i, pattern in enumerate(patterns):
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"Invalid value: [{i}] {pattern!r} is not a valid regular expression: {e}") from None
        return patterns


class RoutingClassifier(ApiModel):
    """A function the router calls for requests that passed the rules: `f(RouteRequest) -> float`, the confidence in
    [0, 1] that the request is simple (docs/serving.md, "Query routing")."""

    entry_point: str = Field(
        description="module:function importable in the router's image, e.g. "
        "pdfleet_worker.router.classifiers:short_question.",
        pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$",
        max_length=256,
    )
    timeout: Duration = Field(
        "1s", description="Longest a call may take; a slower one sends the request to this deployment."
    )


class RoutingSpec(ApiModel):
    """Query routing: requests judged simple go to a cheaper InferenceDeployment's router (its answer, its model);
    everything else, and whatever the target refuses or cannot take, is served by this deployment's pools."""

    target: DnsLabel = Field(description="The InferenceDeployment (same namespace) that serves simple requests.")
    rules: RoutingRules = Field(default_factory=RoutingRules, description="What makes a request simple.")
    classifier: RoutingClassifier | None = Field(None, description="Asked after the rules hold.")
    confidence_floor: float = Field(
        0.5, ge=0, le=1, description="A classifier confidence below this is served by this deployment."
    )

    cel_rules: ClassVar = (
        Rule(
            rule="has(self.classifier) || (has(self.rules) && (has(self.rules.maxPromptTokens) || "
            "has(self.rules.maxPromptChars) || has(self.rules.maxTokens) || "
            "(has(self.rules.patterns) && size(self.rules.patterns) > 0) || "
            "(has(self.rules.excludePatterns) && size(self.rules.excludePatterns) > 0)))",
            message="set at least one rule or a classifier: without either every request would go to the target",
            field_path=".rules",
        ),
    )


class RolloutSpec(ApiModel):
    """How a pool moves to a new pod template (an image, engine or class change, a rollback)."""

    allow_unavailable: bool = Field(
        False,
        description="Let a pool roll by taking its only ready replica down when there is no room for a surge "
        "replica on its class nor a bridge replica on another class the role allows (a brief outage "
        "per rollout). false: such a rollout waits, with RolloutBlocked=True saying why.",
    )


class InferenceDeploymentSpec(ApiModel):
    """A served model, its pools, and the policies that size and guard them."""

    model: ModelSpec = Field(description="The model to serve.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Worker engine settings.")
    disaggregation: bool = Field(
        True, description="Separate prefill and decode pools (true) or one colocated pool (false)."
    )
    prefill: RoleSpec | None = Field(None, description="The prefill pool (disaggregation: true).")
    decode: RoleSpec | None = Field(None, description="The decode pool (disaggregation: true).")
    colocated: RoleSpec | None = Field(None, description="The single pool doing both phases (disaggregation: false).")
    tier: Literal["latency", "cost"] = Field(
        "cost",
        description="latency: the fastest accelerators that meet the SLO; cost: the cheapest that still meet it.",
    )
    slo: SloSpec = Field(default_factory=SloSpec, description="Latency targets.")
    autoscaling: AutoscalingSpec = Field(
        default_factory=AutoscalingSpec, description="Replica autoscaling from queue metrics."
    )
    rollback: RollbackSpec = Field(default_factory=RollbackSpec, description="Automated rollback on 5xx.")
    router: RouterSpec = Field(default_factory=RouterSpec, description="The router in front of the pools.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="How pools move to a new pod template.")
    routing: RoutingSpec | None = Field(
        None, description="Send requests judged simple to a smaller model's InferenceDeployment (query routing)."
    )

    cel_rules: ClassVar = (
        Rule(
            rule=f"{_or('disaggregation', 'true')} ? (has(self.prefill) && has(self.decode) && !has(self.colocated))"
            " : (has(self.colocated) && !has(self.prefill) && !has(self.decode))",
            message="with disaggregation true set prefill and decode (not colocated); with false set colocated only",
        ),
        Rule(
            rule="!has(self.router) || !has(self.router.pdMinPromptTokens) || self.router.pdMinPromptTokens == 0 || "
            f"{_or('disaggregation', 'true')}",
            message="router.pdMinPromptTokens applies to disaggregated deployments (disaggregation: true) only; "
            "0 (nothing skips the prefill pool) is accepted everywhere",
        ),
        Rule(
            rule="(!has(self.decode) || !has(self.decode.targetPromptTokensPerReplica)) && "
            "(!has(self.colocated) || !has(self.colocated.targetPromptTokensPerReplica))",
            message="targetPromptTokensPerReplica applies to the prefill role only",
        ),
    )

    def roles(self) -> dict[str, RoleSpec]:
        """The pools this spec asks for, by role."""
        if self.disaggregation:
            assert self.prefill and self.decode, "validated spec without prefill/decode"
            return {"prefill": self.prefill, "decode": self.decode}
        assert self.colocated, "validated spec without colocated"
        return {"colocated": self.colocated}

    def target_queue(self, role: str) -> float:
        spec = self.roles()[role]
        return spec.target_queue_per_replica or DEFAULT_TARGET_QUEUE[role]

    def interval_seconds(self) -> float:
        return parse_duration(self.autoscaling.interval)


# --- status ----------------------------------------------------------------------------------------


class PoolStatus(ApiModel):
    """One pool: a role on one AcceleratorClass."""

    name: str = Field(description="Name of the pool's Deployment.")
    role: Role = Field(description="prefill, decode or colocated.")
    accelerator_class: str = Field(description="The AcceleratorClass the pool runs on.")
    desired: int = Field(ge=0, description="Replicas the operator asks for.")
    ready: int = Field(0, ge=0, description="Replicas ready to serve.")
    cost_per_hour: float = Field(0.0, ge=0, description="desired x class price, USD per hour.")


class ScalingDecisionStatus(ApiModel):
    """The autoscaler's last change (or hold) and why."""

    time: dt.datetime = Field(description="When it was decided.", json_schema_extra={"format": "date-time"})
    role: Role = Field(description="The role it applies to.")
    from_replicas: int = Field(ge=0, description="Replicas before.")
    to_replicas: int = Field(ge=0, description="Replicas after.")
    reason: str = Field(description="Machine-readable reason, e.g. QueueAboveTarget, RatioBound, MetricsUnavailable.")
    message: str = Field("", description="Human-readable detail.")


class InferenceDeploymentStatus(ApiModel):
    """What the operator did and observed."""

    observed_generation: int | None = Field(None, ge=0, description="The .metadata.generation last reconciled.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Ready, Progressing, Degraded, MetricsAvailable, ScalingLimited, RolledBack, PlacementDrift, "
        "RolloutBlocked.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    pools: list[PoolStatus] = Field(default_factory=list, description="Pools by role and accelerator.")
    prefill_replicas: int | None = Field(None, ge=0, description="Desired prefill replicas over all classes.")
    decode_replicas: int | None = Field(
        None, ge=0, description="Desired decode (or colocated) replicas over all classes."
    )
    pd_ratio: str | None = Field(None, description="Prefill:decode replicas, e.g. '1:2' ('-' when colocated).")
    cost_per_hour: float | None = Field(None, ge=0, description="All pools and the router, USD per hour.")
    endpoint: str | None = Field(None, description="URL of the router Service (OpenAI API base).")
    last_scaling_decision: ScalingDecisionStatus | None = Field(None, description="The autoscaler's last decision.")
    current_revision: int | None = Field(None, ge=0, description="Revision of the pod template being served.")
    stable_revision: int | None = Field(None, ge=0, description="Last revision that passed its soak.")
    failed_revision: int | None = Field(
        None, ge=0, description="Revision rolled back and not re-applied until the spec changes."
    )
    worker_image: str | None = Field(
        None,
        description="The pdfleet worker (and router) image of the served revision's pools whose class names "
        "none: spec.engine.image, else the operator's defaults per platform (--worker-image "
        "PLATFORM=IMAGE, listed as platform=image).",
    )
    token_secret: str | None = Field(
        None,
        description="The deployment token's Secret, once the operator made (or found) it: a restarted operator "
        "does not create it again. To rotate: delete the Secret, then annotate the CR "
        "pdfleet.io/recreate-token=1.",
    )


class InferenceDeployment(Resource):
    """A whole InferenceDeployment object as stored by the API server."""

    api_version: Literal["pdfleet.io/v1alpha1"] = "pdfleet.io/v1alpha1"
    kind: Literal["InferenceDeployment"] = "InferenceDeployment"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: InferenceDeploymentSpec
    status: InferenceDeploymentStatus | None = None

    name_rule: ClassVar = (40, r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    cel_rules: ClassVar = (
        Rule(
            rule="!has(self.spec.routing) || self.spec.routing.target != self.metadata.name",
            message="a deployment cannot route to itself: name another InferenceDeployment",
            field_path=".spec.routing.target",
        ),
    )
    name_rule_why: ClassVar = "a DNS label starting with a letter, short enough to prefix its pools' names"

    @property
    def name(self) -> str:
        assert self.metadata.name, "InferenceDeployment without metadata.name"
        return self.metadata.name
