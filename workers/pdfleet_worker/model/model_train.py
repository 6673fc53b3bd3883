"""Trains a model directory for a bounded time on local text (the standard library's sources) and measures held-out
perplexity; `pdfleet model init --train-*` and bench/levers.py call it.

Random weights cannot show what quantization costs (every output is noise either way), so the
quality figures of bench/levers.py come from a model trained here for a few minutes: next-token
prediction on the Python standard library's own sources, the text `model_init` trains its tokenizer
on. Files are split by position: every HELD_OUT_EVERY-th file is held out, never trained on.

The network is the engine's own (`model.llama.LlamaForCausalLM`, loaded by `model.loader`) run by
`forward_logits`, a plain causal forward over [B, T] token ids (torch SDPA, no paged KV): it is
differentiable, and it runs whatever linear layers the model holds (nn.Linear, or the Int8Linear of
an int8 load), so the same function measures the fp32 and the int8 model on the same tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable

import torch
from torch import nn

from pdfleet_worker.layers.packed_linear import NO_FAST_BF16, fast_bf16
from pdfleet_worker.model.llama import LlamaForCausalLM, rope_cos_sin

HELD_OUT_EVERY = 10


@dataclasses.dataclass(frozen=True)
class TrainResult:
    steps: int
    tokens: int
    seconds: float
    train_loss: float  # mean loss of the last 10 steps
    held_out_ppl_before: float
    held_out_ppl: float


def _rms(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    xf = x.float()
    return norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype)


def forward_logits(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Causal logits [B, T, V] (fp32) for token ids [B, T]: the engine's network without its KV cache."""
    cfg = model.config
    b, t = ids.shape
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    cos, sin = rope_cos_sin(cfg, t)
    dtype = model.embed_tokens.weight.dtype
    cos, sin = cos.to(dtype)[None, :, None], sin.to(dtype)[None, :, None]  # [1, T, 1, D]
    h = model.embed_tokens(ids)
    for layer in model.layers:
        a = layer.self_attn
        x = _rms(h, layer.input_layernorm).reshape(b * t, -1)
        heads = a.qkv_proj.forward(x).view(b, t, hq + 2 * hkv, d)
        qk = heads[:, :, : hq + hkv]
        qk = qk * cos + qk.roll(d // 2, -1) * sin  # rotate-half RoPE with the signed sin table
        q, k = qk[:, :, :hq].transpose(1, 2), qk[:, :, hq:].transpose(1, 2)
        v = heads[:, :, hq + hkv :].transpose(1, 2)
        o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hkv)
        h = h + a.o_proj.forward(o.transpose(1, 2).reshape(b * t, hq * d)).view(b, t, -1)
        x = _rms(h, layer.post_attention_layernorm).reshape(b * t, -1)
        gate, up = layer.mlp.gate_up_proj.forward(x).split(layer.mlp.intermediate_size, dim=-1)
        h = h + layer.mlp.down_proj.forward(nn.functional.silu(gate) * up).view(b, t, -1)
    h = _rms(h, model.norm)
    return model.lm_head.forward(h.reshape(b * t, -1)).float().view(b, t, -1)


def corpus_tokens(model_dir: str, max_bytes: int) -> tuple[list[int], list[int]]:
    """(train, held-out) token streams of the standard library's sources, split by file."""
    from pdfleet_worker.model import tokenizer as tok_mod
    from pdfleet_worker.model.model_init import training_corpus

    tok = tok_mod.Tokenizer(model_dir)
    texts, _ = training_corpus(max_bytes)
    train: list[int] = []
    held: list[int] = []
    eos = tok.eos_token_id
    for i, text in enumerate(texts):
        ids = tok.encode(text, add_special_tokens=False) + ([eos] if eos is not None else [])
        (held if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).extend(ids)
    return train, held


def held_out_batches(held: list[int], seq_len: int, max_seqs: int) -> torch.Tensor:
    """The first max_seqs non-overlapping windows of seq_len + 1 tokens: [N, seq_len + 1]."""
    n = min(max_seqs, (len(held) - 1) // seq_len)
    if n < 1:
        raise ValueError(f"held-out text has {len(held)} tokens; need more than {seq_len}")
    return torch.tensor([held[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)], dtype=torch.int64)


@torch.inference_mode()
def perplexity(model: LlamaForCausalLM, windows: torch.Tensor, batch: int = 4) -> float:
    """exp(mean next-token NLL) over every position of every window [N, T + 1]."""
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch]
        logits = forward_logits(model, w[:, :-1])
        nll = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum")
        total += float(nll)
        count += w[:, 1:].numel()
    return math.exp(total / count)


