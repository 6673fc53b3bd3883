"""Loads a Hugging Face model directory (config.json + sharded or single safetensors) into LlamaForCausalLM; LLMEngine calls it."""
from __future__ import annotations

import json
import os
import re

import torch

from pdfleet_worker.config import ModelConfig
from pdfleet_worker.model.llama import LlamaForCausalLM

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_QKV = {"self_attn.q_proj": 0, "self_attn.k_proj": 1, "self_attn.v_proj": 2}
_GATE_UP = {"mlp.gate_proj": 0, "mlp.up_proj": 1}


def weight_files(model_dir: str) -> list[str]:
    """The safetensors files of a directory: the shards named by the index, or the single file."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(model_dir, s))]
        if missing:
            raise FileNotFoundError(f"{model_dir}: shards named in model.safetensors.index.json are missing: {missing}")
        return [os.path.join(model_dir, s) for s in shards]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights (only safetensors checkpoints are supported)")
    return [os.path.join(model_dir, f) for f in files]


def _target(model: LlamaForCausalLM, cfg: ModelConfig, name: str) -> tuple[torch.Tensor, slice | None] | None:
    """Where an HF tensor goes: (our parameter, rows to fill or None for all); None if ignored."""
    if _IGNORED.search(name):
        return None
    if name == "model.embed_tokens.weight":
        return model.embed_tokens.weight, None
    if name == "model.norm.weight":
        return model.norm.weight, None
    if name == "lm_head.weight":
        return model.lm_head.weight, None
    m = _LAYER.match(name)
    if not m:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    layer = model.layers[int(m.group(1))]
    module, _, kind = m.group(2).rpartition(".")
    if module in _QKV:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        start = (0, q, q + kv)[_QKV[module]]
        rows = slice(start, start + (q if module.endswith("q_proj") else kv))
        return getattr(layer.self_attn.qkv_proj, kind), rows
    if module in _GATE_UP:
        i = cfg.intermediate_size
        rows = slice(_GATE_UP[module] * i, (_GATE_UP[module] + 1) * i)
        return getattr(layer.mlp.gate_up_proj, kind), rows
    try:
        return layer.get_parameter(f"{module}.{kind}"), None
    except AttributeError:
        raise ValueError(f"unexpected weight {name!r} in checkpoint") from None


@torch.inference_mode()
def load_model(model_dir: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """Build the network for `model_dir` and fill every parameter from its safetensors files."""
    from safetensors import safe_open

    cfg = ModelConfig.from_dir(model_dir)
    files = weight_files(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    filled: dict[int, int] = {}  # id(param) -> rows filled
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if cfg.tie_word_embeddings and name == "lm_head.weight":
                    continue
                target = _target(model, cfg, name)
                if target is None:
                    continue
                param, rows = target
                tensor = f.get_tensor(name)
                dest = param if rows is None else param[rows]
                if tuple(dest.shape) != tuple(tensor.shape):
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
                dest.copy_(tensor.to(dtype))
                filled[id(param)] = filled.get(id(param), 0) + tensor.shape[0]
    missing = [n for n, p in model.named_parameters() if filled.get(id(p), 0) != p.shape[0]]
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return model.eval()
