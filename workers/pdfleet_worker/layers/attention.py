"""Paged attention over the KV block pool (reference, CPU, Triton and FlexAttention paths) and KV writes; the model's
attention layers call it."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import warnings

import torch
import torch.nn.functional as F

from pdfleet_worker.layers import triton_attention

log = logging.getLogger("pdfleet.engine")
INT8_MAX = 127.0
# Prefill chunks with a past up to this many tokens attend through the decode kernel (each row
# re-reads the context, which stays in cache; beyond this SDPA's matrix products win).
SHORT_CHUNK = 32
PREFILL_ENV = "PDFLEET_PREFILL_ATTENTION"  # auto (measure), sdpa or kernel
PREFILL_KERNELS = ("sdpa", "kernel")
PREFILL_PROBE_TOKENS = 256  # a typical prompt chunk; both kernels' time grows alike with it
PREFILL_PROBE_REPS = 5  # timed passes per kernel, alternating; the fastest counts


@dataclasses.dataclass
class KVCache:
    """One layer's slice of the pool. kv: [2, Hkv, num_blocks, block_size, D] (keys, then values,
    so one gather fetches both); with an int8 cache, scale: [2, Hkv, num_blocks] (one scale per
    block and KV head)."""

    kv: torch.Tensor
    scale: torch.Tensor | None = None

    @property
    def k(self) -> torch.Tensor:
        return self.kv[0]

    @property
    def v(self) -> torch.Tensor:
        return self.kv[1]

    @property
    def k_scale(self) -> torch.Tensor | None:
        return None if self.scale is None else self.scale[0]

    @property
    def v_scale(self) -> torch.Tensor | None:
        return None if self.scale is None else self.scale[1]

    @property
    def block_size(self) -> int:
        return self.kv.shape[3]

    @property
    def quantized(self) -> bool:
        return self.scale is not None


@dataclasses.dataclass
class PrefillMeta:
    """One multi-token chunk: query rows start..start+num_tokens of the flattened batch."""

    start: int
    num_tokens: int
    context_len: int  # tokens visible to the last query (past + this chunk)
    block_table: torch.Tensor  # [num_blocks_used] int64
    mask: torch.Tensor | None  # [num_tokens, context_len] bool; None when there is no past


@dataclasses.dataclass
class AttentionMetadata:
    """Built once per step by ModelRunner, shared by every layer.

    Rows 0..num_decodes-1 of the flattened batch are one-token chunks (decodes), the rest are
    multi-token prefill chunks, in that order.
    """

    backend: str  # reference | cpu | paged (CUDA, Triton) | flex
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    num_decodes: int
    decode_block_tables: torch.Tensor  # [Bd, max_blocks] int64 (padded with block 0)
    decode_context_lens: torch.Tensor  # [Bd] int64
    decode_mask: torch.Tensor | None  # [1, Bd, 1, max_blocks * block_size] bool; None when Bd <= 1 or decode_kernel
    prefills: list[PrefillMeta]
    lone_decode_len: int = 0  # context length when the step's only decode is one sequence
    decode_kernel: bool = False  # decodes read the pool through their block tables (cpu_kernels)
    fused_decode: bool = False  # a decode-only step for the compiled model: one opaque op per layer
    prefill_kernel: bool = False  # prefill chunks attend through cpu_kernels' prefill_attention, not SDPA
    one_slot: tuple[int, int] | None = None  # (block, offset) when the step writes one token
    flex: object | None = None  # FlexMetadata on the flex backend


def write_kv(cache: KVCache, kv: torch.Tensor, slots: torch.Tensor) -> None:
    """Store new keys and values. kv: [T, 2, Hkv, D] (keys, then values; may be a strided view); slots: [T]."""
    if cache.quantized:
        _write_quantized(cache.k, cache.k_scale, kv[:, 0], slots)
        _write_quantized(cache.v, cache.v_scale, kv[:, 1], slots)
        return
    _, h, _, _, d = cache.kv.shape
    cache.kv.view(2, h, -1, d).index_copy_(2, slots, kv.permute(1, 2, 0, 3).to(cache.kv.dtype))


def _write_quantized(data: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
    """int8 with one scale per (KV head, block). A block's scale only grows: when new tokens exceed
    it, the block's earlier entries are requantized to the new scale. A write at offset 0 starts a
    block afresh (blocks fill from the front, so that block's old contents are stale)."""
    h, _, bs, d = data.shape
    x = x.float().transpose(0, 1)  # [Hkv, T, D]
    blocks, offsets = slots // bs, slots % bs
    uniq, inv = torch.unique(blocks, return_inverse=True)  # [U], [T]
    u = uniq.numel()
    amax = torch.zeros(h, u, device=x.device).scatter_reduce_(1, inv.expand(h, -1), x.abs().amax(-1), "amax")
    first = torch.full((u,), bs, dtype=offsets.dtype, device=x.device).scatter_reduce_(0, inv, offsets, "amin")
    old = torch.where(first == 0, 0.0, scale[:, uniq].float())  # [Hkv, U]
    new = torch.maximum(old, amax / INT8_MAX).clamp_min(1e-8)
    grow = (old > 0) & (new > old)
    if bool(grow.any()):
        ratio = torch.where(grow, old / new, 1.0)[..., None, None]
        data[:, uniq] = torch.round(data[:, uniq].float() * ratio).to(torch.int8)
    scale[:, uniq] = new.to(scale.dtype)
    q = torch.round(x / new[:, inv].unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    data.view(h, -1, d).index_copy_(1, slots, q)


def gather_kv(cache: KVCache, block_table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the given blocks. block_table: [..., nb] -> k, v: [Hkv, ..., nb * bs, D]."""
    _, h, _, bs, d = cache.kv.shape
    flat = block_table.reshape(-1)
    kv = cache.kv.index_select(2, flat)  # [2, Hkv, n, bs, D]
    if cache.quantized:
        kv = kv.to(dtype) * cache.scale.index_select(2, flat)[..., None, None].to(dtype)
    kv = kv.view(2, h, *block_table.shape[:-1], block_table.shape[-1] * bs, d)
    return kv[0], kv[1]


def forward(q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
    """q: [T, Hq, D]; kv: [T, 2, Hkv, D] for the new tokens -> out [T, Hq * D]."""
    if meta.fused_decode:
        return decode_step(
            q, kv, cache.kv, cache.scale, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens
        )
    if meta.one_slot is not None and not cache.quantized:
        block, offset = meta.one_slot
        cache.kv.select(3, offset).select(2, block).copy_(kv[0])  # [2, Hkv, D]
    else:
        write_kv(cache, kv, meta.slot_mapping)
    if meta.backend == "reference":
        return _reference(q, meta, cache)
    if meta.backend == "flex":
        return _flex(q, meta, cache)
    return _batched(q, kv, meta, cache)


def _reference(q: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
    """Device-agnostic and plain: for every sequence gather its context by block table, then SDPA."""
    t, hq, d = q.shape
    hkv = cache.k.shape[0]
    out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    rows = [(i, 1, int(meta.decode_context_lens[i]), meta.decode_block_tables[i]) for i in range(meta.num_decodes)]
    rows += [(p.start, p.num_tokens, p.context_len, p.block_table) for p in meta.prefills]
    for start, n, ctx, table in rows:
        k, v = gather_kv(cache, table, q.dtype)  # [Hkv, nb * bs, D]
        k, v = k[:, :ctx].repeat_interleave(hq // hkv, 0), v[:, :ctx].repeat_interleave(hq // hkv, 0)
        pos = torch.arange(ctx - n, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None]  # [n, ctx]
        o = F.scaled_dot_product_attention(q[start : start + n].transpose(0, 1), k, v, attn_mask=mask)
        out[start : start + n] = o.transpose(0, 1)  # [n, Hq, D]
    return out.view(t, hq * d)


def _decode_context(cache: KVCache, meta: AttentionMetadata, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values the decodes attend to: k, v: [Hkv, Bd, L, D]. A lone decode gets exactly its
    context (L = its length), so it needs no mask."""
    k, v = gather_kv(cache, meta.decode_block_tables, dtype)
    if meta.lone_decode_len:
        return k[:, :, : meta.lone_decode_len], v[:, :, : meta.lone_decode_len]
    return k, v


def _batched(q: torch.Tensor, kv_new: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
    """The cpu and paged backends. All decodes at once: through the block tables (each sequence's
    context read once, no copy, no padding) with the C++ kernel on CPU or the Triton kernel on CUDA,
    else gathered into one padded batch for SDPA (query heads of a KV group ride along the
    query-length axis, so GQA needs no copies). Prefill chunks without a past attend to their own
    fresh k, v; with one, to their gathered context."""
    t, hq, d = q.shape
    hkv = cache.k.shape[0]
    g = hq // hkv
    out = q.new_empty(t, hq, d)  # every row written below in place (a torch.cat of parts: ~1.5% of a mixed step)
    bd = meta.num_decodes
    if bd and meta.decode_kernel:
        torch.ops.pdfleet.paged_decode_attention(
            out[:bd], q[:bd], cache.kv, cache.scale, meta.decode_block_tables, meta.decode_context_lens, d**-0.5
        )
    elif bd and meta.backend == "paged" and not cache.quantized:
        triton_attention.paged_decode(
            out[:bd], q[:bd], cache.kv, meta.decode_block_tables, meta.decode_context_lens, d**-0.5
        )
    elif bd:
        qd = q[:bd].view(bd, hkv, g, d).transpose(0, 1)  # [Hkv, Bd, G, D]
        k, v = _decode_context(cache, meta, q.dtype)  # [Hkv, Bd, L, D]
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask)  # [Hkv, Bd, G, D]
        out[:bd].view(bd, hkv, g, d).copy_(o.transpose(0, 1))
    for p in meta.prefills:
        if p.mask is not None and meta.decode_kernel and p.num_tokens <= SHORT_CHUNK:
            # A short chunk with a past (a prefix-cache hit's own tokens, a chunked prompt's tail):
            # each query row is a decode of its own length, read through the same block table.
            n = p.num_tokens
            lens = torch.arange(p.context_len - n + 1, p.context_len + 1, device=q.device)
            tables = p.block_table.expand(n, -1).contiguous()
            torch.ops.pdfleet.paged_decode_attention(
                out[p.start : p.start + n], q[p.start : p.start + n], cache.kv, cache.scale, tables, lens, d**-0.5
            )
            continue
        if meta.prefill_kernel:
            n, o = p.num_tokens, out[p.start : p.start + p.num_tokens]
            if p.mask is None:
                k, v = kv_new[p.start : p.start + n, 0], kv_new[p.start : p.start + n, 1]  # [n, Hkv, D]
            else:
                k, v = gather_kv(cache, p.block_table, q.dtype)  # [Hkv, nb * bs, D]
                k, v = k[:, : p.context_len].transpose(0, 1), v[:, : p.context_len].transpose(0, 1)
            torch.ops.pdfleet.prefill_attention(o, q[p.start : p.start + n], k.to(q.dtype), v.to(q.dtype), d**-0.5)
            continue
        qp = q[p.start : p.start + p.num_tokens].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if p.mask is None:
            k = kv_new[p.start : p.start + p.num_tokens, 0].transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
            v = kv_new[p.start : p.start + p.num_tokens, 1].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, k.to(q.dtype), v.to(q.dtype), is_causal=True, enable_gqa=True)
        else:
            k, v = gather_kv(cache, p.block_table, q.dtype)
            k, v = k[:, : p.context_len].unsqueeze(0), v[:, : p.context_len].unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, k, v, attn_mask=p.mask, enable_gqa=True)
        out[p.start : p.start + p.num_tokens].copy_(o[0].transpose(0, 1))
    return out.view(t, hq * d)


@dataclasses.dataclass(frozen=True)
class PrefillChoice:
    """Which kernel prefill chunks attend with on CPU, and why (`source`: the probe or the environment);
    the probe's times (ms per layer call at PREFILL_PROBE_TOKENS tokens) when it ran."""

    kernel: str  # sdpa | kernel
    source: str
    sdpa_ms: float | None = None
    kernel_ms: float | None = None

    def describe(self) -> str:
        timed = f": sdpa {self.sdpa_ms:.3f} ms, kernel {self.kernel_ms:.3f} ms" if self.sdpa_ms is not None else ""
        return f"prefill attention: {self.kernel} ({self.source}{timed})"


_PREFILL_PROBED: dict[tuple, PrefillChoice] = {}


def choose_prefill(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, *, setting: str | None = None
) -> PrefillChoice:
    """SDPA or cpu_kernels' prefill_attention for prefill chunks, by $PDFLEET_PREFILL_ATTENTION: `auto` checks the
    kernel against SDPA and times both on this machine with the model's heads (tens of ms at start-up); `sdpa` or
    `kernel` fixes it. The caller has loaded the kernels. Which one wins depends on the CPU's BLAS paths
    (docs/engine.md), so it is measured; a kernel that fails or disagrees here is not used."""
    setting = (os.environ.get(PREFILL_ENV, "auto") if setting is None else setting).strip().lower()
    if setting not in ("auto", *PREFILL_KERNELS):
        raise ValueError(f"{PREFILL_ENV}={setting!r}: expected auto, sdpa or kernel")
    if setting != "auto":
        return PrefillChoice(setting, f"{PREFILL_ENV}={setting}")
    # NOTE: one probe per process for the same heads (as packed_linear.choose): where the two run close, engines
    # of one process that timed them apart could take different paths and give different logits
    key = (num_heads, num_kv_heads, head_dim, dtype, torch.get_num_threads())
    if key in _PREFILL_PROBED:
        return _PREFILL_PROBED[key]
    g = torch.Generator().manual_seed(0)
    n = PREFILL_PROBE_TOKENS
    heads = torch.randn(n, num_heads + 2 * num_kv_heads, head_dim, generator=g).to(dtype)
    q, kv = heads[:, :num_heads], heads[:, num_heads:].unflatten(1, (2, num_kv_heads))
    out = torch.empty_like(q)
    qp, kp, vp = (x.transpose(0, 1).unsqueeze(0) for x in (q, kv[:, 0], kv[:, 1]))

    def sdpa() -> None:
        F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)

    def kernel() -> None:
        torch.ops.pdfleet.prefill_attention(out, q, kv[:, 0], kv[:, 1], head_dim**-0.5)

    try:
        kernel()
        want = F.scaled_dot_product_attention(qp.float(), kp.float(), vp.float(), is_causal=True, enable_gqa=True)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        if not torch.allclose(out.float(), want[0].transpose(0, 1), atol=tol, rtol=tol):
            raise RuntimeError("its result differs from SDPA's")
    except RuntimeError as e:  # a torch build whose brgemm cannot run here: SDPA, said once
        choice = PrefillChoice("sdpa", f"the kernel is unusable here: {e}")
        log.warning("%s", choice.describe())
        return choice
    best = {"sdpa": float("inf"), "kernel": float("inf")}
    for rep in range(PREFILL_PROBE_REPS + 1):
        for name, fn in (("sdpa", sdpa), ("kernel", kernel)):
            t = time.perf_counter()
            fn()
            if rep:  # the first pass warms caches (and JIT-compiles the kernel's products)
                best[name] = min(best[name], time.perf_counter() - t)
    choice = _PREFILL_PROBED[key] = PrefillChoice(
        "kernel" if best["kernel"] < best["sdpa"] else "sdpa",
        "probe",
        round(best["sdpa"] * 1e3, 3),
        round(best["kernel"] * 1e3, 3),
    )
    log.info("%s", choice.describe())
    return choice


