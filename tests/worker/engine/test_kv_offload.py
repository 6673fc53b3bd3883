"""Tiered KV offload (host RAM, then an mmap'd disk file) and swap preemption: the bookkeeping on its own, then
the engine against the transformers oracle after blocks went to a tier (or swap space) and came back."""

from __future__ import annotations

import pytest

from pdfleet_worker.config import EngineConfig
from pdfleet_worker.engine.block_manager import BlockManager, hash_block
from pdfleet_worker.engine.kv_offload import DISK, HOST, CostModel, OffloadIndex
from pdfleet_worker.engine.model_runner import kv_bytes_per_block
from pdfleet_worker.engine.sequence import Sequence, SequenceStatus
from pdfleet_worker.sampling_params import SamplingParams
from tests.worker.oracle import GREEDY, compare, random_prompts, run_and_capture


def h(i: int) -> bytes:
    return hash_block(None, [i], "t")


# -- the index alone -----------------------------------------------------------------------------------


def test_tiers_are_lru_and_bounded():
    off = OffloadIndex(host_blocks=2, disk_blocks=2, block_bytes=100)
    for i in range(5):  # device blocks 10..14 evicted in order
        off.evicted(h(i), 10 + i)
    assert list(off.tiers[HOST].lru) == [h(3), h(4)]  # the two newest in RAM
    assert list(off.tiers[DISK].lru) == [h(1), h(2)]  # pushed down, oldest on disk dropped
    assert off.locate(h(0)) is None
    host, disk = off.tiers[HOST].stats, off.tiers[DISK].stats
    assert (host.stored, host.evictions, disk.stored, disk.evictions) == (5, 3, 3, 1)
    assert host.bytes_in == 500 and off.usage(HOST) == off.usage(DISK) == 1.0
    kinds = [(c.kind, c.tier) for c in off.take_copies()]
    # Every demotion of a host slot comes before the save that reuses it.
    assert kinds == [
        ("save", HOST),
        ("save", HOST),
        ("demote", DISK),
        ("save", HOST),
        ("demote", DISK),
        ("save", HOST),
        ("demote", DISK),
        ("save", HOST),
    ]
    assert off.take_copies() == []


def test_host_off_sends_evictions_to_disk_and_both_off_drops_them():
    off = OffloadIndex(host_blocks=0, disk_blocks=1, block_bytes=1)
    off.evicted(h(0), 3)
    assert off.locate(h(0)) == DISK and off.take_copies()[0].kind == "save"
    none = OffloadIndex(swap_blocks=4)
    none.evicted(h(0), 3)
    assert none.locate(h(0)) is None and not none.enabled


def test_cost_model_picks_recompute_when_loading_costs_more():
    cost = CostModel(host_bytes_per_s=1e9, disk_bytes_per_s=1e6, prefill_s_per_token=1e-4, measure=False)
    # 64 blocks of 16 tokens, 32 KiB each: host 2 ms + overhead vs 102 ms recompute; disk 2.1 s vs 102 ms.
    assert cost.should_load(HOST, 64 * 32768, 64 * 16)
    assert not cost.should_load(DISK, 64 * 32768, 64 * 16)
    cost.measure = True
    cost.observe_copy(DISK, 1 << 30, 0.5)  # measured: 2 GB/s moves the estimate up
    assert cost.disk_bytes_per_s > 1e6
    cost.observe_prefill(10, 1.0)  # too few tokens to say anything: ignored
    assert cost.prefill_s_per_token == 1e-4


# -- the block manager with tiers ----------------------------------------------------------------------


def seq(tokens, rid="s"):
    return Sequence(rid, list(tokens), SamplingParams())


def _computed(bm, s, n):
    assert bm.allocate(s, n)
    s.num_computed_tokens = n
    bm.cache_full_blocks(s)


