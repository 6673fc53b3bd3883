"""The Llama / Qwen2 / Mistral decoder in plain PyTorch over flattened tokens; ModelRunner calls it."""

from __future__ import annotations

import math

import torch
from torch import nn

from pdfleet_worker.config import ModelConfig
from pdfleet_worker.layers import attention
from pdfleet_worker.layers.attention import AttentionMetadata, KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self._doubled_weight: torch.Tensor | None = None  # [weight, weight], for the fp32 path
        self.cpu_kernels = False  # set by use_cpu_kernels

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x) -> [T, dim]; with delta, x += delta first, in place (x is the residual stream)."""
        if self.cpu_kernels and not torch.compiler.is_compiling():
            return torch.ops.pdfleet.add_rms_norm(x, delta, self.weight, self.eps)
        if delta is not None:
            x.add_(delta)
        if x.dtype == torch.float32:
            # NOTE: [x, -x] has mean 0 and variance mean(x^2), so LayerNorm over it is RMSNorm of
            # x (same eps) in one fused kernel; torch's rms_norm runs ~8 small kernels on CPU,
            # which is most of a batch-1 decode step's norm time.
            # Built on first use: the loader fills weights in place before any forward (whoever
            # changes `weight` later must reset _doubled_weight).
            w = self._doubled_weight
            if w is None:
                w = self._doubled_weight = torch.cat((self.weight, self.weight)).detach()
            d = x.shape[-1]
            y = nn.functional.layer_norm(torch.cat((x, -x), -1), (2 * d,), w, None, self.eps)
            return y[..., :d]
        # NOTE: computed in fp32 and cast back before the weight, as Hugging Face does.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] with linear or Llama-3 scaling applied."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(cfg: ModelConfig, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables: [max_len, head_dim] in fp32 (rotate-half layout, as HF).
    The sin table carries the rotation's sign: [-sin, sin], so apply_rope needs no negation."""
    pos = torch.arange(max_len, dtype=torch.float32)
    freqs = torch.outer(pos, rope_inv_freq(cfg))
    emb = torch.cat((freqs, freqs), dim=-1)
    half = emb.shape[-1] // 2
    signed_sin = emb.sin()
    signed_sin[:, :half].neg_()
    return emb.cos(), signed_sin


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """Rotate x in place. x: [T, H, D] (may be a strided view); cos, signed_sin: [T, 1, D].
    rotate_half(x) * sin == roll(x, D/2) * [-sin, sin]."""
    if torch.compiler.is_compiling():  # NOTE: Dynamo refuses a strided out=; Inductor fuses this copy away
        x.copy_(torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin))
        return
    torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin, out=x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # q, k and v projections fused into one matmul; the loader concatenates the HF weights.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.cpu_kernels = False  # set by use_cpu_kernels

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, cache: KVCache
    ) -> torch.Tensor:
        t = x.shape[0]
        hq, hkv = self.num_heads, self.num_kv_heads
        heads = self.qkv_proj.forward(x).view(t, hq + 2 * hkv, self.head_dim)  # [T, Hq + 2 Hkv, D]: q, k, v heads
        # NOTE: q and k heads are adjacent, so they rotate together, in place; k and v then sit
        # side by side in the same buffer and the KV write is one copy.
        if self.cpu_kernels and not torch.compiler.is_compiling():
            torch.ops.pdfleet.rope_(heads, hq + hkv, cos.squeeze(1), sin.squeeze(1))
        else:
            apply_rope_(heads[:, : hq + hkv], cos, sin)
        q = heads[:, :hq]  # [T, Hq, D]
        kv = heads[:, hq:].unflatten(1, (2, hkv))  # [T, 2, Hkv, D]
        out = attention.forward(q, kv, meta, cache)  # [T, Hq * D]
        return self.o_proj.forward(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.cpu_kernels = False  # set by use_cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels and not torch.compiler.is_compiling():
            return self.down_proj.forward(torch.ops.pdfleet.silu_and_mul(self.gate_up_proj.forward(x)))
        gate, up = self.gate_up_proj.forward(x).split(self.intermediate_size, dim=-1)
        return self.down_proj.forward(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        h: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the residual stream [T, hidden], still owed delta (the last layer's MLP output, or
        None) -> (h, this layer's MLP output). Each residual add happens inside the next norm."""
        x = self.input_layernorm.forward(h, delta)  # h += delta
        a = self.self_attn.forward(x, cos, sin, meta, cache)
        x = self.post_attention_layernorm.forward(h, a)  # h += a
        return h, self.mlp.forward(x)


class LlamaForCausalLM(nn.Module):
    """One network for Llama, Qwen2 (qkv bias) and Mistral; parameter names follow HF after fusion.

    NOTE: submodules are run with `.forward(...)`, not `(...)`: nn.Module.__call__'s hook checks
    cost ~1 us each, and a batch-1 decode step makes ~150 such calls (1-2% of the step, measured);
    module hooks therefore do not fire inside the network.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        # NOTE: the loader builds the model on the meta device and then fills every weight; nn.Embedding's
        # own init (normal_) on meta runs a Python decomposition that imports torch._dynamo, 1.5-9 s of a
        # worker's start-up on 2 cores (measured), so the table is initialised only off meta.
        table = torch.empty(cfg.vocab_size, cfg.hidden_size)
        if table.device.type != "meta":
            nn.init.normal_(table)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        caches: list[KVCache],
    ) -> torch.Tensor:
        # input_ids, positions: [T] (all scheduled tokens of all sequences, flattened) -> hidden [T, hidden]
        cos = rope[0][positions].unsqueeze(1)  # [T, 1, D]
        sin = rope[1][positions].unsqueeze(1)
        h, delta = self.embed_tokens(input_ids), None  # h: a fresh tensor, updated in place from here on
        for layer, cache in zip(self.layers, caches):
            h, delta = layer.forward(h, delta, cos, sin, meta, cache)
        return self.norm.forward(h, delta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] (one row per sequence that samples) -> logits [S, vocab] in fp32
        return self.lm_head(hidden).float()


def use_cpu_kernels(model: LlamaForCausalLM) -> None:
    """Route RMSNorm (with its residual add), RoPE and the MLP's SiLU-and-multiply to layers/cpu_kernels.cpp;
    ModelRunner calls this after loading, once the kernels have built."""
    for m in model.modules():
        if hasattr(m, "cpu_kernels"):
            m.cpu_kernels = True