# -- the compiled model's attention --------------------------------------------------------------
# NOTE: one custom op per layer (KV write, then paged decode attention) keeps the KV pool out of
# the compiled graph: torch.compile sees an opaque call that mutates the pool in place, as vLLM's
# attention ops are, and fuses everything around it. Traced as-is, the in-place write into a
# graph input would be functionalized, which risks copying the whole pool.
@torch.library.custom_op("pdfleet::decode_step", mutates_args=("pool", "scale"))
def decode_step(
    q: torch.Tensor,
    kv: torch.Tensor,
    pool: torch.Tensor,
    scale: torch.Tensor | None,
    slots: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
) -> torch.Tensor:
    """Decodes only: q [B, Hq, D], kv [B, 2, Hkv, D] -> out [B, Hq * D]; pool and scale as in KVCache."""
    cache = KVCache(pool, scale)
    write_kv(cache, kv, slots)
    b, hq, d = q.shape
    out = q.new_empty(b, hq, d)
    torch.ops.pdfleet.paged_decode_attention(out, q, pool, scale, tables, lens, d**-0.5)
    return out.view(b, hq * d)


@decode_step.register_fake
def _(q, kv, pool, scale, slots, tables, lens):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


# -- FlexAttention (the CUDA path) -----------------------------------------------------------------
@dataclasses.dataclass
class FlexMetadata:
    """Every sequence's context gathered into one packed KV row; a document mask keeps sequences apart."""

    kv_index: torch.Tensor  # [N] slot ids of all context tokens, sequence after sequence
    block_mask: object  # torch.nn.attention.flex_attention.BlockMask over [T, N]