def test_evicted_prefix_is_found_in_host_and_loaded_into_a_free_block():
    off = OffloadIndex(host_blocks=8, block_bytes=64, cost=CostModel(measure=False))
    bm = BlockManager(4, 2, offload=off)
    a = seq([1, 2, 3, 4, 5], "a")
    _computed(bm, a, 5)  # blocks 0,1 hashed, 2 partial
    bm.free(a)
    b = seq([9, 9, 9, 9, 9, 9, 9, 9], "b")
    _computed(bm, b, 8)  # takes every block: a's two hashed blocks go to host
    assert [c.kind for c in off.take_copies()] == ["save", "save"]
    bm.free(b)  # b's 4 hashed blocks stay cached on the device
    again = seq([1, 2, 3, 4, 5, 6], "again")
    hits = bm.find_cached_prefix(again, 5)
    assert hits == [a.block_hashes[0], a.block_hashes[1]]  # both in the host tier
    assert bm.allocate(again, 6, hits)
    copies = off.take_copies()
    loads = [c for c in copies if c.kind == "load"]
    assert [c.dst for c in loads] == again.block_ids[:2] and {c.tier for c in loads} == {HOST}
    # Each block found for a load (and the third, new one) evicted one of b's blocks into the host tier first.
    assert [c.kind for c in copies] == ["save", "load", "save", "load", "save"]
    assert bm.cached[a.block_hashes[0]] == again.block_ids[0] and off.locate(a.block_hashes[0]) is None
    assert off.tiers[HOST].stats.hits == 2 and len(off.tiers[HOST].free_slots) == 8 - len(off.tiers[HOST])
    bm.free(again)


def test_a_tier_not_worth_loading_is_recomputed_and_counted_at_admission():
    off = OffloadIndex(
        host_blocks=0,
        disk_blocks=8,
        block_bytes=1 << 20,
        cost=CostModel(disk_bytes_per_s=1e3, prefill_s_per_token=1e-6, measure=False),
    )
    bm = BlockManager(2, 2, offload=off)
    a = seq([1, 2, 3, 4, 5], "a")
    _computed(bm, a, 4)
    bm.free(a)
    _computed(bm, (b := seq([7, 7, 7, 7], "b")), 4)  # evicts a's blocks to disk
    bm.free(b)
    again = seq([1, 2, 3, 4, 5], "again")
    hits = bm.find_cached_prefix(again, 4)
    assert hits == [] and again.offload_skipped == {DISK: 2}
    assert off.tiers[DISK].stats.recomputed == 0  # not yet admitted
    assert bm.allocate(again, 4, hits)  # the pool's two blocks: the first chunk of the recompute
    assert off.tiers[DISK].stats.recomputed == 2 and off.tiers[DISK].stats.hits == 0
    bm.free(again)


# -- the engine against the oracle ---------------------------------------------------------------------


def _block_bytes(model_dir: str, block_size: int, kv_dtype: str = "auto") -> int:
    import torch

    from pdfleet_worker.config import ModelConfig

    return kv_bytes_per_block(ModelConfig.from_dir(model_dir), block_size, kv_dtype, torch.float32)


def _evict_all(eng, seed: int):
    """Requests of fresh tokens that take the whole pool, so every cached block is evicted."""
    fill = random_prompts(2, 30, 30, seed=seed)
    run_and_capture(eng, fill, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))


def _fixed_cost(eng, **kw):
    cost = eng.block_manager.offload.cost
    cost.measure = False
    for k, v in kw.items():
        setattr(cost, k, v)


