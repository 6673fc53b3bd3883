"""WorkerConfig: `pdfleet worker` flags merged over the operator's engine config file, and the KV pool size from a
memory fraction; the CLI and tests build it."""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdfleet_worker.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    PARTIAL_PREFILL_MODES,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    EngineConfig,
    ModelConfig,
)
from pdfleet_worker.kv_transfer import peers as kvpeers
from pdfleet_worker.server import device as devices
from pdfleet_worker.server import threads
from pdfleet_worker.wire.limits import DEFAULT_MAX_PROMPTS

ROLES = ("prefill", "decode", "both")
ON_FAILURE = ("recompute", "fail")
KV_CONNECTORS = ("tcp", "nixl")  # kv_transfer/tcp.py, kv_transfer/nixl.py (needs the nixl-cu12 package)
# A plain number of seconds, or Go-style parts as the CRD writes them ("500ms", "10s", "1m30s", "1h"): the same
# grammar as the operator's api.meta.parse_duration, so a spec value means the same on both sides.
_SECONDS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*$")
_DURATION = re.compile(r"^\s*(?:\d+(?:\.\d+)?(?:ms|s|m|h))+\s*$")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(Ki|Mi|Gi|Ti|k|K|M|G|T)?\s*$")
_SIZE_UNITS = {
    None: 1,
    "k": 1e3,
    "K": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
}


def parse_size(value: str | int, name: str) -> int:
    """Bytes from 1073741824, "512Mi", "4Gi" or "2G" (Kubernetes quantity suffixes)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"{name}: not a size: {value!r} (use bytes or a number with Ki, Mi, Gi, Ti, k, M, G or T)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])


def parse_duration(value: str | float | int) -> float:
    """Seconds from 2.5, "2.5", "500ms", "10s", "2m", "1h" or "1m30s"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = str(value)
    if m := _SECONDS.match(text):
        return float(m.group(1))
    if not _DURATION.match(text):
        raise ValueError(f"not a duration: {value!r} (use seconds, or numbers with ms, s, m or h, e.g. 1m30s)")
    return sum(float(n) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[u] for n, u in _DURATION_PART.findall(text))


