"""`AcceleratorClass`: the cluster admin's description of one kind of accelerator, its capacity and its price.

Cluster-scoped, like a StorageClass. Placement (which pools go where), the cost model ($/h, $ per 1M
tokens) and the simulator all read these numbers; the renderer reads how a pod asks for the device.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from pdfleet_operator.api.meta import (
    DNS_LABEL_PATTERN,
    ENV_NAME_PATTERN,
    RESOURCE_NAME_PATTERN,
    ApiModel,
    Condition,
    ObjectMeta,
    Resource,
    Rule,
)

Vendor = Literal["nvidia", "amd", "intel", "huawei", "cambricon", "hygon", "kunlunxin", "moorethreads", "cpu"]
# The engines a pool can run (`spec.runtimes` here, `spec.engine.runtime` on an InferenceDeployment).
RuntimeName = Literal["pdfleet", "vllm"]
# The torch device the pdfleet worker computes on (`pdfleet worker --device`).
TorchDevice = Literal["cpu", "cuda", "npu", "mlu", "xpu"]


class Toleration(ApiModel):
    """A pod toleration (core/v1 Toleration) added to workers on this class, e.g. for tainted GPU nodes."""

    key: str | None = Field(
        None, description="Taint key the toleration applies to; empty with operator Exists matches all."
    )
    operator: Literal["Exists", "Equal"] = Field("Equal", description="Exists or Equal.")
    value: str | None = Field(None, description="Taint value to match when operator is Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        None, ge=0, description="How long a NoExecute-tainted pod stays bound; empty means forever."
    )

    cel_rules: ClassVar = (
        Rule(
            rule="self.operator != 'Exists' || !has(self.value)",
            message="value must be empty when operator is Exists",
            field_path=".value",
        ),
    )


class EnvVar(ApiModel):
    """A plain environment variable for the worker container."""

    name: str = Field(
        description="Variable name. Not a device-visibility variable (*_VISIBLE_DEVICES): the vendor's "
        "device plugin sets those from the devices it allocates to each pod.",
        pattern=ENV_NAME_PATTERN,
        max_length=256,
    )
    value: str = Field("", description="Variable value.")

    cel_rules: ClassVar = (
        Rule(
            rule="!self.name.endsWith('_VISIBLE_DEVICES')",
            message="the device plugin sets *_VISIBLE_DEVICES from the devices it allocates to each pod; a fixed "
            "value would point every replica at one device",
            field_path=".name",
        ),
    )


class Partition(ApiModel):
    """How this class is a slice of a bigger device (NVIDIA MIG, vGPU, ...)."""

    type: Literal["mig"] = Field(
        description="Partitioning technology: mig (NVIDIA Multi-Instance GPU, a slice with "
        "its own memory). vGPU and time-slicing are not supported: a shared "
        "card's KV cache would be sized from the whole card's memory."
    )
    profile: str = Field(
        description="Profile name as the device plugin names it, e.g. 3g.40gb or 1g.10gb.",
        pattern=r"^[0-9a-z.+-]+$",
        max_length=63,
    )
    parent_class: str | None = Field(
        None,
        description="The AcceleratorClass of the whole device this is carved from (informational).",
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        max_length=63,
    )


class PdfleetRuntime(ApiModel):
    """How the pdfleet worker runs on this class."""

    image: str | None = Field(
        None,
        description="The pdfleet worker image for this class: a build whose torch drives this class's "
        "accelerators (`make images` tags them <repository>:<version>-<platform>: cpu, cuda, and "
        "the vendors' builds npu (torch_npu), mlu (torch_mlu), dtk (Hygon DTK's torch)). Empty: the "
        "InferenceDeployment's spec.engine.image, else the operator's default for the class's "
        "platform (--worker-image PLATFORM=IMAGE). An image whose tag names another platform is "
        "refused, as is a class with no image for its platform.",
        min_length=1,
        max_length=512,
    )

    device: TorchDevice | None = Field(
        None,
        description="The torch device the worker computes on (`pdfleet worker --device`). Empty: from the "
        "vendor (nvidia and hygon: cuda, the DTK torch is CUDA-compatible; huawei: npu through "
        "torch_npu; cambricon: mlu through torch_mlu; intel: xpu; cpu: cpu). A vendor without a "
        "PyTorch bridge (kunlunxin, amd, moorethreads) has no default: the pdfleet worker is not "
        "offered on it until this is set.",
    )
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment for pdfleet workers on this class.")


class VllmRuntime(ApiModel):
    """How vLLM, or the vendor's build of it (vLLM-Ascend, vllm-kunlun, Cambricon's and Hygon's vLLM), runs on this
    class."""

    image: str = Field(
        description="Image with vLLM for this device, e.g. vllm/vllm-openai:v0.11.0 (NVIDIA) or "
        "quay.io/ascend/vllm-ascend:v0.11.0rc0 (Ascend). Its `vllm` command serves the model.",
        min_length=1,
        max_length=512,
    )
    kv_connector: str | None = Field(
        None,
        description="vLLM KV connector a prefill/decode pool on this class uses (`--kv-transfer-config`), by the "
        "name the class's vLLM build registers it under: upstream vLLM's NixlConnector (its default) "
        "or MooncakeConnector, vLLM-Ascend's MooncakeConnectorV1 (its default). Empty: the build's "
        "default. Prefill and decode must use one connector of one build.",
        pattern=r"^[A-Za-z][A-Za-z0-9_]*$",
        max_length=64,
    )
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment for vLLM pods on this class.")


class HostPathSource(ApiModel):
    """A file or directory of the node (the vendor's driver libraries, tools, version files)."""

    path: str = Field(
        description="Absolute, normalized path on the node, e.g. /usr/local/Ascend/driver/lib64.",
        pattern=r"^/[^\s]*$",
        max_length=1024,
    )
    type: Literal["Directory", "File"] = Field(
        "Directory",
        description="What must be there: Directory or File (never created: a driver mount that is "
        "missing fails the pod instead of mounting an empty directory).",
    )


class ClassVolume(ApiModel):
    """A host path the worker pods on this class mount read-only (the vendor's userland the device plugin does not
    inject). Only cluster admins write AcceleratorClasses; pdfleet still refuses the node's sensitive paths and
    mounts every one read-only (decide.guardrails.class_volume_problems)."""

    name: str = Field(
        description="Volume name, unique in the class (the pod's volume is class-<name>).",
        pattern=DNS_LABEL_PATTERN,
        max_length=48,
    )
    host_path: HostPathSource = Field(description="The node's file or directory.")


class ClassVolumeMount(ApiModel):
    """Where a class volume appears in worker containers (always read-only)."""

    name: str = Field(description="The class volume (spec.volumes[].name).", pattern=DNS_LABEL_PATTERN, max_length=48)
    mount_path: str = Field(
        description="Absolute path in the container, e.g. /usr/local/Ascend/driver/lib64.",
        pattern=r"^/[^\s]*$",
        max_length=1024,
    )


class ClassRuntimes(ApiModel):
    """The engines a pool on this class can run, and which one it runs when the deployment does not choose."""

    default: RuntimeName = Field(
        "pdfleet",
        description="The engine a pool on this class runs when its InferenceDeployment leaves "
        "spec.engine.runtime empty.",
    )
    pdfleet: PdfleetRuntime = Field(default_factory=PdfleetRuntime, description="The pdfleet worker on this class.")
    vllm: VllmRuntime | None = Field(
        None, description="vLLM on this class; empty: vLLM is not offered here (a deployment asking for it is refused)."
    )

    cel_rules: ClassVar = (
        Rule(
            rule="self.default != 'vllm' || has(self.vllm)",
            message="default vllm needs vllm (the image that runs it on this class)",
            field_path=".default",
        ),
    )


class AcceleratorClassSpec(ApiModel):
    """What one accelerator type is, how a pod requests it and what it costs."""

    vendor: Vendor = Field(description="Who makes the accelerator; selects device-specific defaults in the worker.")
    model: str = Field("", description="Human-readable product name, e.g. 'H100 SXM 80GB'.", max_length=128)
    resource_name: str = Field(
        description="Extended resource a worker pod requests, e.g. nvidia.com/gpu, nvidia.com/mig-3g.40gb, "
        "huawei.com/Ascend910, cambricon.com/mlu; 'cpu' runs workers on CPU only.",
        pattern=RESOURCE_NAME_PATTERN,
        max_length=253,
    )
    count: int = Field(1, ge=1, le=64, description="How many of resourceName one worker replica requests.")
    memory_gib: float = Field(
        alias="memoryGiB", gt=0, description="Device memory per unit in GiB (a MIG slice: the slice's memory)."
    )
    peak_tflops: float = Field(gt=0, description="Peak dense bf16/fp16 TFLOP/s per unit; prefill is compute-bound.")
    memory_bandwidth_gbps: float = Field(
        alias="memoryBandwidthGBps",
        gt=0,
        description="Device memory bandwidth per unit in GB/s; decode is bandwidth-bound.",
    )
    network_gbps: float = Field(
        12.5,
        alias="networkGBps",
        gt=0,
        description="Node network bandwidth available for KV transfer between pools, in GB/s.",
    )
    cost_per_hour: float = Field(
        ge=0, description="Price of one unit per hour in USD (what dashboards divide by tokens)."
    )
    cost_source: str = Field("", description="Where the price comes from (provider, list or contract).", max_length=512)
    cost_as_of: str = Field(
        "", description="Date the price was checked, YYYY-MM-DD.", pattern=r"^([0-9]{4}-[0-9]{2}-[0-9]{2})?$"
    )
    partition: Partition | None = Field(None, description="Set when this class is a slice of a device (MIG).")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels a worker on this class must match."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Tolerations added to workers on this class."
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        description="Environment for workers on this class (both engines), e.g. a driver's library path. Not the "
        "device-visibility variables (*_VISIBLE_DEVICES): the vendor's device plugin sets them from the "
        "devices it allocates to each pod, and a fixed value would point every replica at one device.",
    )
    volumes: list[ClassVolume] = Field(
        default_factory=list,
        description="Host paths worker pods on this class mount read-only: the vendor's driver "
        "libraries and tools its containers expect (Ascend: the driver's lib64 and "
        "version.info, npu-smi, /usr/local/dcmi; Hygon: /opt/hyhal; Cambricon: the "
        "neuware tree). The node's sensitive paths are refused.",
    )
    volume_mounts: list[ClassVolumeMount] = Field(
        default_factory=list, description="Where each class volume is mounted in worker containers (read-only)."
    )
    runtimes: ClassRuntimes = Field(
        default_factory=ClassRuntimes,
        description="The engines pools on this class can run (the pdfleet worker, vLLM) and the default one.",
    )

    cel_rules: ClassVar = (
        Rule(
            rule="!has(self.partition) || self.partition.type != 'mig' || self.vendor == 'nvidia'",
            message="MIG partitions exist only on NVIDIA devices",
            field_path=".partition",
        ),
        Rule(
            rule="(self.vendor == 'cpu') == (self.resourceName == 'cpu')",
            message="resourceName 'cpu' goes with vendor 'cpu' and only with it",
            field_path=".resourceName",
        ),
        Rule(
            rule="!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && "
            "self.volumes.exists(v, v.name == m.name))",
            message="every volumeMount names one of spec.volumes",
            field_path=".volumeMounts",
        ),
        Rule(
            rule="!has(self.volumes) || self.volumes.all(v, self.volumes.exists_one(w, w.name == v.name))",
            message="volume names are unique",
            field_path=".volumes",
        ),
    )