@pytest.mark.parametrize("where", ["host", "disk", "host_then_disk"])
def test_prefix_reloaded_from_a_tier_matches_transformers(tiny, make_engine, tmp_path, where):
    bs = 4
    per = _block_bytes(tiny.path, bs)
    host, disk = {"host": (64, 0), "disk": (0, 64), "host_then_disk": (2, 64)}[where]
    eng = make_engine(
        tiny.path,
        block_size=bs,
        num_kv_blocks=16,
        max_num_batched_tokens=64,
        kv_offload_host_bytes=host * per,
        kv_offload_disk_bytes=disk * per,
        kv_offload_disk_dir=str(tmp_path),
    )
    _fixed_cost(eng, prefill_s_per_token=1.0)  # always load
    shared = random_prompts(1, 25, 25, seed=11)[0]  # 6 full blocks
    prompts = [shared + [1, 2, 3], shared + [7]]
    first, first_logits, _ = run_and_capture(eng, prompts[:1])
    _evict_all(eng, seed=12)
    hashes = eng.block_manager.block_hashes(Sequence("probe", prompts[1], GREEDY), 6)
    assert not any(x in eng.block_manager.cached for x in hashes), "the prefix is still on the device"
    assert all(eng.block_manager.offload.locate(x) for x in hashes)
    before = eng.stats()
    second, second_logits, _ = run_and_capture(eng, prompts[1:])
    s = eng.stats()
    hits = {t: s.kv_offload[t].hits - before.kv_offload[t].hits for t in ("host", "disk")}
    assert sum(hits.values()) == 6 and s.prefix_cache_hits_total - before.prefix_cache_hits_total == 6 * bs
    if where == "host_then_disk":  # the prefix's head was evicted last: still in RAM; the rest pushed to disk
        assert hits["host"] > 0 and hits["disk"] > 0 and s.kv_offload["host"].evictions > 0
    else:
        assert hits[where] == 6 and s.kv_offload[where].bytes_out == 6 * per
    compare(tiny, prompts, first + second, first_logits + second_logits)


def test_int8_kv_reload_is_bit_exact(llama, make_engine, tmp_path):
    """int8 blocks and their scales travel together: the reloaded run equals one that never evicted."""
    bs = 4
    per = _block_bytes(llama.path, bs, "int8")
    shared = random_prompts(1, 25, 25, seed=21)[0]
    prompt = [shared + [5]]
    plain = make_engine(llama.path, block_size=bs, num_kv_blocks=64, kv_cache_dtype="int8")
    run_and_capture(plain, [shared + [3]])
    want, want_logits, _ = run_and_capture(plain, prompt)  # prefix from the device cache
    eng = make_engine(
        llama.path,
        block_size=bs,
        num_kv_blocks=16,
        kv_cache_dtype="int8",
        kv_offload_host_bytes=2 * per,
        kv_offload_disk_bytes=64 * per,
        kv_offload_disk_dir=str(tmp_path),
    )
    _fixed_cost(eng, prefill_s_per_token=1.0)
    run_and_capture(eng, [shared + [3]])
    _evict_all(eng, seed=22)
    got, got_logits, _ = run_and_capture(eng, prompt)
    assert eng.stats().kv_offload["disk"].hits + eng.stats().kv_offload["host"].hits == 6
    assert got == want
    assert all(bool((a == b).all()) for a, b in zip(got_logits[0], want_logits[0]))


def test_recompute_chosen_over_a_slow_tier_is_counted_and_exact(llama, make_engine):
    bs = 4
    per = _block_bytes(llama.path, bs)
    eng = make_engine(llama.path, block_size=bs, num_kv_blocks=16, kv_offload_host_bytes=64 * per)
    _fixed_cost(eng, host_bytes_per_s=1.0, prefill_s_per_token=1e-9)  # loading never pays
    shared = random_prompts(1, 25, 25, seed=31)[0]
    prompts = [shared + [1], shared + [2]]
    first, first_logits, _ = run_and_capture(eng, prompts[:1])
    _evict_all(eng, seed=32)
    second, second_logits, _ = run_and_capture(eng, prompts[1:])
    s = eng.stats()
    assert s.kv_offload["host"].hits == 0 and s.kv_offload["host"].recomputed == 6
    compare(llama, prompts, first + second, first_logits + second_logits)


def test_offload_needs_prefix_caching_and_a_block_of_room(llama):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        from pdfleet_worker.engine.llm_engine import LLMEngine

        LLMEngine(
            EngineConfig(model=llama.path, num_kv_blocks=8, enable_prefix_caching=False, kv_offload_host_bytes=1 << 20)
        )
    with pytest.raises(ValueError, match="kv_offload_disk_bytes=10 holds no KV block"):
        LLMEngine(EngineConfig(model=llama.path, num_kv_blocks=8, kv_offload_disk_bytes=10))
    with pytest.raises(ValueError, match="preemption must be one of"):
        EngineConfig(model=llama.path, preemption="drop")


