"""The C++ CPU kernels (engine/cpu_kernels.cpp): paged decode attention against gather + SDPA, thread binding, and the engine with and without them."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from pdfleet_worker.engine import cpu_kernels
from pdfleet_worker.engine.attention import KVCache, gather_kv, write_kv
from tests.worker.conftest import MAX_NEW, compare, random_prompts, run_and_capture

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="no C++ compiler: the engine runs without the kernels")


def _reference(q: torch.Tensor, cache: KVCache, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Gather every context (padded), mask past each length, SDPA in fp32. q: [B, Hq, D] -> [B, Hq, D]."""
    b, hq, d = q.shape
    hkv = cache.kv.shape[1]
    k, v = gather_kv(cache, tables, torch.float32)  # [Hkv, B, W * bs, D]
    mask = (torch.arange(k.shape[2])[None, :] < lens[:, None])[None, :, None, :]
    qd = q.float().view(b, hkv, hq // hkv, d).transpose(0, 1)
    return F.scaled_dot_product_attention(qd, k.float(), v.float(), attn_mask=mask).transpose(0, 1).reshape(b, hq, d)


def _pool(hkv: int, nb: int, bs: int, d: int, dtype: torch.dtype, seed: int) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        cache = KVCache(torch.zeros(2, hkv, nb, bs, d, dtype=torch.int8), torch.zeros(2, hkv, nb))
        x = torch.randn(nb * bs, 2, hkv, d, generator=g) * torch.rand(nb * bs, 1, hkv, 1, generator=g) * 3
        write_kv(cache, x, torch.arange(nb * bs))
        return cache
    return KVCache(torch.randn(2, hkv, nb, bs, d, generator=g).to(dtype))


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2), (torch.int8, 2e-5)])
@pytest.mark.parametrize("hq,hkv,d,bs", [(12, 4, 64, 16), (4, 1, 32, 4), (8, 8, 128, 7), (6, 2, 48, 1), (2, 1, 288, 3)])
def test_paged_decode_matches_gather_and_sdpa(dtype, atol, hq, hkv, d, bs):
    """Scattered block tables, lengths at and around block edges (1, bs, bs + 1, a full table),
    GQA, MQA and MHA, head dims from 32 to 288; the query is a strided view as in the model."""
    nb, width = 40, 9
    cache = _pool(hkv, nb, bs, d, dtype, seed=hq * d + bs)
    g = torch.Generator().manual_seed(1)
    lens = torch.tensor([1, bs, bs + 1, width * bs, 3 * bs - 1, 5])
    tables = torch.stack([torch.randperm(nb, generator=g)[:width] for _ in lens])
    qdtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    heads = torch.randn(len(lens), hq + 2 * hkv, d, generator=g).to(qdtype)
    q = heads[:, :hq]  # [B, Hq, D], rows hq + 2 hkv heads apart
    out = torch.full_like(q, float("nan"))
    torch.ops.pdfleet.paged_decode_attention(out, q, cache.kv, cache.scale, tables, lens, d ** -0.5)
    want = _reference(q, cache, tables, lens)
    assert out.dtype == qdtype and not out.isnan().any()
    assert torch.allclose(out.float(), want, atol=atol, rtol=0), float((out.float() - want).abs().max())


def test_paged_decode_ignores_what_lies_past_each_context():
    """Blocks past a context and slots past its length hold garbage (here inf): never read."""
    cache = _pool(2, 8, 4, 32, torch.float32, seed=3)
    tables, lens = torch.tensor([[5, 2, 7]]), torch.tensor([6])
    want = _reference(torch.ones(1, 4, 32), cache, tables, lens)
    cache.kv[:, :, 2, 2:] = float("inf")  # the second block's unused half
    cache.kv[:, :, 7] = float("inf")      # the block past the context
    out = torch.empty(1, 4, 32)
    torch.ops.pdfleet.paged_decode_attention(out, torch.ones(1, 4, 32), cache.kv, None, tables, lens, 32 ** -0.5)
    assert torch.allclose(out, want, atol=2e-6)


@pytest.mark.parametrize("lens,error", [([0], "context length 0"), ([13], "context length 13")])
def test_paged_decode_refuses_lengths_its_table_cannot_hold(lens, error):
    cache = _pool(1, 4, 4, 16, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match=error):
        torch.ops.pdfleet.paged_decode_attention(torch.empty(1, 1, 16), torch.ones(1, 1, 16), cache.kv, None,
                                                 torch.tensor([[0, 1, 2]]), torch.tensor(lens), 0.25)


def test_pin_threads_binds_each_compute_thread_and_unbinds():
    allowed = sorted(os.sched_getaffinity(0))
    try:
        assert cpu_kernels.pin_threads(allowed) == torch.get_num_threads()
        assert os.sched_getaffinity(0) == {allowed[0]}  # this thread is compute thread 0
    finally:
        assert cpu_kernels.pin_threads(allowed, exclusive=False) == torch.get_num_threads()
    assert os.sched_getaffinity(0) == set(allowed)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_engine_decodes_the_same_with_and_without_the_kernel(tiny, make_engine, kv_cache_dtype):
    """Many sequences decoding together (scattered blocks, block size 4): through the kernel the
    engine still matches transformers (fp32), and int8 KV gives what the gather path gives."""
    prompts = random_prompts(8, 1, 30, seed=31)
    got = {}
    for kernel in (True, False):
        eng = make_engine(tiny.path, block_size=4, max_num_batched_tokens=24, kv_cache_dtype=kv_cache_dtype)
        assert eng.model_runner.decode_kernel
        eng.model_runner.decode_kernel = kernel
        got[kernel] = run_and_capture(eng, prompts)
    if kv_cache_dtype == "auto":
        for kernel in (True, False):
            tokens, logits, _ = got[kernel]
            assert compare(tiny, prompts, tokens, logits, MAX_NEW).near_ties <= 1
    else:
        worst = max(float((a - b).abs().max()) for ra, rb in zip(got[True][1], got[False][1]) for a, b in zip(ra, rb))
        assert worst < 1e-3 * max(1.0, max(float(r.abs().max()) for rows in got[False][1] for r in rows)), worst


def test_kernel_library_is_cached_by_key(tmp_path, monkeypatch):
    built = cpu_kernels.build()  # loaded already: returns the cached file, compiles nothing
    assert built == cpu_kernels.library_path() and built.exists()
    monkeypatch.setenv("PDFLEET_KERNEL_CACHE", str(tmp_path))
    assert cpu_kernels.library_path() == tmp_path / built.name  # the key does not depend on the folder
