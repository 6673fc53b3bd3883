"""What a pool's worker process runs: its engine config file and its command line, from the spec.

Neutral ground for the two backends that start workers: `kube.render` puts them in pod templates,
`local.supervisor` in the processes of `pdfleet up`. Pure; no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pdfleet_operator.api import WORKER_ROLE, InferenceDeploymentSpec, parse_duration


def engine_config(spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """The worker's engine settings (keys as pdfleet_worker.config.EngineConfig names them)."""
    e = spec.engine
    return {
        "served_model_name": spec.model.name,
        "dtype": spec.model.dtype,
        "max_model_len": spec.model.max_model_len,
        "block_size": e.block_size,
        "kv_cache_memory_fraction": e.kv_cache_memory_fraction,
        "kv_cache_dtype": e.kv_cache_dtype,
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


def config_text(spec: InferenceDeploymentSpec) -> str:
    return json.dumps(engine_config(spec), indent=2, sort_keys=True) + "\n"


def worker_args(spec: InferenceDeploymentSpec, role: str, *, model_dir: str, host: str, port: int,
                engine_config: str, flags: Sequence[str] = ()) -> list[str]:
    """`pdfleet worker` arguments: the model, the role, where to listen, the engine config file, then the
    backend's own `flags` and the spec's `engine.extraArgs` (last, so a user's flag wins)."""
    return ["worker", "--model", model_dir, "--role", WORKER_ROLE[role], "--host", host, "--port", str(port),
            "--engine-config", engine_config, *flags, *spec.engine.extra_args]