# -- swap preemption -----------------------------------------------------------------------------------


def test_swap_preemption_matches_transformers(tiny, make_engine):
    prompts = random_prompts(6, 8, 20, seed=5)
    eng = make_engine(
        tiny.path,
        block_size=4,
        num_kv_blocks=10,
        max_num_batched_tokens=64,
        preemption="swap",
        swap_space_bytes=64 * _block_bytes(tiny.path, 4),
    )
    seen = set()
    tokens, logits, _ = run_and_capture(
        eng, prompts, on_step=lambda e, _: seen.update(q.status for q in e.scheduler.requests.values())
    )
    s = eng.stats()
    assert SequenceStatus.SWAPPED in seen
    assert s.swap.swapped_out > 0 and s.swap.swapped_in == s.swap.swapped_out and s.swap.fallbacks == 0
    assert s.num_preemptions_total == s.swap.swapped_out
    assert compare(tiny, prompts, tokens, logits).near_ties <= 1


def test_full_swap_space_falls_back_to_recompute(llama, make_engine):
    prompts = random_prompts(6, 8, 20, seed=5)
    eng = make_engine(
        llama.path,
        block_size=4,
        num_kv_blocks=10,
        max_num_batched_tokens=64,
        preemption="swap",
        swap_space_bytes=3 * _block_bytes(llama.path, 4),
    )
    tokens, logits, _ = run_and_capture(eng, prompts)
    s = eng.stats()
    assert s.swap.fallbacks > 0 and s.num_preemptions_total == s.swap.swapped_out + s.swap.fallbacks
    assert compare(llama, prompts, tokens, logits).near_ties <= 1


def test_abort_while_swapped_frees_the_swap_space(llama, make_engine):
    prompts = random_prompts(6, 8, 20, seed=5)
    eng = make_engine(
        llama.path,
        block_size=4,
        num_kv_blocks=10,
        max_num_batched_tokens=64,
        preemption="swap",
        swap_space_bytes=64 * _block_bytes(llama.path, 4),
    )
    aborted = []

    def abort_swapped(e, _):
        for q in list(e.scheduler.swapped):
            aborted.append(q.request_id)
            e.abort(q.request_id)

    run_and_capture(eng, prompts, on_step=abort_swapped)
    off = eng.block_manager.offload
    assert aborted and len(off.swap_free) == off.swap_capacity  # make_engine checks the pool is whole


# -- metrics -------------------------------------------------------------------------------------------


def test_offload_and_swap_metrics_are_exported(llama, make_engine, tmp_path):
    from pdfleet_worker.server.worker_metrics import WorkerMetrics

    bs = 4
    per = _block_bytes(llama.path, bs)
    eng = make_engine(
        llama.path,
        block_size=bs,
        num_kv_blocks=16,
        kv_offload_host_bytes=64 * per,
        kv_offload_disk_bytes=8 * per,
        kv_offload_disk_dir=str(tmp_path),
    )
    _fixed_cost(eng, prefill_s_per_token=1.0)
    shared = random_prompts(1, 25, 25, seed=41)[0]
    run_and_capture(eng, [shared + [1]])
    _evict_all(eng, seed=42)
    run_and_capture(eng, [shared + [2]])
    text = WorkerMetrics("m", "both", "cpu", eng.stats).exposition().decode()
    base = 'accelerator="cpu",model_name="m",role="both"'  # labels come out sorted
    assert f'pdfleet_kv_offload_hits_total{{{base},tier="host"}} 6.0' in text
    assert f'pdfleet_kv_offload_hits_total{{{base},tier="disk"}} 0.0' in text
    assert f'pdfleet_kv_offload_capacity_bytes{{{base},tier="disk"}} {8.0 * per}' in text
    loaded = 'accelerator="cpu",direction="loaded",model_name="m",role="both",tier="host"'
    assert f"pdfleet_kv_offload_bytes_total{{{loaded}}} {6.0 * per}" in text
    assert "pdfleet_kv_offload_usage_perc{" in text and "pdfleet_preemption_swap_fallbacks_total{" in text


