"""Which engine each pool runs, and whether it can run there at all (pure).

A pool (role x AcceleratorClass) runs `spec.engine.runtime` when the deployment chooses one, else
its class's `spec.runtimes.default`. What cannot work is refused here, naming the field, before
anything is rendered or started: prefill and decode on different engines (the KV hand-off is
engine-specific), vLLM on a class that does not offer it, the pdfleet worker on a device it has no
PyTorch bridge for or with no image built for its class's platform (or one tagged for another:
`decide.worker_images`), a class with `count > 1` for an engine without tensor parallelism (the pdfleet
worker), a class's host-path volumes on the node's sensitive paths (`decide.guardrails`), and vLLM
prefill/decode pools that cannot talk: two connectors or two builds, a connector pdfleet's router cannot
drive, or two KV block sizes (`decide.kv_connectors`; vLLM-Ascend computes on 128-token blocks with prefix
caching).

NOTE: these rules read AcceleratorClasses, which kube-apiserver's CEL cannot see from an
InferenceDeployment; the operator applies them on every reconcile (an invalid combination is a
permanent error of that deployment), and `pdfleet validate`, `pdfleet render` and `pdfleet up`
apply them offline with the classes they are given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pdfleet_operator.api import AcceleratorClassSpec, InferenceDeploymentSpec
from pdfleet_operator.decide import guardrails, kv_connectors, worker_images
from pdfleet_operator.decide.kv_connectors import Connector
from pdfleet_operator.decide.worker_images import WorkerImages

PDFLEET, VLLM = "pdfleet", "vllm"
# The pdfleet worker's torch device per vendor when the class names none (`spec.runtimes.pdfleet.device`).
# NOTE: Hygon's DCUs run the CUDA API through DTK's torch build; vendors missing here have no PyTorch
# bridge the worker loads (it would compute on the host CPU while holding the card), so no default.
VENDOR_DEVICE = {"nvidia": "cuda", "hygon": "cuda", "huawei": "npu", "cambricon": "mlu", "intel": "xpu", "cpu": "cpu"}
TENSOR_PARALLEL = {PDFLEET: False, VLLM: True}
# vLLM's CPU attention (0.32) takes KV blocks of a multiple of this many tokens ("No common block size for 16").
VLLM_CPU_BLOCK_MULTIPLE = 32


@dataclass(frozen=True)
class PoolRuntime:
    """What one pool runs: the engine, its image, the device and the environment for it."""

    name: str  # pdfleet | vllm
    image: str
    env: tuple[tuple[str, str], ...] = ()  # the class's env, then the engine's env on the class
    device: str | None = None  # pdfleet: the torch device (`--device`)
    tensor_parallel: int = 1  # vllm: the class's count
    kv_connector: str | None = None  # vllm: the KV connector of a prefill/decode pool
    block_size: int = 16  # KV tokens per block the engine computes with
    connector: Connector | None = None  # vllm: the connector of a prefill/decode pool, with its ports
    build: str | None = None  # vllm: the build (decide.kv_connectors.VENDOR_BUILD)
    pod_ip_env: tuple[str, ...] = ()  # env set to the pod's IP (HCCL_IF_IP on Ascend, a connector's host)


class RuntimeProblem(ValueError):
    """A combination of engine and classes that cannot work; `field` is the Kubernetes field path to fix."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def engine_of(spec: InferenceDeploymentSpec, cls: AcceleratorClassSpec) -> str:
    """The engine a pool of this deployment runs on this class."""
    return spec.engine.runtime or cls.runtimes.default


# Env every pod on a vendor's accelerators gets set to the pod's IP: Ascend's collective library binds HCCL_IF_IP.
VENDOR_POD_IP_ENV = {"huawei": ("HCCL_IF_IP",)}


