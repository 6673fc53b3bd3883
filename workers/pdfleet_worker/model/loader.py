"""Loads a Hugging Face model directory (config.json + sharded or single safetensors) into LlamaForCausalLM; LLMEngine
calls it."""

from __future__ import annotations

import json
import os
import re

import torch

from pdfleet_worker.config import ModelConfig
from pdfleet_worker.layers.quantized_linear import QUANTIZATIONS, Int8Linear, replace_linears
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


def _target(
    model: LlamaForCausalLM, cfg: ModelConfig, name: str
) -> tuple[torch.Tensor | Int8Linear, slice | None] | None:
    """Where an HF tensor goes: (our parameter, or the Int8Linear that quantizes it, rows to fill or None
    for all); None if ignored."""
    if _IGNORED.search(name):
        return None
    if name == "model.embed_tokens.weight":
        return model.embed_tokens.weight, None
    if name == "model.norm.weight":
        return model.norm.weight, None
    if name == "lm_head.weight":
        return _weight_of(model.lm_head, "weight"), None
    m = _LAYER.match(name)
    if not m:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    layer = model.layers[int(m.group(1))]
    module, _, kind = m.group(2).rpartition(".")
    if module in _QKV:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        start = (0, q, q + kv)[_QKV[module]]
        rows = slice(start, start + (q if module.endswith("q_proj") else kv))
        return _weight_of(layer.self_attn.qkv_proj, kind), rows
    if module in _GATE_UP:
        i = cfg.intermediate_size
        rows = slice(_GATE_UP[module] * i, (_GATE_UP[module] + 1) * i)
        return _weight_of(layer.mlp.gate_up_proj, kind), rows
    try:
        sub = layer.get_submodule(module)
    except AttributeError:
        raise ValueError(f"unexpected weight {name!r} in checkpoint") from None
    if isinstance(sub, Int8Linear) and kind == "weight":
        return sub, None
    try:
        return layer.get_parameter(f"{module}.{kind}"), None
    except AttributeError:
        raise ValueError(f"unexpected weight {name!r} in checkpoint") from None


def _weight_of(module: torch.nn.Module, kind: str) -> torch.Tensor | Int8Linear:
    """A linear's parameter `kind`; an Int8Linear itself for its weight (it quantizes what it is given)."""
    if isinstance(module, Int8Linear) and kind == "weight":
        return module
    return getattr(module, kind)


@torch.inference_mode()
def load_model(
    model_dir: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", quantization: str = "none"
) -> LlamaForCausalLM:
    """Build the network for `model_dir` and fill every parameter from its safetensors files.

    quantization "int8": every linear layer (q/k/v/o, gate/up/down, the LM head) becomes an Int8Linear,
    each checkpoint tensor quantized as it is read (the float copy of the model never exists); the
    embedding table and the norms stay in `dtype`."""
    from safetensors import safe_open

    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    cfg = ModelConfig.from_dir(model_dir)
    files = weight_files(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
        if quantization == "int8":
            replace_linears(model)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings and quantization == "none":
        model.lm_head.weight = model.embed_tokens.weight
    filled: dict[int, int] = {}  # id(param, or Int8Linear) -> rows filled
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
                if isinstance(param, Int8Linear):
                    try:
                        param.fill_rows(rows, tensor)
                    except ValueError as e:
                        raise ValueError(f"weight {name!r}: {e}") from None
                    filled[id(param)] = filled.get(id(param), 0) + tensor.shape[0]
                    continue
                dest = param if rows is None else param[rows]
                if tuple(dest.shape) != tuple(tensor.shape):
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
                dest.copy_(tensor.to(dtype))
                filled[id(param)] = filled.get(id(param), 0) + tensor.shape[0]
    if cfg.tie_word_embeddings and isinstance(model.lm_head, Int8Linear) and id(model.embed_tokens.weight) in filled:
        # NOTE: tied: the LM head is the embedding table, quantized here into its own int8 copy.
        model.lm_head.fill_rows(None, model.embed_tokens.weight)
        filled[id(model.lm_head)] = model.lm_head.out_features
    missing = [n for n, p in model.named_parameters() if filled.get(id(p), 0) != p.shape[0]]
    missing += [
        n for n, m in model.named_modules() if isinstance(m, Int8Linear) and filled.get(id(m), 0) != m.out_features
    ]
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return model.eval()
