"""Model and engine configuration dataclasses; the loader builds ModelConfig, the CLI and server build EngineConfig."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16")
KV_CACHE_DTYPES = ("auto", "int8")
# Weight quantization at load (layers/quantized_linear.py); int4 is refused: see docs/engine.md.
QUANTIZATIONS = ("none", "int8")
PREEMPTION_MODES = ("recompute", "swap")
PARTIAL_PREFILL_MODES = ("auto", "fill")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the engine needs, read from a Hugging Face `config.json`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"config field {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling.rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )

    @property
    def num_params(self) -> int:
        """Parameter count as Hugging Face counts it (tied embeddings once)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        archs = raw.get("architectures") or []
        if not archs:
            by_type = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
            archs = [by_type.get(raw.get("model_type", ""), str(raw.get("model_type")))]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {raw.get('hidden_act')!r} is not supported (only silu)")
        # transformers 5 nests rope settings under rope_parameters; 4.x used rope_theta + rope_scaling.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        max_pos = int(raw.get("max_position_embeddings", 2048))
        window = raw.get("sliding_window")
        uses_window = window and (arch == "MistralForCausalLM" or raw.get("use_sliding_window"))
        if uses_window:
            # NOTE: no sliding-window kernel; within the window full attention is exact, so cap
            # the usable length there instead of computing something different.
            max_pos = min(max_pos, int(window))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else bool(raw.get("attention_bias", False)),
            o_bias=False if is_qwen2 else bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, model_dir: str) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{model_dir}: no config.json (not a Hugging Face model directory)")
        with open(path) as f:
            raw = json.load(f)
        cfg = cls.from_hf_dict(raw)
        gen_path = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                gen = json.load(f)
            eos = gen.get("eos_token_id")
            if eos is not None:
                extra = tuple(eos) if isinstance(eos, list) else (int(eos),)
                merged = tuple(dict.fromkeys(cfg.eos_token_ids + extra))
                cfg = dataclasses.replace(cfg, eos_token_ids=merged)
        return cfg


@dataclasses.dataclass
class EngineConfig:
    """How one engine runs: model, dtype, device, KV pool and batching limits."""

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    # KV pool size: num_kv_blocks wins when set, else kv_cache_memory_bytes decides.
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    kv_cache_dtype: str = "auto"
    quantization: str = "none"  # none | int8 (weight-only, per output channel, quantized at load)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # auto: a new prompt that would be cut at the end of a step's budget but runs whole in the next step waits
    # for it when the measured step cost says the cut would slow this step down (Scheduler); fill: always cut.
    partial_prefill: str = "auto"
    max_model_len: int | None = None
    max_num_waiting: int = 1024
    enable_prefix_caching: bool = True
    # Salt of the chained block hashes; equal on every worker that serves the same model.
    prefix_hash_seed: str = "pdfleet-v1"
    num_threads: int | None = None
    attention_backend: str = "auto"  # auto | reference | cpu | flex
    # Tiered KV offload (docs/engine.md): bytes of host RAM / of a memory-mapped file in kv_offload_disk_dir that
    # evicted prefix-cache blocks move to; 0 turns a tier off.
    kv_offload_host_bytes: int = 0
    kv_offload_disk_bytes: int = 0
    kv_offload_disk_dir: str | None = None  # default: $TMPDIR
    # Preemption: recompute, or swap the victim's KV to swap_space_bytes of host RAM and back.
    preemption: str = "recompute"
    swap_space_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            hint = " (int4 is not offered: see docs/engine.md)" if self.quantization == "int4" else ""
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}{hint}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.partial_prefill not in PARTIAL_PREFILL_MODES:
            raise ValueError(f"partial_prefill must be one of {PARTIAL_PREFILL_MODES}, got {self.partial_prefill!r}")
        if self.max_num_waiting < 1:
            raise ValueError(f"max_num_waiting must be >= 1, got {self.max_num_waiting}")
        for name in ("kv_offload_host_bytes", "kv_offload_disk_bytes", "swap_space_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {self.preemption!r}")
        if self.preemption == "swap" and self.swap_space_bytes < 1:
            raise ValueError("preemption swap needs swap_space_bytes >= 1")
        if self.attention_backend not in ("auto", "reference", "cpu", "flex"):
            raise ValueError(f"attention_backend must be auto|reference|cpu|flex, got {self.attention_backend!r}")

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)