def save_hf(model: LlamaForCausalLM, model_dir: str, dtype: torch.dtype = torch.float32) -> None:
    """Write model.safetensors with Hugging Face names (the fused qkv / gate_up split back)."""
    from safetensors.torch import save_file

    cfg = model.config
    q, kv, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    sd = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = model.lm_head.weight
    for n, layer in enumerate(model.layers):
        p = f"model.layers.{n}."
        qkv = layer.self_attn.qkv_proj
        for name, rows in (
            ("q_proj", slice(0, q)),
            ("k_proj", slice(q, q + kv)),
            ("v_proj", slice(q + kv, q + 2 * kv)),
        ):
            sd[p + f"self_attn.{name}.weight"] = qkv.weight[rows]
            if qkv.bias is not None:
                sd[p + f"self_attn.{name}.bias"] = qkv.bias[rows]
        sd[p + "self_attn.o_proj.weight"] = layer.self_attn.o_proj.weight
        if layer.self_attn.o_proj.bias is not None:
            sd[p + "self_attn.o_proj.bias"] = layer.self_attn.o_proj.bias
        gu = layer.mlp.gate_up_proj
        sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = gu.weight[:i], gu.weight[i:]
        sd[p + "mlp.down_proj.weight"] = layer.mlp.down_proj.weight
        sd[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        sd[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    out = {k: v.detach().to(dtype).contiguous().clone() for k, v in sd.items()}
    tmp = os.path.join(model_dir, "model.safetensors.tmp")
    save_file(out, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(model_dir, "model.safetensors"))


def train(
    model_dir: str,
    *,
    minutes: float | None = None,
    steps: int | None = None,
    seq_len: int = 128,
    batch: int = 8,
    lr: float = 2e-3,
    seed: int = 0,
    eval_seqs: int = 32,
    max_corpus_bytes: int = 12_000_000,
    progress: Callable[[str], None] = print,
) -> TrainResult:
    """Train the model in `model_dir` in place (AdamW; bf16 autocast where the CPU has fast bf16, else fp32)
    until `steps` steps or `minutes` minutes, whichever comes first (at least one must be given), then save it
    as a normal HF checkpoint in its own dtype and record the run in tokenizer_config.json's pdfleet_init."""
    from pdfleet_worker.model.loader import load_model

    if minutes is None and steps is None:
        raise ValueError("train needs minutes or steps")
    if minutes is not None and not minutes > 0:
        raise ValueError(f"minutes must be > 0, got {minutes}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    with open(os.path.join(model_dir, "config.json")) as f:
        saved_dtype = {"bfloat16": torch.bfloat16}.get(json.load(f).get("torch_dtype"), torch.float32)
    loaded = load_model(model_dir, torch.float32)  # NOTE: inference tensors: copied into trainable ones
    model = LlamaForCausalLM(loaded.config)
    model.load_state_dict(loaded.state_dict())
    del loaded
    train_ids, held = corpus_tokens(model_dir, max_corpus_bytes)
    windows = held_out_batches(held, seq_len, eval_seqs)
    model.eval()
    ppl_before = perplexity(model, windows)
    model.train()
    progress(
        f"corpus: {len(train_ids)} training tokens, {len(held)} held out ({windows.numel()} scored); "
        f"held-out perplexity before training {ppl_before:.1f}"
    )
    data = torch.tensor(train_ids, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95)
    )
    bf16 = fast_bf16()
    progress("autocast to bf16" if bf16 else f"training in fp32: {NO_FAST_BF16}")
    warmup = 20
    budget_s = minutes * 60 if minutes is not None else math.inf
    start = time.perf_counter()
    losses: list[float] = []
    step = 0
    last_report = start
    while True:
        elapsed = time.perf_counter() - start
        if (steps is not None and step >= steps) or elapsed >= budget_s:
            break
        done = max(step / steps if steps else 0.0, elapsed / budget_s if budget_s < math.inf else 0.0)
        scale = min(1.0, (step + 1) / warmup) * max(0.1, 0.5 * (1 + math.cos(math.pi * min(done, 1.0))))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        starts = torch.randint(0, len(data) - seq_len - 1, (batch,), generator=g)
        x = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = forward_logits(model, x[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        losses.append(float(loss.detach()))
        now = time.perf_counter()
        if now - last_report >= 15 or step == 1 or step == steps:
            last_report = now
            left = f"{steps - step} steps" if steps else f"{max(0.0, budget_s - (now - start)):.0f} s"
            progress(
                f"step {step}: loss {losses[-1]:.3f} (mean of last 10 {sum(losses[-10:]) / len(losses[-10:]):.3f}), "
                f"lr {lr * scale:.2e}, {step * batch * seq_len / (now - start):.0f} tokens/s, {left} left"
            )
    seconds = time.perf_counter() - start
    model.eval()
    ppl = perplexity(model, windows)
    progress(
        f"trained {step} steps ({step * batch * seq_len} tokens) in {seconds:.0f} s; "
        f"held-out perplexity {ppl_before:.1f} -> {ppl:.2f}"
    )
    save_hf(model, model_dir, saved_dtype)
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        tok_cfg = json.load(f)
    before = tok_cfg.setdefault("pdfleet_init", {}).get("trained") or {}  # a second run continues the first
    tok_cfg["pdfleet_init"]["trained"] = {
        "steps": before.get("steps", 0) + step,
        "tokens": before.get("tokens", 0) + step * batch * seq_len,
        "runs": before.get("runs", 0) + 1,
        "seq_len": seq_len,
        "batch": batch,
        "lr": lr,
        "seed": seed,
        "held_out_every": HELD_OUT_EVERY,
        "autocast": "bfloat16" if bf16 else "off",
        "held_out_ppl": round(ppl, 4),
    }
    with open(cfg_path, "w") as f:
        json.dump(tok_cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    result = TrainResult(
        steps=step,
        tokens=step * batch * seq_len,
        seconds=seconds,
        train_loss=sum(losses[-10:]) / max(1, len(losses[-10:])),
        held_out_ppl_before=ppl_before,
        held_out_ppl=ppl,
    )
    return result