class AcceleratorClassStatus(ApiModel):
    """What the operator observed about this class across the cluster's nodes."""

    observed_generation: int | None = Field(None, ge=0, description="Generation this status was computed for.")
    nodes: int | None = Field(None, ge=0, description="Nodes that match the selector and advertise the resource.")
    allocatable: int | None = Field(None, ge=0, description="Units of resourceName allocatable on those nodes.")
    free: int | None = Field(None, ge=0, description="Units not requested by any pod.")
    used_by: list[str] = Field(
        default_factory=list,
        description="The pools on this class ('namespace/deployment role'): while any is "
        "listed, deleting the class only marks it (the pdfleet.io/in-use finalizer) "
        "and its pools move to their roles' other classes first.",
    )
    conditions: list[Condition] = Field(default_factory=list, description="Observations, keyed by type.")


class AcceleratorClass(Resource):
    """A whole AcceleratorClass object as stored by the API server."""

    api_version: Literal["pdfleet.io/v1alpha1"] = "pdfleet.io/v1alpha1"
    kind: Literal["AcceleratorClass"] = "AcceleratorClass"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: AcceleratorClassSpec
    status: AcceleratorClassStatus | None = None

    name_rule: ClassVar = (63, DNS_LABEL_PATTERN)
    name_rule_why: ClassVar = "a DNS label: deployments refer to it and pool names embed it"

    @property
    def name(self) -> str:
        assert self.metadata.name, "AcceleratorClass without metadata.name"
        return self.metadata.name
