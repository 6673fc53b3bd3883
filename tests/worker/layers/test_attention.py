"""Attention and KV-cache kernels in isolation: int8 per-block scales, and paths that must agree."""

from __future__ import annotations

import torch

from pdfleet_worker.engine.scheduler import ScheduledChunk
from pdfleet_worker.layers import attention
from pdfleet_worker.layers.attention import AttentionMetadata, KVCache, gather_kv, write_kv
from pdfleet_worker.sampling_params import SamplingParams


def test_int8_cache_grows_block_scales_and_requantizes():
    h, nb, bs, d = 2, 3, 4, 8
    cache = KVCache(torch.zeros(2, h, nb, bs, d, dtype=torch.int8), torch.zeros(2, h, nb))
    ref = torch.zeros(h, nb * bs, d)
    g = torch.Generator().manual_seed(0)
    # One token at a time into block 1, each larger than the last: the block scale must grow and
    # earlier entries be requantized, never clipped.
    for i in range(bs):
        k = torch.randn(1, h, d, generator=g) * (1 + 3 * i)
        write_kv(cache, torch.stack((k, k), 1), torch.tensor([1 * bs + i]))
        ref[:, bs + i] = k[0]
    k, _ = gather_kv(cache, torch.tensor([1]), torch.float32)  # [Hkv, bs, D]
    scale = cache.k_scale[:, 1]
    assert torch.allclose(scale, ref[:, bs : 2 * bs].abs().amax((-1, -2)) / 127)
    err = (k - ref[:, bs : 2 * bs]).abs().amax((-1, -2))
    assert bool((err <= scale * 2.01).all()), (err, scale)  # <= 2 rounding steps after requantizing
    # Reusing a block (write at offset 0) starts its scale afresh.
    small = torch.full((1, h, d), 0.01)
    write_kv(cache, torch.stack((small, small), 1), torch.tensor([bs]))
    assert torch.allclose(cache.k_scale[:, 1], torch.full((h,), 0.01 / 127))


def test_float_cache_round_trips_exactly():
    h, nb, bs, d = 2, 4, 3, 4
    cache = KVCache(torch.zeros(2, h, nb, bs, d))
    k, v = torch.randn(5, h, d), torch.randn(5, h, d)
    slots = torch.tensor([9, 10, 11, 3, 4])  # block 3 then block 1
    write_kv(cache, torch.stack((k, v), 1), slots)
    gk, gv = gather_kv(cache, torch.tensor([[3, 1]]), torch.float32)  # [Hkv, 1, 6, D]
    assert torch.equal(gk[:, 0, :3], k[:3].transpose(0, 1)) and torch.equal(gv[:, 0, 3:5], v[3:].transpose(0, 1))


def _decode_meta(backend: str, table: list[int], ctx: int, bs: int, fast: bool) -> AttentionMetadata:
    """Metadata of one decode at position ctx - 1: with the lone-decode shortcuts or the general form."""
    block, offset = table[(ctx - 1) // bs], (ctx - 1) % bs
    mask = None if fast else (torch.arange(len(table) * bs) < ctx)[None, None, None, :]
    return AttentionMetadata(
        backend=backend,
        slot_mapping=torch.tensor([block * bs + offset]),
        num_decodes=1,
        decode_block_tables=torch.tensor([table]),
        decode_context_lens=torch.tensor([ctx]),
        decode_mask=mask,
        prefills=[],
        lone_decode_len=ctx if fast else 0,
        one_slot=(block, offset) if fast else None,
    )


def test_lone_decode_shortcuts_match_the_general_path():
    """A lone decode writes its token by (block, offset) and attends to exactly its context with no
    mask; it must store and compute what the batched, masked path and the reference path do."""
    hq, h, nb, bs, d, ctx = 4, 2, 8, 4, 8, 10
    table = [6, 1, 5]  # scattered blocks; the last one holds 2 of its 4 slots
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(2, h, nb, bs, d, generator=g)  # garbage around the context
    past = torch.randn(ctx - 1, 2, h, d, generator=g)
    new = torch.randn(1, 2, h, d, generator=g)
    q = torch.randn(1, hq, d, generator=g)
    outs, pools = {}, {}
    for name, backend, fast in [("fast", "cpu", True), ("general", "cpu", False), ("reference", "reference", False)]:
        cache = KVCache(pool.clone())
        write_kv(cache, past, torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx - 1)]))
        outs[name] = attention.forward(q, new, _decode_meta(backend, table, ctx, bs, fast), cache)
        pools[name] = cache.kv
    assert torch.equal(pools["fast"], pools["general"])
    assert torch.allclose(outs["fast"], outs["general"], atol=1e-6)
    assert torch.allclose(outs["fast"], outs["reference"], atol=1e-6)


def test_runner_takes_lone_decode_shortcuts_only_for_one_sequence(llama, make_engine):
    runner = make_engine(llama.path, block_size=4).model_runner

    def meta_for(*tables):
        chunks = [
            ScheduledChunk(f"r{i}", [1], 9, t, True, SamplingParams(max_tokens=1), 0) for i, t in enumerate(tables)
        ]
        return runner._prepare(chunks)[2]

    one = meta_for([5, 7, 6])
    assert (one.lone_decode_len, one.one_slot, one.decode_mask) == (10, (6, 1), None)
    two = meta_for([5, 7, 6], [8, 9, 10])
    assert (two.lone_decode_len, two.one_slot) == (0, None)
    assert (two.decode_mask is None) == runner.decode_kernel  # the mask is built only for the SDPA fallback
