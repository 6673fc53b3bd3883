"""Which engine each pool runs, and whether it can run there at all (pure).

A pool (role x AcceleratorClass) runs `spec.engine.runtime` when the deployment chooses one, else
its class's `spec.runtimes.default`. What cannot work is refused here, naming the field, before
anything is rendered or started: prefill and decode on different engines (the KV hand-off is
engine-specific), vLLM on a class that does not offer it, the pdfleet worker on a device it has no
PyTorch bridge for, a class with `count > 1` for an engine without tensor parallelism (the pdfleet
worker), and vLLM prefill/decode pools whose KV connectors differ.

NOTE: these rules read AcceleratorClasses, which kube-apiserver's CEL cannot see from an
InferenceDeployment; the operator applies them on every reconcile (an invalid combination is a
permanent error of that deployment), and `pdfleet validate`, `pdfleet render` and `pdfleet up`
apply them offline with the classes they are given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pdfleet_operator.api import AcceleratorClassSpec, InferenceDeploymentSpec
from pdfleet_operator.api.names import DEFAULT_WORKER_IMAGE

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

    name: str                               # pdfleet | vllm
    image: str
    env: tuple[tuple[str, str], ...] = ()   # the class's env, then the engine's env on the class
    device: str | None = None               # pdfleet: the torch device (`--device`)
    tensor_parallel: int = 1                # vllm: the class's count
    kv_connector: str | None = None         # vllm: the KV connector of a prefill/decode pool


class RuntimeProblem(ValueError):
    """A combination of engine and classes that cannot work; `field` is the Kubernetes field path to fix."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def engine_of(spec: InferenceDeploymentSpec, cls: AcceleratorClassSpec) -> str:
    """The engine a pool of this deployment runs on this class."""
    return spec.engine.runtime or cls.runtimes.default


def for_pool(spec: InferenceDeploymentSpec, role: str, class_name: str, cls: AcceleratorClassSpec,
             field: str = "spec.engine.runtime", *, default_image: str = DEFAULT_WORKER_IMAGE) -> PoolRuntime:
    """The runtime of pool (role, class_name); RuntimeProblem naming `field` when it cannot run there.
    `default_image`: the pdfleet worker image when neither the class nor the spec names one."""
    name = engine_of(spec, cls)
    env = tuple((v.name, v.value) for v in cls.env)
    where = f"AcceleratorClass {class_name} ({cls.vendor}, {cls.count} x {cls.resource_name})"
    if name == PDFLEET:
        if cls.count > 1 and cls.resource_name != "cpu" and not TENSOR_PARALLEL[PDFLEET]:  # cpu: count is cores
            raise RuntimeProblem(field, f"{where} gives each replica {cls.count} devices; the pdfleet worker has no "
                                        f"tensor parallelism and would use one: run vllm there, or a count-1 class")
        device = cls.runtimes.pdfleet.device or VENDOR_DEVICE.get(cls.vendor)
        if device is None:
            raise RuntimeProblem(field, f"{where}: the pdfleet worker has no PyTorch bridge for {cls.vendor} "
                                        f"(set the class's spec.runtimes.pdfleet.device, or run vllm there)")
        if spec.model.dtype == "float16":
            raise RuntimeProblem("spec.model.dtype", "the pdfleet worker computes in bfloat16 or float32; float16 "
                                                     "needs vllm (spec.engine.runtime)")
        env += tuple((v.name, v.value) for v in cls.runtimes.pdfleet.env)
        return PoolRuntime(PDFLEET, cls.image or spec.engine.image or default_image, env, device=device)
    assert name == VLLM, name
    offered = cls.runtimes.vllm
    wanted = spec.engine.vllm
    image = (wanted.image if wanted else None) or (offered.image if offered else None)
    if image is None:
        raise RuntimeProblem(field, f"{where} offers no vllm (its spec.runtimes.vllm is empty) and "
                                    f"spec.engine.vllm.image names no image")
    if offered is not None:
        env += tuple((v.name, v.value) for v in offered.env)
    on_cpu = cls.resource_name == "cpu"  # count is cores there, not devices to split the model over
    if on_cpu and spec.engine.block_size % VLLM_CPU_BLOCK_MULTIPLE:
        raise RuntimeProblem("spec.engine.blockSize", f"{spec.engine.block_size}: vLLM's CPU attention takes KV blocks "
                                                      f"of a multiple of {VLLM_CPU_BLOCK_MULTIPLE} tokens ({where}); "
                                                      f"use 32 or 128")
    if spec.engine.quantization != "none":
        raise RuntimeProblem("spec.engine.quantization", f"{spec.engine.quantization} is the pdfleet engine's (weights "
                                                         f"quantized at load); {where} runs vllm, which has no "
                                                         f"weight-only INT8 of an unquantized checkpoint: set none "
                                                         f"(or serve a pre-quantized checkpoint via vllm.extraArgs)")
    _check_vllm_offload(spec, role, where, on_cpu)
    connector = (wanted.kv_connector if wanted else None) or (offered.kv_connector if offered else "NixlConnector")
    return PoolRuntime(VLLM, image, env, tensor_parallel=1 if on_cpu else cls.count,
                       kv_connector=connector if role in ("prefill", "decode") else None)


