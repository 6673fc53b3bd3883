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

    key: str | None = Field(None, description="Taint key the toleration applies to; empty with operator Exists matches all.")
    operator: Literal["Exists", "Equal"] = Field("Equal", description="Exists or Equal.")
    value: str | None = Field(None, description="Taint value to match when operator is Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to match; empty matches all effects.")
    toleration_seconds: int | None = Field(
        None, ge=0, description="How long a NoExecute-tainted pod stays bound; empty means forever.")

    cel_rules: ClassVar = (
        Rule(rule="self.operator != 'Exists' || !has(self.value)",
             message="value must be empty when operator is Exists", field_path=".value"),
    )


class EnvVar(ApiModel):
    """A plain environment variable for the worker container."""

    name: str = Field(description="Variable name.", pattern=ENV_NAME_PATTERN, max_length=256)
    value: str = Field("", description="Variable value.")


class Partition(ApiModel):
    """How this class is a slice of a bigger device (NVIDIA MIG, vGPU, ...)."""

    type: Literal["mig"] = Field(description="Partitioning technology: mig (NVIDIA Multi-Instance GPU, a slice with "
                                             "its own memory). vGPU and time-slicing are not supported: a shared "
                                             "card's KV cache would be sized from the whole card's memory.")
    profile: str = Field(description="Profile name as the device plugin names it, e.g. 3g.40gb or 1g.10gb.",
                         pattern=r"^[0-9a-z.+-]+$", max_length=63)
    parent_class: str | None = Field(
        None, description="The AcceleratorClass of the whole device this is carved from (informational).",
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)


class PdfleetRuntime(ApiModel):
    """How the pdfleet worker runs on this class."""

    device: TorchDevice | None = Field(
        None, description="The torch device the worker computes on (`pdfleet worker --device`). Empty: from the "
                          "vendor (nvidia and hygon: cuda, the DTK torch is CUDA-compatible; huawei: npu through "
                          "torch_npu; cambricon: mlu through torch_mlu; intel: xpu; cpu: cpu). A vendor without a "
                          "PyTorch bridge (kunlunxin, amd, moorethreads) has no default: the pdfleet worker is not "
                          "offered on it until this is set.")
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment for pdfleet workers on this class.")


class VllmRuntime(ApiModel):
    """How vLLM, or the vendor's build of it (vLLM-Ascend, vllm-kunlun, Cambricon's and Hygon's vLLM), runs on this class."""

    image: str = Field(description="Image with vLLM for this device, e.g. vllm/vllm-openai:v0.11.0 (NVIDIA) or "
                                   "quay.io/ascend/vllm-ascend:v0.11.0rc0 (Ascend). Its `vllm` command serves the model.",
                       min_length=1, max_length=512)
    kv_connector: str = Field(
        "NixlConnector", description="vLLM KV connector a prefill/decode pool on this class uses (`--kv-transfer-config`), "
                                     "e.g. NixlConnector (NVIDIA) or MooncakeConnectorV1 (vLLM-Ascend).",
        pattern=r"^[A-Za-z][A-Za-z0-9_]*$", max_length=64)
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment for vLLM pods on this class.")


class ClassRuntimes(ApiModel):
    """The engines a pool on this class can run, and which one it runs when the deployment does not choose."""

    default: RuntimeName = Field(
        "pdfleet", description="The engine a pool on this class runs when its InferenceDeployment leaves "
                               "spec.engine.runtime empty.")
    pdfleet: PdfleetRuntime = Field(default_factory=PdfleetRuntime, description="The pdfleet worker on this class.")
    vllm: VllmRuntime | None = Field(
        None, description="vLLM on this class; empty: vLLM is not offered here (a deployment asking for it is refused).")

    cel_rules: ClassVar = (
        Rule(rule="self.default != 'vllm' || has(self.vllm)",
             message="default vllm needs vllm (the image that runs it on this class)", field_path=".default"),
    )


class AcceleratorClassSpec(ApiModel):
    """What one accelerator type is, how a pod requests it and what it costs."""

    vendor: Vendor = Field(description="Who makes the accelerator; selects device-specific defaults in the worker.")
    model: str = Field("", description="Human-readable product name, e.g. 'H100 SXM 80GB'.", max_length=128)
    resource_name: str = Field(
        description="Extended resource a worker pod requests, e.g. nvidia.com/gpu, nvidia.com/mig-3g.40gb, "
                    "huawei.com/Ascend910, cambricon.com/mlu; 'cpu' runs workers on CPU only.",
        pattern=RESOURCE_NAME_PATTERN, max_length=253)
    count: int = Field(1, ge=1, le=64, description="How many of resourceName one worker replica requests.")
    memory_gib: float = Field(alias="memoryGiB", gt=0, description="Device memory per unit in GiB (a MIG slice: the slice's memory).")
    peak_tflops: float = Field(gt=0, description="Peak dense bf16/fp16 TFLOP/s per unit; prefill is compute-bound.")
    memory_bandwidth_gbps: float = Field(
        alias="memoryBandwidthGBps", gt=0, description="Device memory bandwidth per unit in GB/s; decode is bandwidth-bound.")
    network_gbps: float = Field(
        12.5, alias="networkGBps", gt=0, description="Node network bandwidth available for KV transfer between pools, in GB/s.")
    cost_per_hour: float = Field(ge=0, description="Price of one unit per hour in USD (what dashboards divide by tokens).")
    cost_source: str = Field("", description="Where the price comes from (provider, list or contract).", max_length=512)
    cost_as_of: str = Field("", description="Date the price was checked, YYYY-MM-DD.",
                            pattern=r"^([0-9]{4}-[0-9]{2}-[0-9]{2})?$")
    partition: Partition | None = Field(None, description="Set when this class is a slice of a device (MIG).")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels a worker on this class must match.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Tolerations added to workers on this class.")
    env: list[EnvVar] = Field(
        default_factory=list,
        description="Environment for workers on this class, e.g. the device-visibility variable "
                    "(ASCEND_RT_VISIBLE_DEVICES, MLU_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES, XPU_VISIBLE_DEVICES).")
    image: str | None = Field(None, description="pdfleet worker image for this class (a build with the vendor's "
                                                "PyTorch bridge); empty: the deployment's spec.engine.image.",
                              min_length=1, max_length=512)
    runtimes: ClassRuntimes = Field(
        default_factory=ClassRuntimes,
        description="The engines pools on this class can run (the pdfleet worker, vLLM) and the default one.")

    cel_rules: ClassVar = (
        Rule(rule="!has(self.partition) || self.partition.type != 'mig' || self.vendor == 'nvidia'",
             message="MIG partitions exist only on NVIDIA devices", field_path=".partition"),
        Rule(rule="(self.vendor == 'cpu') == (self.resourceName == 'cpu')",
             message="resourceName 'cpu' goes with vendor 'cpu' and only with it", field_path=".resourceName"),
    )


class AcceleratorClassStatus(ApiModel):
    """What the operator observed about this class across the cluster's nodes."""

    observed_generation: int | None = Field(None, ge=0, description="Generation this status was computed for.")
    nodes: int | None = Field(None, ge=0, description="Nodes that match the selector and advertise the resource.")
    allocatable: int | None = Field(None, ge=0, description="Units of resourceName allocatable on those nodes.")
    free: int | None = Field(None, ge=0, description="Units not requested by any pod.")
    used_by: list[str] = Field(
        default_factory=list, description="The pools on this class ('namespace/deployment role'): while any is "
                                          "listed, deleting the class only marks it (the pdfleet.io/in-use finalizer) "
                                          "and its pools move to their roles' other classes first.")
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
