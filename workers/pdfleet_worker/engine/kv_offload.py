"""Where evicted prefix-cache blocks and swapped-out sequences live off the device: the bookkeeping of the
host-RAM and disk tiers (LRU per tier, bounded), the swap space, the load-or-recompute cost model, and the
ordered list of copies the model runner performs before the next forward pass. No torch: the BlockManager
and the Scheduler call it; ModelRunner.apply_copies moves the bytes.

Tiers (seed 003 §3.2): a hashed block the device pool evicts goes to the host tier; a host block the host
tier evicts goes to the disk tier (a memory-mapped file); a disk block the disk tier evicts is dropped.
Each tier is exclusive: a hash is in exactly one place (device, host or disk). A prefix hit in a tier is
copied back into a free device block and leaves the tier.
"""

from __future__ import annotations

import collections
import dataclasses

HOST, DISK = "host", "disk"
TIERS = (HOST, DISK)

# The cost model's defaults (docs/engine.md, "Tiered KV offload"): a tier's bytes per second and the device's
# prefill seconds per token until the engine has measured its own (an exponential moving average of the
# copies and prefill steps it ran; MEASURE_WEIGHT is the weight of the newest sample).
DEFAULT_HOST_BYTES_PER_S = 4e9  # a memcpy between two RAM buffers on a loaded server core
DEFAULT_DISK_BYTES_PER_S = 1e9  # an mmap'd file on local NVMe (an emptyDir), page cache cold
DEFAULT_PREFILL_S_PER_TOKEN = 2e-4  # a ~150M-parameter model prefilling on a few CPU cores
LOAD_OVERHEAD_S = 2e-4  # fixed cost of one load batch (index tensors, the call itself)
MEASURE_WEIGHT = 0.3


@dataclasses.dataclass(frozen=True)
class Copy:
    """One block copy for ModelRunner.apply_copies, in the order they were decided.

    kind: save (device block -> host/disk slot, a prefix-cache eviction), demote (host slot -> disk slot),
    load (host/disk slot -> device block, a prefix hit), swap_out (device block -> swap slot), swap_in
    (swap slot -> device block)."""

    kind: str
    src: int
    dst: int
    tier: str = HOST  # save/demote: the destination tier; load: the source tier; swap: "swap"


@dataclasses.dataclass
class TierStats:
    """Cumulative per-tier counters (blocks unless named bytes)."""

    stored: int = 0  # blocks written into this tier (device evictions or host demotions)
    hits: int = 0  # blocks loaded back into the device on a prefix hit
    hit_tokens: int = 0
    evictions: int = 0  # blocks this tier pushed out (to disk, or dropped for disk)
    recomputed: int = 0  # blocks found here but recomputed because loading would cost more
    bytes_in: int = 0  # bytes written into the tier
    bytes_out: int = 0  # bytes read back into the device


@dataclasses.dataclass
class SwapStats:
    swapped_out: int = 0  # preemptions that went to swap space (sequences)
    swapped_in: int = 0  # sequences brought back
    fallbacks: int = 0  # preemptions that wanted swap but found it full: recomputed instead
    blocks_out: int = 0
    blocks_in: int = 0


@dataclasses.dataclass
class CostModel:
    """Load a tier hit or recompute it: load_s = LOAD_OVERHEAD_S + bytes / bandwidth(tier) against
    recompute_s = tokens x prefill_s_per_token. The engine feeds measured values in with observe_*."""

    host_bytes_per_s: float = DEFAULT_HOST_BYTES_PER_S
    disk_bytes_per_s: float = DEFAULT_DISK_BYTES_PER_S
    prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN
    measure: bool = True  # False: keep the configured values (tests, a fixed policy)

    def bandwidth(self, tier: str) -> float:
        return self.host_bytes_per_s if tier == HOST else self.disk_bytes_per_s

    def load_s(self, tier: str, nbytes: int) -> float:
        return LOAD_OVERHEAD_S + nbytes / self.bandwidth(tier)

    def recompute_s(self, num_tokens: int) -> float:
        return num_tokens * self.prefill_s_per_token

    def should_load(self, tier: str, nbytes: int, num_tokens: int) -> bool:
        return self.load_s(tier, nbytes) <= self.recompute_s(num_tokens)

    def observe_copy(self, tier: str, nbytes: int, seconds: float) -> None:
        if not self.measure or seconds <= 0 or nbytes < (1 << 20):  # small copies measure the overhead, not bandwidth
            return
        name = "host_bytes_per_s" if tier == HOST else "disk_bytes_per_s"
        setattr(self, name, _ewma(getattr(self, name), nbytes / seconds))

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if not self.measure or seconds <= 0 or num_tokens < 64:  # a decode-sized step says little about prefill
            return
        self.prefill_s_per_token = _ewma(self.prefill_s_per_token, seconds / num_tokens)


def _ewma(old: float, new: float) -> float:
    return (1 - MEASURE_WEIGHT) * old + MEASURE_WEIGHT * new


class _Tier:
    """Slots 0..capacity-1 holding block hashes, least recently used first."""

    def __init__(self, name: str, capacity: int):
        assert capacity >= 0, f"{name} tier capacity {capacity}"
        self.name = name
        self.capacity = capacity
        self.lru: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.free_slots: list[int] = list(range(capacity - 1, -1, -1))
        self.stats = TierStats()

    def __len__(self) -> int:
        return len(self.lru)

    def __contains__(self, h: bytes) -> bool:
        return h in self.lru