def for_pool(
    spec: InferenceDeploymentSpec,
    role: str,
    class_name: str,
    cls: AcceleratorClassSpec,
    field: str = "spec.engine.runtime",
    *,
    images: WorkerImages = worker_images.DEFAULTS,
) -> PoolRuntime:
    """The runtime of pool (role, class_name); RuntimeProblem naming `field` when it cannot run there.
    `images`: the operator's pdfleet worker image per platform, for pools whose class and spec name none."""
    name = engine_of(spec, cls)
    env = tuple((v.name, v.value) for v in cls.env)
    where = f"AcceleratorClass {class_name} ({cls.vendor}, {cls.count} x {cls.resource_name})"
    volumes = guardrails.class_volume_problems(cls)
    if volumes:
        raise RuntimeProblem(f"AcceleratorClass {class_name} {volumes[0].field}", volumes[0].message)
    if name == PDFLEET:
        if cls.count > 1 and cls.resource_name != "cpu" and not TENSOR_PARALLEL[PDFLEET]:  # cpu: count is cores
            raise RuntimeProblem(
                field,
                f"{where} gives each replica {cls.count} devices; the pdfleet worker has no "
                f"tensor parallelism and would use one: run vllm there, or a count-1 class",
            )
        device = cls.runtimes.pdfleet.device or VENDOR_DEVICE.get(cls.vendor)
        if device is None:
            raise RuntimeProblem(
                field,
                f"{where}: the pdfleet worker has no PyTorch bridge for {cls.vendor} "
                f"(set the class's spec.runtimes.pdfleet.device, or run vllm there)",
            )
        if spec.model.dtype == "float16":
            raise RuntimeProblem(
                "spec.model.dtype",
                "the pdfleet worker computes in bfloat16 or float32; float16 needs vllm (spec.engine.runtime)",
            )
        env += tuple((v.name, v.value) for v in cls.runtimes.pdfleet.env)
        return PoolRuntime(
            PDFLEET,
            _pdfleet_image(spec, cls, where, field, images),
            env,
            device=device,
            block_size=spec.engine.block_size,
            pod_ip_env=VENDOR_POD_IP_ENV.get(cls.vendor, ()),
        )
    assert name == VLLM, name
    offered = cls.runtimes.vllm
    wanted = spec.engine.vllm
    image = (wanted.image if wanted else None) or (offered.image if offered else None)
    if image is None:
        raise RuntimeProblem(
            field, f"{where} offers no vllm (its spec.runtimes.vllm is empty) and spec.engine.vllm.image names no image"
        )
    if offered is not None:
        env += tuple((v.name, v.value) for v in offered.env)
    on_cpu = cls.resource_name == "cpu"  # count is cores there, not devices to split the model over
    if on_cpu and spec.engine.block_size % VLLM_CPU_BLOCK_MULTIPLE:
        raise RuntimeProblem(
            "spec.engine.blockSize",
            f"{spec.engine.block_size}: vLLM's CPU attention takes KV blocks "
            f"of a multiple of {VLLM_CPU_BLOCK_MULTIPLE} tokens ({where}); "
            f"use 32 or 128",
        )
    if spec.engine.quantization != "none":
        raise RuntimeProblem(
            "spec.engine.quantization",
            f"{spec.engine.quantization} is the pdfleet engine's (weights "
            f"quantized at load); {where} runs vllm, which has no "
            f"weight-only INT8 of an unquantized checkpoint: set none "
            f"(or serve a pre-quantized checkpoint via vllm.extraArgs)",
        )
    _check_vllm_offload(spec, role, where, on_cpu)
    build = kv_connectors.build_of(cls)
    block = kv_connectors.block_size(build, spec.engine.block_size, spec.engine.enable_prefix_caching)
    pod_ip_env = VENDOR_POD_IP_ENV.get(cls.vendor, ())
    connector = None
    if role in ("prefill", "decode"):
        named = (wanted.kv_connector if wanted else None) or (offered.kv_connector if offered else None)
        connector_field = "spec.engine.vllm.kvConnector" if wanted and wanted.kv_connector else field
        try:
            connector = kv_connectors.lookup(build, named)
        except ValueError as exc:
            raise RuntimeProblem(connector_field, f"{where}: {exc}") from None
        if connector.refused:
            raise RuntimeProblem(
                connector_field,
                f"{where}: {connector.name} of {kv_connectors.BUILD_NAMES[build]}: "
                f"{connector.refused}; use {kv_connectors.DEFAULT_CONNECTOR[build]}",
            )
        pod_ip_env += tuple(e for e in connector.host_env if e not in pod_ip_env)
    return PoolRuntime(
        VLLM,
        image,
        env,
        tensor_parallel=1 if on_cpu else cls.count,
        kv_connector=connector.name if connector else None,
        block_size=block,
        connector=connector,
        build=build,
        pod_ip_env=pod_ip_env,
    )