def test_batched_copies_have_the_effect_of_running_them_one_by_one(llama, make_engine, tmp_path):
    """apply_copies merges copies into runs; any order of saves, demotions, loads and swaps (slots reused
    within one batch) ends with every pool block and slot as the copies run one at a time leave them."""
    import random

    import torch

    from pdfleet_worker.engine.kv_offload import Copy

    per = _block_bytes(llama.path, 4)
    eng = make_engine(
        llama.path,
        block_size=4,
        num_kv_blocks=6,
        kv_offload_host_bytes=3 * per,
        kv_offload_disk_bytes=3 * per,
        kv_offload_disk_dir=str(tmp_path),
        preemption="swap",
        swap_space_bytes=3 * per,
    )
    mr = eng.model_runner
    tensors = [c.kv for c in mr.caches] + [c.kv for store in mr.stores.values() for c in store]
    rng = random.Random(0)
    kinds = [
        ("save", "host"),
        ("save", "disk"),
        ("demote", "disk"),
        ("load", "host"),
        ("load", "disk"),
        ("swap_out", "swap"),
        ("swap_in", "swap"),
    ]
    for trial in range(20):
        copies = []
        for _ in range(rng.randint(1, 12)):
            kind, tier = rng.choice(kinds)
            src_n = 6 if kind in ("save", "swap_out") else 3
            dst_n = 6 if kind in ("load", "swap_in") else 3
            copies.append(Copy(kind, rng.randrange(src_n), rng.randrange(dst_n), tier))
        torch.manual_seed(trial)
        start = [torch.randn_like(t) for t in tensors]
        for t, s in zip(tensors, start):
            t.copy_(s)
        mr.apply_copies(copies)
        batched = [t.clone() for t in tensors]
        for t, s in zip(tensors, start):
            t.copy_(s)
        for c in copies:
            mr.apply_copies([c])
        assert all(torch.equal(a, b) for a, b in zip(batched, tensors)), copies
    for t in tensors:
        t.zero_()


# -- CUDA (opt-in: never run where this was written, which has no GPU) ---------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("where", ["host", "disk"])
def test_cuda_reload_and_swap_match_transformers(tiny, make_engine, tmp_path, where):
    """The pool on the GPU, the host tier and swap space pinned RAM, the disk tier an mmap'd file: the copies
    cross devices; greedy tokens after a reload and under swap preemption equal transformers."""
    bs = 16
    per = _block_bytes(tiny.path, bs)
    host, disk = (64, 0) if where == "host" else (0, 64)
    eng = make_engine(
        tiny.path,
        device="cuda",
        block_size=bs,
        num_kv_blocks=8,
        max_num_batched_tokens=64,
        kv_offload_host_bytes=host * per,
        kv_offload_disk_bytes=disk * per,
        kv_offload_disk_dir=str(tmp_path),
        preemption="swap",
        swap_space_bytes=64 * per,
    )
    _fixed_cost(eng, prefill_s_per_token=1.0)
    shared = random_prompts(1, 50, 50, seed=51)[0]
    prompts = [shared + [1], shared + [2]]
    first, first_logits, _ = run_and_capture(eng, prompts[:1])
    run_and_capture(
        eng, random_prompts(2, 60, 60, seed=52), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    )
    second, second_logits, _ = run_and_capture(eng, prompts[1:])
    assert eng.stats().kv_offload[where].hits == 3
    logits = [[r.cpu() for r in rows] for rows in first_logits + second_logits]
    compare(tiny, prompts, first + second, logits)
    many = random_prompts(4, 20, 40, seed=53)
    tokens, logits, _ = run_and_capture(eng, many)
    assert eng.stats().swap.swapped_out > 0
    assert compare(tiny, many, tokens, [[r.cpu() for r in rows] for rows in logits]).near_ties <= 1
