"""This machine as placement sees it: one node offering CPU cores and NVIDIA GPUs, which AcceleratorClasses it can run,
and loopback ports; `pdfleet up` plans on it."""

from __future__ import annotations

import ctypes.util
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from pdfleet_operator.api import AcceleratorClassSpec, InferenceDeploymentSpec
from pdfleet_operator.decide import placement
from pdfleet_operator.decide.inventory import Inventory, NodeInventory
from pdfleet_operator.local import ports
from pdfleet_operator.local.spec import UpError

NODE = "localhost"
CPU = "cpu"
GPU = "nvidia.com/gpu"


@dataclass(frozen=True)
class Machine:
    """What runs here: CPU cores (shared by every process) and whole NVIDIA GPUs (one worker's each)."""

    cores: int
    gpus: int

    @classmethod
    def detect(cls) -> "Machine":
        return cls(cores=len(os.sched_getaffinity(0)), gpus=nvidia_gpus())

    def provides(self, cls: AcceleratorClassSpec) -> bool:
        """Whether a worker of this class can run here at all (the resource exists on this machine)."""
        if cls.vendor == "cpu" and cls.resource_name == CPU:
            return True
        return cls.vendor == "nvidia" and cls.resource_name == GPU and cls.partition is None and cls.count <= self.gpus

    def why_not(self, cls: AcceleratorClassSpec) -> str:
        if cls.vendor == "nvidia" and cls.resource_name == GPU and cls.partition is None:
            return f"needs {cls.count} NVIDIA GPU(s) per replica and this machine has {self.gpus}"
        return (
            f"requests {cls.resource_name} ({cls.vendor}), which `pdfleet up` cannot give a local process "
            f"(it runs on CPU cores and whole NVIDIA GPUs)"
        )


PRELOAD_ENV = "PDFLEET_PRELOAD"  # auto: tcmalloc into pdfleet's worker processes when it is installed; none
TCMALLOC = "tcmalloc_minimal"  # Debian's libtcmalloc-minimal4


def malloc_preload() -> str | None:
    """The allocator `pdfleet up` preloads into pdfleet's CPU workers (LD_PRELOAD), None when off or not installed
    (a GPU worker's host allocations were not measured with it).

    NOTE: under `vllm bench serve` on a 2-core AMD EPYC a worker with tcmalloc served 1.04-1.12x the output
    tokens/s of one without (three rounds, bench/HISTORY.md, fifteenth session), as vLLM's CPU docs preload it for
    theirs. Intel OpenMP added to it gave more (1.09-1.27x), alone 0.96-1.06x; it comes with vLLM's runtime, not
    with pdfleet's, so it is not preloaded here."""
    setting = os.environ.get(PRELOAD_ENV) or "auto"
    if setting == "none":
        return None
    if setting != "auto":
        raise UpError(f"{PRELOAD_ENV}={setting!r}: use auto (tcmalloc when installed) or none")
    return ctypes.util.find_library(TCMALLOC)  # a soname like libtcmalloc_minimal.so.4, which ld.so finds


def nvidia_gpus() -> int:
    """GPUs `nvidia-smi -L` lists (0 without the tool or a driver)."""
    tool = shutil.which("nvidia-smi")
    if not tool:
        return 0
    try:
        out = subprocess.run([tool, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def local_classes(classes: Mapping[str, AcceleratorClassSpec]) -> dict[str, AcceleratorClassSpec]:
    """The classes as this machine's placement sees them.

    NOTE: nodeSelector and tolerations pick cluster nodes; here there is one node, so they are dropped.
    """
    return {name: c.model_copy(update={"node_selector": {}, "tolerations": []}) for name, c in classes.items()}


def inventory(
    spec: InferenceDeploymentSpec, classes: Mapping[str, AcceleratorClassSpec], machine: Machine
) -> Inventory:
    """One node with the CPU units and GPUs this spec may use.

    NOTE: CPU cores are time-shared, not reserved: every worker is a process the kernel schedules on
    all cores, so the node offers enough `cpu` units for every replica the spec allows (as the node of
    examples/sim/local-tiny.yaml does). More replicas than cores still serve, each more slowly.
    """
    cpu_units = machine.cores
    for rs in spec.roles().values():
        per_replica = max(
            (classes[c].count for c in rs.accelerator_classes if c in classes and classes[c].resource_name == CPU),
            default=0,
        )
        cpu_units += rs.max_replicas * per_replica
    free = {CPU: cpu_units, GPU: machine.gpus}
    return Inventory(
        (NodeInventory(NODE, {"kubernetes.io/hostname": NODE}, (), free),),
        (f"{machine.cores} CPU cores (shared by every worker), {machine.gpus} NVIDIA GPU(s)",),
    )


def check_placeable(
    spec: InferenceDeploymentSpec, classes: Mapping[str, AcceleratorClassSpec], machine: Machine, source: str
) -> placement.FleetPlan:
    """The plan at every role's minimum; UpError in one line when a role has no class this machine runs."""
    for role, rs in spec.roles().items():
        known = [(n, classes[n]) for n in rs.accelerator_classes if n in classes]
        if known and not any(machine.provides(c) for _, c in known):
            name, cls = known[0]
            others = f" (nor can {', '.join(n for n, _ in known[1:])})" if len(known) > 1 else ""
            raise UpError(
                f"{source}: spec.{role}.acceleratorClasses: this machine cannot provide AcceleratorClass "
                f"{name}: it {machine.why_not(cls)}{others}"
            )
    usable = {n: c for n, c in local_classes(classes).items() if machine.provides(c)}
    plan = placement.plan(spec, usable, inventory(spec, usable, machine))
    for short in plan.shortfalls:
        why = [r for r in plan.reasons if r.startswith(f"{short.role}: ") and "skipped" in r]
        raise UpError(f"{source}: spec.{short.role}: {short.message}" + (f" ({why[0]})" if why else ""))
    return plan


def check_port(port: int, host: str = "127.0.0.1") -> None:
    if not 0 < port < 65536:
        raise UpError(f"--port {port}: not a TCP port (1-65535)")
    if not ports.port_free(port, host):
        raise UpError(f"--port {port}: {host}:{port} is already in use; stop what listens there or pass another --port")


def free_port(host: str = "127.0.0.1", avoid: set[int] | frozenset[int] = frozenset()) -> int:
    """ports.free_port, its failure an UpError."""
    try:
        return ports.free_port(host, avoid)
    except OSError as exc:
        raise UpError(str(exc)) from None