def _pdfleet_image(
    spec: InferenceDeploymentSpec, cls: AcceleratorClassSpec, where: str, field: str, images: WorkerImages
) -> str:
    """The class's image, else the deployment's, else the operator's default for the class's platform; refused when
    there is none or its tag names another platform (a CUDA pool on a CPU build crash-loops in DeviceUnavailable)."""
    platform = worker_images.class_platform(cls)
    image = cls.runtimes.pdfleet.image or spec.engine.image or images.get(platform)
    if image is None:
        have = ", ".join(images.platforms) or "none"
        raise RuntimeProblem(
            field,
            f"{where} needs a pdfleet worker built for {platform} "
            f"({worker_images.WHAT.get(platform, platform)}) and the operator has none "
            f"(its images: {have}): build one (make images WORKER_PLATFORMS=... "
            f"BASE_{platform}=<the vendor's PyTorch image>) and pass it (--worker-image "
            f"{platform}=IMAGE, chart workerImage.platforms), or set the class's "
            f"spec.runtimes.pdfleet.image",
        )
    built_for = worker_images.image_platform(image)
    if built_for is not None and built_for != platform:
        source = (
            "its spec.runtimes.pdfleet.image"
            if cls.runtimes.pdfleet.image
            else "spec.engine.image"
            if spec.engine.image
            else "the operator's default"
        )
        raise RuntimeProblem(
            field,
            f"{where} needs a pdfleet worker built for {platform} "
            f"({worker_images.WHAT.get(platform, platform)}); {image} ({source}) is built for "
            f"{built_for} and cannot drive it",
        )
    return image


def _check_vllm_offload(spec: InferenceDeploymentSpec, role: str, where: str, on_cpu: bool) -> None:
    """What of engine.preemption / engine.kvOffload vLLM 0.x can run: its native CPU offload (--kv-offloading-size)
    on CUDA/XPU, as the pool's only KV connector; no swap preemption (V1 recomputes), no disk tier."""
    e = spec.engine
    if e.preemption == "swap":
        raise RuntimeProblem(
            "spec.engine.preemption",
            f"swap is the pdfleet engine's; vLLM (V1) always recomputes a preempted sequence ({where} runs vllm)",
        )
    if e.kv_offload is None:
        return
    if e.kv_offload.disk is not None:
        raise RuntimeProblem(
            "spec.engine.kvOffload.disk",
            f"the disk tier is the pdfleet engine's; vLLM offloads to host memory only ({where} runs vllm)",
        )
    if e.kv_offload.host_memory is not None and on_cpu:
        raise RuntimeProblem(
            "spec.engine.kvOffload.hostMemory",
            f"vLLM's KV offload (--kv-offloading-size) runs on CUDA and XPU only, not on {where}",
        )
    if e.kv_offload.host_memory is not None and role in ("prefill", "decode"):
        raise RuntimeProblem(
            "spec.engine.kvOffload.hostMemory",
            f"vLLM's KV offload is a KV connector of its own and cannot join a {role} pool's PD connector ({where})",
        )