def build_flex_metadata(
    q_seq: torch.Tensor, q_pos: torch.Tensor, kv_seq: torch.Tensor, kv_pos: torch.Tensor, kv_index: torch.Tensor
) -> FlexMetadata:
    """q_seq, q_pos: [T] owner and position of each query; kv_seq, kv_pos, kv_index: [N]."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal_same_sequence(b, h, qi, ki):
        return (q_seq[qi] == kv_seq[ki]) & (kv_pos[ki] <= q_pos[qi])

    mask = create_block_mask(causal_same_sequence, None, None, q_seq.numel(), kv_seq.numel(), device=q_seq.device)
    return FlexMetadata(kv_index=kv_index, block_mask=mask)


_compiled_flex = None


def _flex_fn():
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        # Compiled on CUDA (fused kernel); eager elsewhere, where it runs an unfused reference.
        _compiled_flex = torch.compile(flex_attention, dynamic=True) if torch.cuda.is_available() else flex_attention
    return _compiled_flex


def _flex(q: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
    t, hq, d = q.shape
    hkv, nblocks, bs, _ = cache.k.shape
    fm: FlexMetadata = meta.flex
    if cache.quantized:
        blocks = fm.kv_index // bs
        k = cache.k.view(hkv, -1, d)[:, fm.kv_index].to(q.dtype) * cache.k_scale[:, blocks, None].to(q.dtype)
        v = cache.v.view(hkv, -1, d)[:, fm.kv_index].to(q.dtype) * cache.v_scale[:, blocks, None].to(q.dtype)
    else:
        k = cache.k.view(hkv, -1, d)[:, fm.kv_index]  # [Hkv, N, D]
        v = cache.v.view(hkv, -1, d)[:, fm.kv_index]
    with warnings.catch_warnings():
        # Off CUDA the unfused eager implementation is the point (it checks the CUDA path's math).
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        o = _flex_fn()(
            q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), block_mask=fm.block_mask, enable_gqa=True
        )  # [1, Hq, T, D]
    return o[0].transpose(0, 1).reshape(t, hq * d)
