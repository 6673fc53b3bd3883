"""Writes a randomly initialised model with a trained byte-level BPE tokenizer as a Hugging Face directory; `pdfleet
model init` and tests call it."""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import sysconfig

from pdfleet_worker.model import chat_templates

PRESETS = {
    # A few million parameters: tests and the demo start in seconds.
    "tiny": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=4096,
        max_position_embeddings=2048,
    ),
    # About 150M parameters (600 MB in fp32): the benchmark model.
    "small": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=16,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
}
ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}
BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]
# ChatML; with tools, Qwen2.5's <tool_call> format (model/chat_templates.py).
CHAT_TEMPLATE = chat_templates.CHATML_TOOLS
# A little non-ASCII text so some merges cover other scripts; any UTF-8 round-trips regardless,
# since the byte-level alphabet holds all 256 bytes.
EXTRA_TEXT = """
Le modèle répond en français, en español y en português também. Größe, Übergröße, naïve café.
Модель отвечает по-русски. Το μοντέλο απαντά στα ελληνικά. 模型用中文回答问题。日本語でも答えます。
한국어로도 대답합니다. النموذج يجيب بالعربية. המודל עונה בעברית. मॉडल हिंदी में उत्तर देता है। 🙂🚀✓
"""


@dataclasses.dataclass(frozen=True)
class InitResult:
    path: str
    num_params: int
    vocab_size: int
    corpus_sha256: str


def training_corpus(max_bytes: int) -> tuple[list[str], str]:
    """Deterministic local text: the standard library's own sources (top level first, then
    packages, each sorted by path; no site-packages), then EXTRA_TEXT."""
    stdlib = sysconfig.get_paths()["stdlib"]
    top = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    nested = sorted(
        p
        for p in glob.glob(os.path.join(stdlib, "*", "**", "*.py"), recursive=True)
        if "site-packages" not in p and "dist-packages" not in p
    )
    texts, size = [], 0
    for path in top + nested:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        texts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    texts.append(EXTRA_TEXT)
    digest = hashlib.sha256("\0".join(texts).encode()).hexdigest()
    return texts, digest


def train_tokenizer(vocab_size: int, max_corpus_bytes: int):
    """A byte-level BPE (GPT-2 style pre-tokenizer, no normalizer) that adds BOS on encode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
    )
    texts, digest = training_corpus(max_corpus_bytes)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok, digest


def _hf_config(preset: dict, arch: str, vocab_size: int, ids: dict[str, int], dtype: str, tie: bool) -> dict:
    architecture, model_type = ARCHS[arch]
    heads = preset["num_attention_heads"]
    cfg = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": preset["hidden_size"],
        "intermediate_size": preset["intermediate_size"],
        "num_hidden_layers": preset["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": preset["num_key_value_heads"],
        "head_dim": preset["hidden_size"] // heads,
        "hidden_act": "silu",
        "max_position_embeddings": preset["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 500000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "initializer_range": 0.02,
        "tie_word_embeddings": tie,
        "vocab_size": vocab_size,
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        "pad_token_id": None,
        "dtype": dtype,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    else:
        cfg.update(use_sliding_window=False, sliding_window=None)
    return cfg


def random_state_dict(cfg: dict, seed: int, dtype: str) -> dict:
    """HF-named tensors drawn from N(0, 0.02) (norms at 1, biases at 0) with a seeded generator."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def normal(*shape):
        return (torch.randn(*shape, generator=g) * cfg["initializer_range"]).to(tdtype)

    sd = {"model.embed_tokens.weight": normal(cfg["vocab_size"], h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        sd[p + "self_attn.q_proj.weight"] = normal(nh * d, h)
        sd[p + "self_attn.k_proj.weight"] = normal(nkv * d, h)
        sd[p + "self_attn.v_proj.weight"] = normal(nkv * d, h)
        sd[p + "self_attn.o_proj.weight"] = normal(h, nh * d)
        if cfg["model_type"] == "qwen2":
            # NOTE: nonzero biases so tests exercise them (a trained model has them too).
            sd[p + "self_attn.q_proj.bias"] = normal(nh * d)
            sd[p + "self_attn.k_proj.bias"] = normal(nkv * d)
            sd[p + "self_attn.v_proj.bias"] = normal(nkv * d)
        sd[p + "mlp.gate_proj.weight"] = normal(i, h)
        sd[p + "mlp.up_proj.weight"] = normal(i, h)
        sd[p + "mlp.down_proj.weight"] = normal(h, i)
        sd[p + "input_layernorm.weight"] = torch.ones(h, dtype=tdtype)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=tdtype)
    sd["model.norm.weight"] = torch.ones(h, dtype=tdtype)
    if not cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = normal(cfg["vocab_size"], h)
    return sd


def made_by_init(path: str) -> dict | None:
    """What `pdfleet model init` wrote at `path` ({"preset", "seed", "arch"}), or None when `path` holds no
    model.safetensors. Raises ValueError for a model that init did not write (no record of it)."""
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        return None
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            record = json.load(f)["pdfleet_init"]
        with open(os.path.join(path, "config.json")) as f:
            model_type = json.load(f)["model_type"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} holds a model that `pdfleet model init` did not write ({e})") from e
    arch = next((a for a, (_, t) in ARCHS.items() if t == model_type), model_type)
    return {"preset": record.get("preset"), "seed": record.get("seed"), "arch": arch}


def init_model(
    path: str,
    preset: str = "tiny",
    *,
    arch: str = "llama",
    dtype: str = "float32",
    seed: int = 0,
    tie_word_embeddings: bool = False,
) -> InitResult:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
    generation_config.json to `path`. The same arguments give byte-identical files."""
    from safetensors.torch import save_file

    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    p = PRESETS[preset]
    tok, corpus_digest = train_tokenizer(
        p["vocab_size"], max_corpus_bytes=12_000_000 if preset == "small" else 1_000_000
    )
    vocab = tok.get_vocab_size(with_added_tokens=True)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    cfg = _hf_config(p, arch, vocab, ids, dtype, tie_word_embeddings)
    os.makedirs(path, exist_ok=True)
    sd = random_state_dict(cfg, seed, dtype)
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    tok.save(os.path.join(path, "tokenizer.json"))
    files = {
        "config.json": cfg,
        "generation_config.json": {
            "bos_token_id": ids[BOS],
            "eos_token_id": [ids[EOS], ids[IM_END]],
            "do_sample": False,
        },
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": EOS,
            "add_bos_token": True,
            "clean_up_tokenization_spaces": False,
            "model_max_length": p["max_position_embeddings"],
            "chat_template": CHAT_TEMPLATE,
            "extra_special_tokens": [IM_START, IM_END],
            "pdfleet_init": {"preset": preset, "seed": seed, "corpus_sha256": corpus_digest},
        },
        "special_tokens_map.json": {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS},
    }
    for name, content in files.items():
        with open(os.path.join(path, name), "w") as f:
            json.dump(content, f, indent=2, sort_keys=True)
            f.write("\n")
    num_params = sum(t.numel() for t in sd.values())
    return InitResult(path=path, num_params=num_params, vocab_size=vocab, corpus_sha256=corpus_digest)
