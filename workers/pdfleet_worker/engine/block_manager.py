"""Paged KV block accounting (free list, ref counts, chained prefix hashes, LRU eviction, and the offload tiers an
evicted hashed block moves to); only the Scheduler calls it. No torch."""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
import math

from pdfleet_worker.engine.kv_offload import OffloadIndex
from pdfleet_worker.engine.sequence import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: list[int] | tuple[int, ...], seed: str) -> BlockHash:
    """Chained hash of one full block: the same tokens after the same prefix give the same hash on
    every worker and every run (no Python `hash()`, whose salt differs per process)."""
    h = hashlib.blake2b(digest_size=16, key=seed.encode()[:64])
    h.update(parent or b"\0" * 16)
    h.update(array.array("q", token_ids).tobytes())
    return h.digest()


@dataclasses.dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache counters, in tokens (vLLM's prefix_cache_queries/hits)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0


class BlockManager:
    """Owns block ids 0..num_blocks-1. A block is in use (ref_cnt > 0), or free; a free block may
    still hold a cached prefix (it keeps its hash) until it is evicted, least recently used first.

    With an OffloadIndex (tiered KV offload) an evicted hashed block's KV moves to the host or disk tier, and
    a prefix lookup continues there: such a hit is an entry of type bytes (its hash) among the block ids
    find_cached_prefix returns, and allocate copies it back into a free block."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        hash_seed: str = "pdfleet-v1",
        offload: OffloadIndex | None = None,
    ):
        assert num_blocks >= 1 and block_size >= 1, f"bad pool {num_blocks}x{block_size}"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # Free blocks in eviction order: the first key is reused first.
        self.free_queue: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.stats = PrefixCacheStats()
        self.offload = offload

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached-but-free blocks count: they are evictable)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def is_whole(self) -> bool:
        """Every block free and unreferenced: the state after all requests finished."""
        return len(self.free_queue) == self.num_blocks and not any(self.ref_cnt)

    # -- prefix cache ----------------------------------------------------------------------
    def block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[BlockHash]:
        """Hashes of the sequence's first `num_full_blocks` blocks (memoised on the sequence)."""
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs], self.hash_seed))
        return hashes[:num_full_blocks]

    def find_cached_prefix(self, seq: Sequence, max_tokens: int) -> list[int | BlockHash]:
        """The longest cached run of full blocks within the first `max_tokens` tokens: device block ids, and
        with offload tiers the hashes of blocks found in one. A tier whose hits would take longer to load than
        to recompute (the OffloadIndex's cost model) ends the run at its first hit; those blocks are counted
        as recomputed when the sequence is admitted (seq.offload_skipped)."""
        hits: list[int | BlockHash] = []
        seq.offload_skipped = {}
        if not self.enable_prefix_caching:
            return hits
        off = self.offload
        tiers: list[str] = []
        for h in self.block_hashes(seq, max_tokens // self.block_size):
            block_id = self.cached.get(h)
            if block_id is not None:
                hits.append(block_id)
                tiers.append("")
                continue
            tier = off.locate(h) if off is not None else None
            if tier is None:
                break
            hits.append(h)
            tiers.append(tier)
        for tier in dict.fromkeys(t for t in tiers if t):
            if not off.worth_loading(tier, tiers.count(tier), self.block_size):
                cut = tiers.index(tier)
                for t in tiers[cut:]:
                    if t:
                        seq.offload_skipped[t] = seq.offload_skipped.get(t, 0) + 1
                del hits[cut:], tiers[cut:]
        return hits

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted lookup (tokens looked up, tokens found)."""
        if self.enable_prefix_caching:
            self.stats.requests += 1
            self.stats.queries += num_tokens
            self.stats.hits += num_hit_tokens

    # -- allocation ------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int, cached_block_ids: list[int | BlockHash] = ()) -> bool:
        """Make the sequence's block table cover `num_tokens` tokens, starting with `cached_block_ids`
        (a prefix hit from find_cached_prefix; only for a sequence that holds no blocks yet; a hash is a
        tier hit, loaded into a free block). Returns False and changes nothing when the pool cannot supply
        the blocks."""
        if cached_block_ids:
            assert not seq.block_ids, f"{seq}: prefix hits are taken only at admission"
        need = self.blocks_needed(num_tokens) - len(seq.block_ids) - len(cached_block_ids)
        device = [b for b in cached_block_ids if isinstance(b, int)]
        offloaded = [h for h in cached_block_ids if isinstance(h, bytes)]
        reviving = sum(1 for b in device if self.ref_cnt[b] == 0)
        if max(need, 0) + reviving + len(offloaded) > len(self.free_queue):
            return False
        for b in device:  # first, so that finding blocks for the loads cannot evict them
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1
        if offloaded:
            slots = iter(self.offload.reserve(offloaded))
            for entry in cached_block_ids:
                if isinstance(entry, int):
                    seq.block_ids.append(entry)
                    continue
                b = self._pop_free()
                tier, slot = next(slots)
                self.offload.load_reserved(tier, slot, b, self.block_size)
                self.cached[entry] = b
                self.block_hash[b] = entry
                seq.block_ids.append(b)
            self.offload.end_admission()
        else:
            seq.block_ids += device
        if seq.offload_skipped:  # admitted: tier hits the cost model chose to recompute
            for tier, n in seq.offload_skipped.items():
                self.offload.record_recomputed(tier, n)
            seq.offload_skipped = {}
        seq.num_published_blocks = max(seq.num_published_blocks, len(cached_block_ids))
        for _ in range(need):
            seq.block_ids.append(self._pop_free())
        return True

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        assert self.ref_cnt[block_id] == 0, f"block {block_id} is on the free list with refs"
        h = self.block_hash[block_id]
        if h is not None:  # evict the cached prefix this block held
            if self.cached.get(h) == block_id:
                del self.cached[h]
                if self.offload is not None:
                    self.offload.evicted(h, block_id)
            self.block_hash[block_id] = None
        self.ref_cnt[block_id] = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references. Hashed blocks stay cached (most recently used last);
        the tail of a sequence is freed first so it is evicted before its shared head."""
        for b in reversed(seq.block_ids):
            assert self.ref_cnt[b] > 0, f"block {b} of {seq} freed twice"
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None
                if self.block_hash[b] is None:  # nothing worth keeping: reuse it first
                    self.free_queue.move_to_end(b, last=False)
        seq.block_ids = []
        seq.num_published_blocks = 0

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the hashes of the sequence's computed full blocks so later requests can hit them."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        hashes = self.block_hashes(seq, num_full)
        for i in range(seq.num_published_blocks, num_full):
            b = seq.block_ids[i]
            if self.block_hash[b] is None and hashes[i] not in self.cached:
                self.cached[hashes[i]] = b
                self.block_hash[b] = hashes[i]
        seq.num_published_blocks = max(seq.num_published_blocks, num_full)