class OffloadIndex:
    """The host and disk tiers' contents and the swap space's free slots; records the copies it decides.

    block_bytes: bytes of one block across all layers (kv_bytes_per_block), for the cost model and the
    byte counters. A capacity of 0 turns a tier off (host 0 with disk > 0: evictions go straight to disk).
    """

    def __init__(
        self,
        *,
        host_blocks: int = 0,
        disk_blocks: int = 0,
        swap_blocks: int = 0,
        block_bytes: int = 1,
        cost: CostModel | None = None,
    ):
        self.tiers = {HOST: _Tier(HOST, host_blocks), DISK: _Tier(DISK, disk_blocks)}
        self.block_bytes = block_bytes
        self.cost = cost or CostModel()
        self.swap_capacity = swap_blocks
        self.swap_free: list[int] = list(range(swap_blocks - 1, -1, -1))
        self.swap_stats = SwapStats()
        self.copies: list[Copy] = []
        self._reserved: list[tuple[str, int]] = []  # slots of hits taken this admission: freed after their loads

    @property
    def enabled(self) -> bool:
        return any(t.capacity for t in self.tiers.values())

    def usage(self, tier: str) -> float:
        t = self.tiers[tier]
        return len(t) / t.capacity if t.capacity else 0.0

    @property
    def swap_usage(self) -> float:
        return 1 - len(self.swap_free) / self.swap_capacity if self.swap_capacity else 0.0

    def take_copies(self) -> list[Copy]:
        out, self.copies = self.copies, []
        return out

    # -- prefix-cache tiers ----------------------------------------------------------------------------
    def locate(self, h: bytes) -> str | None:
        for name, t in self.tiers.items():
            if h in t:
                return name
        return None

    def evicted(self, h: bytes, device_block: int) -> None:
        """The device pool is reusing a block that held hash h: keep its KV in the first tier with room."""
        if self.locate(h) is not None:  # NOTE: exclusive tiers; a second device copy of h was never published
            return
        for name in TIERS:
            slot = self._slot(name)
            if slot is not None:
                self._put(name, h, slot, Copy("save", device_block, slot, name))
                return

    def _slot(self, name: str) -> int | None:
        """A free slot of the tier, making one by pushing its LRU block down a tier (or out) if needed."""
        t = self.tiers[name]
        if not t.capacity:
            return None
        if t.free_slots:
            return t.free_slots.pop()
        if not t.lru:  # every slot is reserved by a load decided in this step
            return None
        victim, slot = t.lru.popitem(last=False)
        t.stats.evictions += 1
        if name == HOST:
            below = self._slot(DISK)
            if below is not None:
                self._put(DISK, victim, below, Copy("demote", slot, below, DISK))
        return slot

    def _put(self, name: str, h: bytes, slot: int, copy: Copy) -> None:
        t = self.tiers[name]
        t.lru[h] = slot
        t.stats.stored += 1
        t.stats.bytes_in += self.block_bytes
        self.copies.append(copy)

    def worth_loading(self, tier: str, num_blocks: int, block_size: int) -> bool:
        return self.cost.should_load(tier, num_blocks * self.block_bytes, num_blocks * block_size)

    def record_recomputed(self, tier: str, num_blocks: int) -> None:
        self.tiers[tier].stats.recomputed += num_blocks

    def reserve(self, hashes: list[bytes]) -> list[tuple[str, int]]:
        """Take hits out of their tiers' LRU before the device blocks for them are found (finding one may
        evict another block into a full tier, which must not push these out)."""
        taken = []
        for h in hashes:
            name = self.locate(h)
            assert name is not None, "reserve of a hash that is in no tier"
            taken.append((name, self.tiers[name].lru.pop(h)))
        return taken

    def load_reserved(self, name: str, slot: int, device_block: int, block_size: int) -> None:
        t = self.tiers[name]
        t.stats.hits += 1
        t.stats.hit_tokens += block_size
        t.stats.bytes_out += self.block_bytes
        self.copies.append(Copy("load", slot, device_block, name))
        self._reserved.append((name, slot))

    def end_admission(self) -> None:
        """Free the slots of this admission's loads (their copies are already queued)."""
        for name, slot in self._reserved:
            self.tiers[name].free_slots.append(slot)
        self._reserved = []

    # -- swap space ------------------------------------------------------------------------------------
    def can_swap(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.swap_free)

    def swap_out(self, device_blocks: list[int]) -> list[int]:
        slots = [self.swap_free.pop() for _ in device_blocks]
        self.copies += [Copy("swap_out", b, s, "swap") for b, s in zip(device_blocks, slots)]
        self.swap_stats.swapped_out += 1
        self.swap_stats.blocks_out += len(slots)
        return slots

    def swap_in(self, slots: list[int], device_blocks: list[int]) -> None:
        self.copies += [Copy("swap_in", s, b, "swap") for s, b in zip(slots, device_blocks)]
        self.swap_stats.swapped_in += 1
        self.swap_stats.blocks_in += len(slots)
        self.swap_free += slots  # NOTE: after the copies are queued; a later swap_out in this step copies later

    def drop_swap(self, slots: list[int]) -> None:
        """A swapped-out sequence finished (aborted) before coming back."""
        self.swap_free += slots
