"""Paged decode attention as a Triton kernel (the CUDA path): each program reads one sequence's KV through its block
table on the device; attention.py calls it.

Runs on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1), which is how it is tested
without a GPU. Without triton installed, `available()` is False and the CUDA path keeps gathering.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # NOTE: optional; the CPU image has no triton and needs none
    triton = None


@functools.lru_cache(maxsize=None)
def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        out_ptr,
        q_ptr,
        kv_ptr,
        tables_ptr,
        lens_ptr,
        softmax_scale,
        stride_qb,
        stride_qh,
        stride_ob,
        stride_oh,
        stride_tb,
        stride_kv,
        stride_kh,
        stride_kb,
        G: tl.constexpr,
        G_PAD: tl.constexpr,
        D: tl.constexpr,
        BS: tl.constexpr,
    ):
        """One (sequence, KV head): its G query heads against its context, block by block, with an
        online softmax. kv: [2, Hkv, NB, BS, D] (stride_kv between K and V)."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        ctx = tl.load(lens_ptr + b)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        t = tl.arange(0, BS)
        gmask = g < G
        q = (
            tl.load(
                q_ptr + b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0
            ).to(tl.float32)
            * softmax_scale
        )  # [G_PAD, D]
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        l = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        k_head = kv_ptr + h * stride_kh
        v_head = kv_ptr + stride_kv + h * stride_kh
        for j in range(0, tl.cdiv(ctx, BS)):
            blk = tl.load(tables_ptr + b * stride_tb + j).to(tl.int64)
            tmask = j * BS + t < ctx
            offs = blk * stride_kb + t[:, None] * D + d[None, :]  # [BS, D]
            k = tl.load(k_head + offs, mask=tmask[:, None], other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G_PAD, BS]
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(v_head + offs, mask=tmask[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # [G_PAD, D]
            l = l * alpha + tl.sum(p, axis=1)
            m = m_new
        o = acc / l[:, None]
        tl.store(
            out_ptr + b * stride_ob + (h * G + g)[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=gmask[:, None],
        )


def paged_decode(
    out: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, softmax_scale: float
) -> None:
    """out[b] = attention of q[b] over the first lens[b] tokens of its blocks. q, out: [B, Hq, D]
    (last dim contiguous); kv: contiguous [2, Hkv, NB, BS, D] float pool; tables: [B, W]; lens: [B]."""
    assert available(), "triton is not installed"
    b, hq, d = q.shape
    _, hkv, _, bs, dk = kv.shape
    assert dk == d and hq % hkv == 0 and kv.is_contiguous(), (tuple(q.shape), tuple(kv.shape))
    assert d & (d - 1) == 0 and bs & (bs - 1) == 0, f"head_dim {d} and block_size {bs} must be powers of two"
    assert q.stride(2) == 1 and out.stride(2) == 1 and tables.stride(1) == 1
    g = hq // hkv
    _paged_decode_kernel[(b, hkv)](
        out,
        q,
        kv,
        tables,
        lens,
        softmax_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        tables.stride(0),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        G=g,
        G_PAD=triton.next_power_of_2(g),
        D=d,
        BS=bs,
    )
