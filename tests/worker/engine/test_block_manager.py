"""BlockManager unit tests: exact block ids, ref counts, chained hashes, LRU eviction. No torch."""

from __future__ import annotations

import subprocess
import sys

from pdfleet_worker.engine.block_manager import BlockManager, hash_block
from pdfleet_worker.engine.sequence import Sequence
from pdfleet_worker.sampling_params import SamplingParams

P = SamplingParams(max_tokens=4)


def seq(tokens, rid="a") -> Sequence:
    return Sequence(rid, list(tokens), P)


def test_allocate_and_free_exact_ids():
    bm = BlockManager(8, 4)
    a, b = seq(range(10), "a"), seq(range(5), "b")
    assert bm.allocate(a, 10) and a.block_ids == [0, 1, 2]
    assert bm.allocate(b, 5) and b.block_ids == [3, 4]
    assert bm.num_free_blocks == 3 and bm.usage == 5 / 8
    assert bm.allocate(a, 12) and a.block_ids == [0, 1, 2]  # still fits in 3 blocks
    assert bm.allocate(a, 13) and a.block_ids == [0, 1, 2, 5]
    assert not bm.allocate(b, 20) and b.block_ids == [3, 4]  # needs 3 more, 2 free: unchanged
    bm.free(a)
    bm.free(b)
    assert bm.is_whole()


def test_hash_is_chained_and_process_independent():
    h1 = hash_block(None, [1, 2, 3], "seed")
    assert hash_block(None, [1, 2, 3], "seed") == h1
    assert hash_block(None, [1, 2, 3], "other") != h1
    assert hash_block(h1, [4, 5], "seed") != hash_block(None, [4, 5], "seed")
    code = "from pdfleet_worker.engine.block_manager import hash_block;print(hash_block(None, [1, 2, 3], 'seed').hex())"
    for salt in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": salt, "PATH": ""},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert out == h1.hex()


def test_prefix_hits_share_blocks_and_count_refs():
    bm = BlockManager(8, 4)
    a = seq(range(11), "a")
    assert bm.allocate(a, 11)
    a.num_computed_tokens = 11
    bm.cache_full_blocks(a)  # blocks 0 and 1 are full -> published
    b = seq(list(range(8)) + [99, 98], "b")
    hits = bm.find_cached_prefix(b, b.num_tokens - 1)
    assert hits == [0, 1]
    assert bm.allocate(b, 10, hits) and b.block_ids == [0, 1, 3]
    assert bm.ref_cnt[:4] == [2, 2, 1, 1]
    bm.free(a)
    assert bm.ref_cnt[:4] == [1, 1, 0, 1]
    bm.free(b)
    assert bm.is_whole()


def test_last_token_never_hits():
    """A prompt that is exactly cached still computes its last block (its logits are needed)."""
    bm = BlockManager(8, 4)
    a = seq(range(8), "a")
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    bm.free(a)
    b = seq(range(8), "b")
    assert bm.find_cached_prefix(b, b.num_tokens - 1) == [0]


def test_lru_eviction_of_cached_free_blocks():
    bm = BlockManager(4, 2)
    a = seq([1, 2, 3, 4], "a")
    bm.allocate(a, 4)
    a.num_computed_tokens = 4
    bm.cache_full_blocks(a)
    bm.free(a)  # blocks 0,1 free but cached
    assert bm.num_free_blocks == 4 and len(bm.cached) == 2
    c = seq([7, 7, 7, 7], "c")
    assert bm.allocate(c, 4) and c.block_ids == [2, 3]  # uncached blocks go first
    assert len(bm.cached) == 2
    d = seq([8, 8], "d")
    assert bm.allocate(d, 2) and d.block_ids == [1]  # then the LRU one: a's tail before its head
    assert len(bm.cached) == 1
    e = seq([1, 2, 5], "e")
    assert bm.find_cached_prefix(e, 2) == [0]  # a's head survived
    bm.free(c)
    bm.free(d)
    assert bm.is_whole()


def test_reviving_a_cached_free_block_counts_against_free():
    bm = BlockManager(2, 2)
    a = seq([1, 2, 3], "a")
    bm.allocate(a, 3)
    a.num_computed_tokens = 3
    bm.cache_full_blocks(a)
    bm.free(a)
    b = seq([1, 2, 9, 9, 9], "b")
    hits = bm.find_cached_prefix(b, 4)
    assert hits == [0]
    assert not bm.allocate(b, 6, hits)  # hit block + 2 new > 2 free: refused, nothing changed
    assert bm.num_free_blocks == 2 and b.block_ids == []
    assert bm.allocate(b, 4, hits) and b.block_ids == [0, 1]
    bm.free(b)
    assert bm.is_whole()


def test_prefix_caching_off():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    a = seq([1, 2, 3, 4], "a")
    bm.allocate(a, 4)
    a.num_computed_tokens = 4
    bm.cache_full_blocks(a)
    assert not bm.cached
    assert bm.find_cached_prefix(seq([1, 2, 3, 4, 5], "b"), 4) == []
    bm.free(a)