def check(
    spec: InferenceDeploymentSpec,
    classes: Mapping[str, AcceleratorClassSpec],
    images: WorkerImages = worker_images.DEFAULTS,
) -> list[RuntimeProblem]:
    """Every reason the deployment's pools cannot run on the classes it lists (known classes only); `images`: the
    operator's pdfleet worker image per platform."""
    problems: list[RuntimeProblem] = []
    chosen: dict[str, dict[str, PoolRuntime]] = {}
    for role, rs in spec.roles().items():
        for i, name in enumerate(rs.accelerator_classes):
            cls = classes.get(name)
            if cls is None:
                continue  # placement reports a missing class
            field = "spec.engine.runtime" if spec.engine.runtime else f"spec.{role}.acceleratorClasses[{i}]"
            try:
                chosen.setdefault(role, {})[name] = for_pool(spec, role, name, cls, field, images=images)
            except RuntimeProblem as exc:
                problems.append(exc)
    for role, pools in chosen.items():
        if len({rt.name for rt in pools.values()}) > 1:
            desc = ", ".join(f"{name}: {rt.name}" for name, rt in pools.items())
            problems.append(
                RuntimeProblem(
                    f"spec.{role}.acceleratorClasses",
                    f"one role runs one engine (the router "
                    f"finds a role's workers through one "
                    f"Service): {desc}; set spec.engine.runtime",
                )
            )
    if "prefill" in chosen and "decode" in chosen:
        pools = [(role, name, rt) for role in ("prefill", "decode") for name, rt in chosen[role].items()]
        engines = {rt.name for _, _, rt in pools}
        if len(engines) > 1:
            desc = ", ".join(f"{role} on {name}: {rt.name}" for role, name, rt in pools)
            problems.append(
                RuntimeProblem(
                    "spec.engine.runtime",
                    f"prefill and decode must run one engine (the KV hand-off is the engine's own): {desc}; set it",
                )
            )
        else:
            problems += _pair_problems(pools)
    return problems


def _pair_problems(pools: list[tuple[str, str, PoolRuntime]]) -> list[RuntimeProblem]:
    """Prefill and decode pools of one engine that cannot exchange KV: two block sizes, or (vLLM) two connectors or
    builds."""
    out = []
    sizes = {rt.block_size for _, _, rt in pools}
    if len(sizes) > 1:
        desc = ", ".join(f"{role} on {name}: {rt.block_size}" for role, name, rt in pools)
        out.append(
            RuntimeProblem(
                "spec.engine.blockSize",
                f"prefill and decode must compute KV in blocks of one size "
                f"to exchange them: {desc} (vLLM-Ascend takes "
                f"{kv_connectors.ASCEND_PREFIX_CACHING_BLOCK}-token blocks "
                f"with prefix caching)",
            )
        )
    prefill = [(n, rt.connector) for role, n, rt in pools if role == "prefill" and rt.connector is not None]
    decode = [(n, rt.connector) for role, n, rt in pools if role == "decode" and rt.connector is not None]
    for p_name, p in prefill:
        for d_name, d in decode:
            why = kv_connectors.cannot_talk(p, d)
            if why is not None:
                out.append(
                    RuntimeProblem(
                        "spec.engine.vllm.kvConnector",
                        f"prefill on {p_name} and decode on {d_name} cannot talk: {why}; run both "
                        f"roles on one vLLM build, or the pdfleet engine (spec.engine.runtime: "
                        f"pdfleet: its KV moves over TCP between any devices)",
                    )
                )
    return out


def role_engine(spec: InferenceDeploymentSpec, role: str, classes: Mapping[str, AcceleratorClassSpec]) -> str:
    """The engine a role's pools run (for a colocated role over classes of different defaults: the first
    class's; the router and the autoscaler take each pool's own). `spec.engine.runtime` when set."""
    if spec.engine.runtime:
        return spec.engine.runtime
    for name in spec.roles()[role].accelerator_classes:
        if name in classes:
            return engine_of(spec, classes[name])
    return PDFLEET