@dataclasses.dataclass
class WorkerConfig:
    """Everything one worker process runs with."""

    engine: EngineConfig
    served_model_name: str
    role: str = "both"
    host: str = "127.0.0.1"
    port: int = 8000
    accelerator: str = "cpu"
    # The pod template revision this worker runs (--revision, else $PDFLEET_REVISION, from its pod's pdfleet.io/revision
    # label): in /load and in the KV transfer parameters; the router labels each answer with the revision that served
    # it (rollback analysis) and pairs a request's prefill and decode workers by it (router/pairing.py).
    revision: str | None = None
    kv_cache_memory_fraction: float | None = None  # informational once engine.kv_cache_memory_bytes is set
    # PD transfer
    kv_transfer_timeout_s: float = 10.0
    kv_lease_s: float = 30.0
    kv_on_failure: str = "recompute"
    kv_connector: str = "tcp"  # how block bytes move (KV_CONNECTORS); the control plane is TCP either way
    kv_host: str | None = None  # address advertised to decode workers
    kv_port: int = 0  # 0: any free port
    kv_peers: str = kvpeers.LOOPBACK  # decode: the prefill KV endpoints it may pull from (HOST[:PORT],...)
    # authentication: the deployment token's file (None: unauthenticated, as a worker on its own)
    auth_token_file: str | None = None
    # request limits
    max_request_bytes: int = 4 << 20
    max_tokens: int | None = None  # None: up to the model length
    max_n: int = 16
    max_logprobs: int = 20
    max_prompts: int = DEFAULT_MAX_PROMPTS  # prompts in one /v1/completions request (each its own sequence and lease)
    retry_after_s: int = 1
    drain_timeout_s: float = 60.0
    heartbeat_interval_s: float = 10.0  # SSE `: keep-alive` while a stream waits for its next event; 0: none

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.kv_on_failure not in ON_FAILURE:
            raise ValueError(f"kv on_failure must be one of {ON_FAILURE}, got {self.kv_on_failure!r}")
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv connector must be one of {KV_CONNECTORS}, got {self.kv_connector!r}")
        if self.kv_connector == "nixl" and not any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12")):
            raise ValueError(
                "kv connector nixl needs NIXL's Python package, which this environment lacks (pip install nixl-cu12)"
            )
        for name in ("kv_transfer_timeout_s", "kv_lease_s", "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_request_bytes", "max_n", "max_prompts", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.heartbeat_interval_s < 0:
            raise ValueError(f"heartbeat_interval_s must be >= 0 (0: no heartbeats), got {self.heartbeat_interval_s}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        kvpeers.parse(self.kv_peers)  # ValueError names the bad entry

    @property
    def serves_kv(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def pulls_kv(self) -> bool:
        return self.role in ("decode", "both")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `pdfleet worker` flags. Every engine flag defaults to None so that the engine config
    file (what the operator renders) fills what the command line leaves out."""
    p.add_argument(
        "--model", required=True, help="Hugging Face model directory (config.json, *.safetensors, tokenizer.json)"
    )
    p.add_argument("--served-model-name", help="name clients put in `model` (default: the directory's name)")
    p.add_argument(
        "--role",
        choices=ROLES,
        default=None,
        help="prefill: hold KV for decode workers; decode: pull it; both: either (colocated)",
    )
    p.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default 8000)")
    p.add_argument(
        "--engine-config", help="JSON file with engine settings (keys as the operator renders them); flags win"
    )
    p.add_argument(
        "--revision",
        default=None,
        help="the pod template revision this worker runs (default $PDFLEET_REVISION): reported in /load; "
        "the router sends a request's prefill and decode to workers of one revision and KV layout",
    )
    p.add_argument(
        "--accelerator",
        "--accelerator-class",
        dest="accelerator",
        default=None,
        help="the pod's AcceleratorClass: the accelerator label on metrics, named when --device is absent "
        "(default $PDFLEET_ACCELERATOR, else cpu)",
    )
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", choices=DTYPES, default=None)
    g.add_argument(
        "--device",
        default=None,
        help="cpu; cuda[:N] (NVIDIA, MIG, Hygon DTK); npu[:N] (Ascend, loads torch_npu); mlu[:N] (Cambricon, "
        "loads torch_mlu); xpu[:N] (Intel); or auto: cuda when torch sees a GPU, else cpu (default auto). "
        "A named accelerator that is absent is an error, never a CPU fallback",
    )
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 16)")
    g.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=None,
        help="fraction of free device memory (after weights) for the KV cache (default 0.85)",
    )
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides the fraction)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="most sequences in one batch (default 64)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step (default 512)")
    g.add_argument(
        "--partial-prefill",
        choices=PARTIAL_PREFILL_MODES,
        default=None,
        help="a new prompt that does not fit in what is left of a step's token budget: auto leaves it whole for "
        "the next step when it fits there and the measured step cost says cutting it would slow this step "
        "down; fill always cuts it (vLLM's chunked prefill) (default auto)",
    )
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)")
    g.add_argument(
        "--max-waiting-requests",
        "--max-num-waiting",
        dest="max_num_waiting",
        type=int,
        default=None,
        help="waiting requests before new ones get 503 + Retry-After (default 1024)",
    )
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None)
    g.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="weights: none (the checkpoint's, in --dtype) or int8 (weight-only, per output channel, "
        "quantized from the float checkpoint at load; default none)",
    )
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument(
        "--num-threads",
        type=threads.parse_flag,
        default=None,
        help="torch CPU threads, or auto (default): the CPUs the container may use (CPU quota, affinity "
        "mask, $PDFLEET_CPU_REQUEST), less one core for the server loop",
    )
    g.add_argument("--attention-backend", choices=("auto", "reference", "cpu", "flex"), default=None)
    o = p.add_argument_group("KV offload tiers and preemption")
    o.add_argument(
        "--kv-offload-host-memory",
        default=None,
        metavar="SIZE",
        help="host RAM for prefix-cache blocks evicted from the device pool (e.g. 8Gi; default 0: off); "
        "a prefix hit there is copied back instead of recomputed",
    )
    o.add_argument(
        "--kv-offload-disk",
        default=None,
        metavar="SIZE",
        help="a memory-mapped file for blocks the host tier evicts (e.g. 32Gi; default 0: off)",
    )
    o.add_argument(
        "--kv-offload-disk-path",
        default=None,
        metavar="DIR",
        help="directory of the disk tier's file (an emptyDir in a pod; default $TMPDIR)",
    )
    o.add_argument(
        "--preemption",
        choices=PREEMPTION_MODES,
        default=None,
        help="a sequence preempted for want of KV blocks: recompute it later, or swap its blocks to host "
        "RAM and back (default recompute)",
    )
    o.add_argument(
        "--swap-space",
        default=None,
        metavar="SIZE",
        help="host RAM for swapped-out sequences (default 1Gi); when full, preemption recomputes",
    )
    k = p.add_argument_group("KV transfer (prefill/decode disaggregation)")
    k.add_argument("--kv-transfer-timeout", default=None, help="give up on one pull after this long (default 10s)")
    k.add_argument("--kv-lease", default=None, help="prefill: free held KV not acked within this long (default 30s)")
    k.add_argument(
        "--kv-on-failure",
        choices=ON_FAILURE,
        default=None,
        help="decode: after a failed pull recompute the prompt here, or fail the request (default recompute)",
    )
    k.add_argument(
        "--kv-connector",
        choices=KV_CONNECTORS,
        default=None,
        help="how KV blocks move: tcp (the socket, straight from and into the block tensors) or nixl "
        "(one-sided NIXL reads over UCX: RDMA between GPU nodes; needs the nixl-cu12 package); "
        "either pulls from either (default tcp)",
    )
    k.add_argument(
        "--kv-host",
        default=None,
        help="prefill: address decode workers reach the KV endpoint at (default $POD_IP, else --host, else 127.0.0.1)",
    )
    k.add_argument("--kv-port", type=int, default=None, help="prefill: KV endpoint port (default: any free port)")
    k.add_argument(
        "--kv-peers",
        default=None,
        metavar="HOST[:PORT],...",
        help="decode: the only prefill KV endpoints this worker pulls from and sends its token to: IPs, "
        "CIDRs or DNS names (a headless Service: every ready pod), each with an optional port; "
        "kv_transfer_params naming another endpoint are refused, counted as "
        f"reason=untrusted_peer (default {kvpeers.LOOPBACK}: this machine only)",
    )
    a = p.add_argument_group("authentication")
    a.add_argument(
        "--auth-token-file",
        default=None,
        metavar="FILE",
        help="the deployment token (one per line: the first is sent, all are accepted), re-read when the "
        "file changes: required on the OpenAI endpoints, /v1/models and /load (Authorization: Bearer) "
        "and by the KV endpoint, sent with KV pulls and acks. /health, /ready and /metrics stay open. "
        "Without it the worker is unauthenticated (a warning says so)",
    )
    s = p.add_argument_group("serving")
    s.add_argument("--max-request-bytes", type=int, default=None, help="larger bodies get 413 (default 4 MiB)")
    s.add_argument(
        "--max-tokens-limit",
        dest="max_tokens",
        type=int,
        default=None,
        help="largest max_tokens a request may ask for (default: the model length)",
    )
    s.add_argument("--max-n", type=int, default=None, help="largest n a request may ask for (default 16)")
    s.add_argument("--max-logprobs", type=int, default=None, help="largest logprobs / top_logprobs (default 20)")
    s.add_argument(
        "--max-prompts",
        type=int,
        default=None,
        help=f"most prompts in one /v1/completions request: each is its own sequence, prefill and KV lease "
        f"(default {DEFAULT_MAX_PROMPTS}); more get 400",
    )
    s.add_argument("--retry-after", type=int, default=None, help="Retry-After seconds on 503 (default 1)")
    s.add_argument(
        "--drain-timeout", default=None, help="on SIGTERM, abort what is still running after this long (default 60s)"
    )
    s.add_argument(
        "--heartbeat-interval",
        default=None,
        help="a stream that waits this long for its next event (queued, prefilling, KV in flight) gets an "
        "SSE comment `: keep-alive`, and again each interval (default 10s; 0: never). Until the first "
        "token the status waits for it, as without heartbeats, for up to one interval",
    )
    s.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


# Engine config file keys (operator/pdfleet_operator/kube/render.py engine_config) -> our field names.
_FILE_KEYS = {
    "served_model_name",
    "dtype",
    "max_model_len",
    "block_size",
    "kv_cache_memory_fraction",
    "num_kv_blocks",
    "kv_cache_dtype",
    "quantization",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_num_waiting",
    "enable_prefix_caching",
    "kv_transfer",
    "device",
    "num_threads",
    "kv_offload",
    "preemption",
    "swap_space_bytes",
}


def load_engine_file(path: str) -> dict[str, Any]:
    with open(path) as f:
        raw = json.load(f)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the engine config must be a JSON object")
    unknown = sorted(set(raw) - _FILE_KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown engine config keys {unknown}; known: {sorted(_FILE_KEYS)}")
    out = {k: v for k, v in raw.items() if k not in ("kv_transfer", "kv_offload", "swap_space_bytes")}
    off = raw.get("kv_offload") or {}
    if not isinstance(off, dict):
        raise ValueError(f"{path}: kv_offload must be an object")
    unknown = sorted(set(off) - {"host_memory_bytes", "disk_bytes", "disk_path"})
    if unknown:
        raise ValueError(f"{path}: unknown kv_offload keys {unknown}; known: disk_bytes, disk_path, host_memory_bytes")
    for key, field in (
        ("host_memory_bytes", "kv_offload_host_memory"),
        ("disk_bytes", "kv_offload_disk"),
        ("disk_path", "kv_offload_disk_path"),
    ):
        if key in off:
            out[field] = off[key]
    if "swap_space_bytes" in raw:
        out["swap_space"] = raw["swap_space_bytes"]
    kv = raw.get("kv_transfer") or {}
    if not isinstance(kv, dict):
        raise ValueError(f"{path}: kv_transfer must be an object")
    for key, field in (
        ("timeout_seconds", "kv_transfer_timeout"),
        ("lease_seconds", "kv_lease"),
        ("on_failure", "kv_on_failure"),
        ("connector", "kv_connector"),
    ):
        if key in kv:
            out[field] = kv[key]
    return out


def from_args(args: argparse.Namespace) -> WorkerConfig:
    file = load_engine_file(args.engine_config) if args.engine_config else {}

    def pick(name: str, default: Any) -> Any:
        value = getattr(args, name, None)
        if value is not None:
            return value
        return file.get(name, default)

    model = args.model
    if not os.path.isdir(model):
        raise ValueError(f"--model {model}: not a directory")
    dtype = pick("dtype", "float32")
    if dtype == "float16":
        raise ValueError("dtype float16 is not supported by the pdfleet engine; use bfloat16 or float32")
    model_cfg = ModelConfig.from_dir(model)
    block_size = pick("block_size", 16)
    num_kv_blocks = pick("num_kv_blocks", None)
    fraction = pick("kv_cache_memory_fraction", 0.85)
    accelerator_class = pick("accelerator", None) or os.environ.get("PDFLEET_ACCELERATOR")
    device = devices.resolve_device(pick("device", "auto"), accelerator_class)
    max_num_seqs = pick("max_num_seqs", 64)
    max_model_len = pick("max_model_len", None)
    kv_dtype = pick("kv_cache_dtype", "auto")
    quantization = pick("quantization", "none")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    kv_bytes = 1 << 30
    offload_host = parse_size(pick("kv_offload_host_memory", 0), "kv_offload_host_memory")
    preemption = pick("preemption", "recompute")
    swap_space = parse_size(pick("swap_space", 1 << 30), "swap_space")
    if num_kv_blocks is None:
        if not 0 < fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {fraction}")
        kv_bytes = kv_cache_bytes(
            model,
            model_cfg,
            fraction=fraction,
            device=device,
            dtype=dtype,
            kv_dtype=kv_dtype,
            quantization=quantization,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len or model_cfg.max_position_embeddings,
            host_reserved=offload_host + (swap_space if preemption == "swap" else 0),
        )
    engine = EngineConfig(
        model=model,
        dtype=dtype,
        device=device,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        kv_cache_memory_bytes=kv_bytes,
        kv_cache_dtype=kv_dtype,
        quantization=quantization,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=pick("max_num_batched_tokens", 512),
        partial_prefill=pick("partial_prefill", "auto"),
        max_model_len=max_model_len,
        max_num_waiting=pick("max_num_waiting", 1024),
        enable_prefix_caching=pick("enable_prefix_caching", True),
        num_threads=_threads(pick("num_threads", None), model),
        attention_backend=pick("attention_backend", "auto"),
        kv_offload_host_bytes=offload_host,
        kv_offload_disk_bytes=parse_size(pick("kv_offload_disk", 0), "kv_offload_disk"),
        kv_offload_disk_dir=pick("kv_offload_disk_path", None),
        preemption=preemption,
        swap_space_bytes=swap_space,
    )
    return WorkerConfig(
        engine=engine,
        served_model_name=pick("served_model_name", None) or os.path.basename(os.path.normpath(model)),
        role=pick("role", "both"),
        host=pick("host", "127.0.0.1"),
        port=pick("port", 8000),
        accelerator=accelerator_class or "cpu",
        revision=getattr(args, "revision", None) or os.environ.get("PDFLEET_REVISION") or None,
        kv_cache_memory_fraction=None if num_kv_blocks is not None else fraction,
        kv_transfer_timeout_s=parse_duration(pick("kv_transfer_timeout", 10.0)),
        kv_lease_s=parse_duration(pick("kv_lease", 30.0)),
        kv_on_failure=pick("kv_on_failure", "recompute"),
        kv_connector=pick("kv_connector", "tcp"),
        kv_host=pick("kv_host", None),
        kv_port=pick("kv_port", 0),
        kv_peers=pick("kv_peers", kvpeers.LOOPBACK),
        auth_token_file=pick("auth_token_file", None),
        max_request_bytes=pick("max_request_bytes", 4 << 20),
        max_tokens=pick("max_tokens", None),
        max_n=pick("max_n", 16),
        max_logprobs=pick("max_logprobs", 20),
        max_prompts=pick("max_prompts", DEFAULT_MAX_PROMPTS),
        retry_after_s=pick("retry_after", 1),
        drain_timeout_s=parse_duration(pick("drain_timeout", 60.0)),
        heartbeat_interval_s=parse_duration(pick("heartbeat_interval", 10.0)),
    )


def _threads(setting: int | str | None, model: str) -> int:
    plan = threads.resolve(setting, model=model)
    logging.getLogger("pdfleet.worker").info("%s", plan.describe())
    return plan.threads


def int8_weight_bytes(cfg: ModelConfig, elem: int) -> int:
    """Loaded bytes of an int8 model: every linear weight (the LM head included, its own copy when tied)
    at 1 byte plus a scale per row, the embedding table and the norms at `elem` bytes."""
    emb = cfg.vocab_size * cfg.hidden_size
    linear = cfg.num_params - emb * (1 if cfg.tie_word_embeddings else 2) - (2 * cfg.num_layers + 1) * cfg.hidden_size
    linear += emb  # the LM head
    h, d = cfg.hidden_size, cfg.head_dim
    rows = (
        cfg.num_layers * ((cfg.num_heads + 2 * cfg.num_kv_heads) * d + h + 2 * cfg.intermediate_size + h)
        + cfg.vocab_size
    )
    return linear + rows * elem + (emb + (2 * cfg.num_layers + 1) * h) * elem


def kv_cache_bytes(
    model_dir: str,
    cfg: ModelConfig,
    *,
    fraction: float,
    device: str,
    dtype: str,
    kv_dtype: str,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    quantization: str = "none",
    cgroup_dirs: Sequence[Path] | None = None,
    host_reserved: int = 0,
) -> int:
    """KV pool bytes: `fraction` of the memory left after the weights (the device's; on the CPU the headroom
    under the pod's cgroup limit, see device.free_memory), but no more than max_num_seqs sequences of
    max_model_len tokens can use (a CPU has far more memory than that)."""
    elem = {"float32": 4, "bfloat16": 2}[dtype]
    # NOTE: the files' size, not the loaded size: an fp32 checkpoint served in bf16 leaves more
    # room than this counts, which errs on the safe side.
    weights = sum(os.path.getsize(p) for p in glob.glob(os.path.join(model_dir, "*.safetensors")))
    if quantization == "int8":
        weights = int8_weight_bytes(cfg, elem)
    memory = devices.free_memory(device, cgroup_dirs)
    free = memory.bytes
    if device == "cpu":  # the host offload tier and swap space live in the same memory as the pool
        free -= host_reserved
    budget = int((free - weights) * fraction)
    kv_elem = 1 if kv_dtype == "int8" else elem
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_elem
    blocks_per_seq = -(-max_model_len // block_size)
    cap = max_num_seqs * blocks_per_seq * block_size * per_token
    if budget < block_size * per_token:
        raise ValueError(
            f"no memory for the KV cache: {free / 2**30:.1f} GiB free ({memory.source}), "
            f"weights {weights / 2**30:.1f} GiB, fraction {fraction}"
        )
    return min(budget, cap)