def _check_vllm_offload(spec: InferenceDeploymentSpec, role: str, where: str, on_cpu: bool) -> None:
    """What of engine.preemption / engine.kvOffload vLLM 0.x can run: its native CPU offload (--kv-offloading-size)
    on CUDA/XPU, as the pool's only KV connector; no swap preemption (V1 recomputes), no disk tier."""
    e = spec.engine
    if e.preemption == "swap":
        raise RuntimeProblem("spec.engine.preemption", f"swap is the pdfleet engine's; vLLM (V1) always recomputes "
                                                       f"a preempted sequence ({where} runs vllm)")
    if e.kv_offload is None:
        return
    if e.kv_offload.disk is not None:
        raise RuntimeProblem("spec.engine.kvOffload.disk", f"the disk tier is the pdfleet engine's; vLLM offloads to "
                                                           f"host memory only ({where} runs vllm)")
    if e.kv_offload.host_memory is not None and on_cpu:
        raise RuntimeProblem("spec.engine.kvOffload.hostMemory", f"vLLM's KV offload (--kv-offloading-size) runs on "
                                                                 f"CUDA and XPU only, not on {where}")
    if e.kv_offload.host_memory is not None and role in ("prefill", "decode"):
        raise RuntimeProblem("spec.engine.kvOffload.hostMemory", f"vLLM's KV offload is a KV connector of its own and "
                                                                 f"cannot join a {role} pool's PD connector ({where})")


def check(spec: InferenceDeploymentSpec, classes: Mapping[str, AcceleratorClassSpec]) -> list[RuntimeProblem]:
    """Every reason the deployment's pools cannot run on the classes it lists (known classes only)."""
    problems: list[RuntimeProblem] = []
    chosen: dict[str, dict[str, PoolRuntime]] = {}
    for role, rs in spec.roles().items():
        for i, name in enumerate(rs.accelerator_classes):
            cls = classes.get(name)
            if cls is None:
                continue  # placement reports a missing class
            field = "spec.engine.runtime" if spec.engine.runtime else f"spec.{role}.acceleratorClasses[{i}]"
            try:
                chosen.setdefault(role, {})[name] = for_pool(spec, role, name, cls, field)
            except RuntimeProblem as exc:
                problems.append(exc)
    for role, pools in chosen.items():
        if len({rt.name for rt in pools.values()}) > 1:
            desc = ", ".join(f"{name}: {rt.name}" for name, rt in pools.items())
            problems.append(RuntimeProblem(f"spec.{role}.acceleratorClasses", f"one role runs one engine (the router "
                                                                              f"finds a role's workers through one "
                                                                              f"Service): {desc}; set spec.engine.runtime"))
    if "prefill" in chosen and "decode" in chosen:
        pools = [(role, name, rt) for role in ("prefill", "decode") for name, rt in chosen[role].items()]
        engines = {rt.name for _, _, rt in pools}
        if len(engines) > 1:
            desc = ", ".join(f"{role} on {name}: {rt.name}" for role, name, rt in pools)
            problems.append(RuntimeProblem("spec.engine.runtime", f"prefill and decode must run one engine (the KV "
                                                                  f"hand-off is the engine's own): {desc}; set it"))
        connectors = {rt.kv_connector for _, _, rt in pools if rt.name == VLLM}
        if len(connectors) > 1:
            desc = ", ".join(f"{role} on {name}: {rt.kv_connector}" for role, name, rt in pools)
            problems.append(RuntimeProblem("spec.engine.vllm.kvConnector", f"vLLM prefill and decode need one KV "
                                                                           f"connector: {desc}"))
    return problems


def role_engine(spec: InferenceDeploymentSpec, role: str, classes: Mapping[str, AcceleratorClassSpec]) -> str:
    """The engine a role's pools run (for a colocated role over classes of different defaults: the first
    class's; the router and the autoscaler take each pool's own). `spec.engine.runtime` when set."""
    if spec.engine.runtime:
        return spec.engine.runtime
    for name in spec.roles()[role].accelerator_classes:
        if name in classes:
            return engine_of(spec, classes[name])
    return PDFLEET
