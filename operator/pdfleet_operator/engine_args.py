"""What a pool's worker process runs: its engine config file and its command line, from the spec.

Neutral ground for the two backends that start workers: `kube.render` puts them in pod templates,
`local.supervisor` in the processes of `pdfleet up`. Pure; no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pdfleet_operator.api import WORKER_ROLE, InferenceDeploymentSpec, parse_duration, parse_quantity

# How long a router or worker told to stop (SIGTERM: a scale-down, a rollout, a node drain) keeps serving what it
# already has: long enough for the longest request it can hold, maxModelLen tokens at the ITL target, within bounds.
DRAIN_FLOOR_S = 30.0
DRAIN_CAP_S = 600.0
# A pod's grace period is its drain plus this much to shut down before SIGKILL: a worker's worst case after its
# drain is about 22 s (2 s to answer aborted requests, 5 s for uvicorn, 5 s for KV threads, 10 s for the engine).
SHUTDOWN_MARGIN_S = 25


def drain_seconds(spec: InferenceDeploymentSpec) -> float:
    """Seconds a draining router or worker lets in-flight requests finish before it ends them with an error: the
    longest request (maxModelLen tokens at the ITL target) and, for a prefill worker, a KV lease it granted.

    NOTE: capped at DRAIN_CAP_S (10 min): a 128K-token context at 50 ms per token would hold a node drain for
    almost two hours; a request still running at the cap gets an error event, never silence.
    """
    longest = max(
        spec.model.max_model_len * parse_duration(spec.slo.itl), parse_duration(spec.engine.kv_transfer.lease)
    )
    return round(min(DRAIN_CAP_S, max(DRAIN_FLOOR_S, longest)), 1)


def grace_seconds(spec: InferenceDeploymentSpec) -> int:
    """A router or worker pod's terminationGracePeriodSeconds: its drain, then the shutdown margin."""
    return int(-(-drain_seconds(spec) // 1)) + SHUTDOWN_MARGIN_S


def engine_config(spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """The worker's engine settings (keys as pdfleet_worker.config.EngineConfig names them)."""
    e = spec.engine
    return {
        **_offload_config(spec),
        "served_model_name": spec.model.name,
        "dtype": spec.model.dtype,
        "max_model_len": spec.model.max_model_len,
        "block_size": e.block_size,
        "kv_cache_memory_fraction": e.kv_cache_memory_fraction,
        "kv_cache_dtype": e.kv_cache_dtype,
        **({"quantization": e.quantization} if e.quantization != "none" else {}),  # absent: today's file
        "max_num_seqs": e.max_num_seqs,
        "max_num_batched_tokens": e.max_num_batched_tokens,
        "max_num_waiting": e.max_waiting_requests,
        "enable_prefix_caching": e.enable_prefix_caching,
        "kv_transfer": {
            "timeout_seconds": parse_duration(e.kv_transfer.timeout),
            "lease_seconds": parse_duration(e.kv_transfer.lease),
            "on_failure": e.kv_transfer.on_failure,
        },
    }


def _offload_config(spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """engine.kvOffload and engine.preemption swap, only when set (an engine file without them is today's)."""
    e, out = spec.engine, {}
    if e.kv_offload is not None:
        off = e.kv_offload
        out["kv_offload"] = {
            "host_memory_bytes": int(parse_quantity(off.host_memory or 0)),
            "disk_bytes": int(parse_quantity(off.disk or 0)),
            "disk_path": off.disk_path,
        }
    if e.preemption == "swap":
        out["preemption"] = "swap"
        out["swap_space_bytes"] = int(parse_quantity(e.swap_space))
    return out


def host_memory_bytes(spec: InferenceDeploymentSpec) -> int:
    """Host RAM a pdfleet worker takes beyond its weights and KV pool: the host offload tier and swap space."""
    e = spec.engine
    host = int(parse_quantity(e.kv_offload.host_memory or 0)) if e.kv_offload is not None else 0
    return host + (int(parse_quantity(e.swap_space)) if e.preemption == "swap" else 0)


def config_text(spec: InferenceDeploymentSpec) -> str:
    return json.dumps(engine_config(spec), indent=2, sort_keys=True) + "\n"


def worker_args(
    spec: InferenceDeploymentSpec,
    role: str,
    *,
    model_dir: str,
    host: str,
    port: int,
    engine_config: str,
    flags: Sequence[str] = (),
) -> list[str]:
    """`pdfleet worker` arguments: the model, the role, where to listen, the engine config file, then the
    backend's own `flags` and the spec's `engine.extraArgs` (last, so a user's flag wins)."""
    return [
        "worker",
        "--model",
        model_dir,
        "--role",
        WORKER_ROLE[role],
        "--host",
        host,
        "--port",
        str(port),
        "--engine-config",
        engine_config,
        "--heartbeat-interval",
        f"{parse_duration(spec.router.heartbeat_interval):g}s",
        "--drain-timeout",
        f"{drain_seconds(spec):g}s",
        *flags,
        *spec.engine.extra_args,
    ]


def router_args(
    spec: InferenceDeploymentSpec,
    *,
    route_to: str | None = None,
    tokenizer_dir: str | None = None,
    pd_min_prompt_tokens: int = 0,
) -> list[str]:
    """The `pdfleet router` flags the spec decides: the heartbeat interval, the prompt length below which PD requests
    skip the prefill pool (`decide.pd_threshold.threshold`, which needs the classes: the caller passes it) and, with
    `spec.routing`, the rules and `route_to`, the URL of the target deployment's router (each backend knows where
    that runs); `tokenizer_dir`: where the router reads the model's tokenizer, needed by `rules.maxPromptTokens`."""
    out = [
        "--heartbeat-interval",
        f"{parse_duration(spec.router.heartbeat_interval):g}",
        "--drain-timeout",
        f"{drain_seconds(spec):g}",
    ]
    if pd_min_prompt_tokens > 0:
        out += ["--pd-min-prompt-tokens", str(pd_min_prompt_tokens)]
    routing = spec.routing
    if routing is None:
        return out
    if route_to is None:
        raise ValueError("spec.routing is set: the router needs the target's URL")
    out += ["--route-to", route_to]
    rules = routing.rules
    for flag, value in (
        ("--route-max-prompt-tokens", rules.max_prompt_tokens),
        ("--route-max-prompt-chars", rules.max_prompt_chars),
        ("--route-max-tokens", rules.max_tokens),
    ):
        if value is not None:
            out += [flag, str(value)]
    for pattern in rules.patterns:
        out += ["--route-pattern", pattern]
    for pattern in rules.exclude_patterns:
        out += ["--route-exclude-pattern", pattern]
    if routing.classifier is not None:
        out += [
            "--route-classifier",
            routing.classifier.entry_point,
            "--route-classifier-timeout",
            f"{parse_duration(routing.classifier.timeout):g}",
            "--route-confidence-floor",
            f"{routing.confidence_floor:g}",
        ]
    if rules.max_prompt_tokens is not None:
        if tokenizer_dir is None:
            raise ValueError("spec.routing.rules.maxPromptTokens: the router needs the model's tokenizer directory")
        out += ["--route-tokenizer", tokenizer_dir]
    return out


# --- vLLM (and the vendors' builds of it) -------------------------------------------------------------------

VLLM_PORT = 8000


def vllm_args(
    spec: InferenceDeploymentSpec,
    role: str,
    *,
    host: str,
    port: int,
    tensor_parallel: int = 1,
    kv_connector: str | None = None,
    block_size: int | None = None,
) -> list[str]:
    """`vllm serve MODEL` flags (after the model) from the same spec fields the pdfleet worker reads.

    NOTE: vLLM's --gpu-memory-utilization is the share of device memory for weights and KV together, the
    pdfleet worker's kvCacheMemoryFraction the share of what the weights leave; the one field maps to both
    (a close, not equal, meaning). maxWaitingRequests has no vLLM flag: vLLM queues without a bound.
    A prefill/decode pool (`kv_connector`) gets vLLM's own KV transfer with the role both sides play. `block_size`:
    the one the pool's vLLM build computes with, when not the spec's (decide.kv_connectors.block_size).
    """
    e = spec.engine
    args = [
        "--served-model-name",
        spec.model.name,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        spec.model.dtype,
        "--max-model-len",
        str(spec.model.max_model_len),
        "--block-size",
        str(block_size or e.block_size),
        "--gpu-memory-utilization",
        f"{e.kv_cache_memory_fraction:g}",
        "--max-num-seqs",
        str(e.max_num_seqs),
        "--max-num-batched-tokens",
        str(e.max_num_batched_tokens),
        "--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching",
        "--kv-cache-dtype",
        "auto",
        "--tensor-parallel-size",
        str(tensor_parallel),
    ]
    if kv_connector is not None:
        assert role in ("prefill", "decode"), f"a KV connector for a {role} pool"
        # NOTE: NIXL is symmetric (both sides register their KV and pull); the others name the direction.
        kv_role = (
            "kv_both" if kv_connector == "NixlConnector" else ("kv_producer" if role == "prefill" else "kv_consumer")
        )
        transfer = {"kv_connector": kv_connector, "kv_role": kv_role}
        args += ["--kv-transfer-config", json.dumps(transfer, separators=(",", ":"), sort_keys=True)]
    if e.kv_offload is not None and e.kv_offload.host_memory is not None:
        # NOTE: vLLM's native CPU offload (CacheConfig.kv_offloading_size, GiB, the sum over TP ranks); runtimes
        # refuses it where vLLM cannot run it (CPU classes, next to a PD KV connector).
        args += [
            "--kv-offloading-size",
            f"{parse_quantity(e.kv_offload.host_memory) / 2**30:g}",
            "--kv-offloading-backend",
            "native",
        ]
    return args + list(e.vllm.extra_args if e.vllm else ())
