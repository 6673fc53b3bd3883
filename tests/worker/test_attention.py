"""Attention and KV-cache kernels in isolation: int8 per-block scales, and paths that must agree."""
from __future__ import annotations

import torch

from pdfleet_worker.engine.attention import KVCache, gather_kv, write_kv


def test_int8_cache_grows_block_scales_and_requantizes():
    h, nb, bs, d = 2, 3, 4, 8
    cache = KVCache(torch.zeros(2, h, nb, bs, d, dtype=torch.int8), torch.zeros(2, h, nb))
    ref = torch.zeros(h, nb * bs, d)
    g = torch.Generator().manual_seed(0)
    # One token at a time into block 1, each larger than the last: the block scale must grow and
    # earlier entries be requantized, never clipped.
    for i in range(bs):
        k = torch.randn(1, h, d, generator=g) * (1 + 3 * i)
        write_kv(cache, k, k, torch.tensor([1 * bs + i]))
        ref[:, bs + i] = k[0]
    k, _ = gather_kv(cache, torch.tensor([1]), torch.float32)  # [Hkv, bs, D]
    scale = cache.k_scale[:, 1]
    assert torch.allclose(scale, ref[:, bs:2 * bs].abs().amax((-1, -2)) / 127)
    err = (k - ref[:, bs:2 * bs]).abs().amax((-1, -2))
    assert bool((err <= scale * 2.01).all()), (err, scale)  # <= 2 rounding steps after requantizing
    # Reusing a block (write at offset 0) starts its scale afresh.
    small = torch.full((1, h, d), 0.01)
    write_kv(cache, small, small, torch.tensor([bs]))
    assert torch.allclose(cache.k_scale[:, 1], torch.full((h,), 0.01 / 127))


def test_float_cache_round_trips_exactly():
    h, nb, bs, d = 2, 4, 3, 4
    cache = KVCache(torch.zeros(2, h, nb, bs, d))
    k, v = torch.randn(5, h, d), torch.randn(5, h, d)
    slots = torch.tensor([9, 10, 11, 3, 4])  # block 3 then block 1
    write_kv(cache, k, v, slots)
    gk, gv = gather_kv(cache, torch.tensor([[3, 1]]), torch.float32)  # [Hkv, 1, 6, D]
    assert torch.equal(gk[:, 0, :3], k[:3].transpose(0, 1)) and torch.equal(gv[:, 0, 3:5], v[3:].transpose(0, 1))
