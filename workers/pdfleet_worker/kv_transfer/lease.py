"""Leases on KV blocks a prefill worker holds for decode workers: freed on ack or expiry, never while a pull reads them;
the engine loop and the KV connector call it."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable


@dataclasses.dataclass
class Lease:
    request_id: str
    block_ids: list[int]
    num_tokens: int
    expires_at: float
    pins: int = 0  # pulls reading the blocks right now
    release_pending: bool = False


class LeaseTable:
    """Thread-safe. `free(request_id)` gives the blocks back to the engine (it must be safe to call
    from any thread: the server passes a function that queues LLMEngine.release_held on the
    engine thread). A pinned lease is freed when its last pull ends, never under a pull."""

    def __init__(self, lease_seconds: float, free: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be > 0, got {lease_seconds}")
        self.lease_seconds = lease_seconds
        self._free = free
        self._clock = clock
        self._lock = threading.Lock()
        self._unpinned = threading.Condition(self._lock)  # notified when a pull's pin ends
        self._leases: dict[str, Lease] = {}
        self.num_expired = 0
        self.num_released = 0
        self.num_dropped = 0  # freed at shutdown or by an abort

    def add(self, request_id: str, block_ids: list[int], num_tokens: int) -> Lease:
        with self._lock:
            assert request_id not in self._leases, f"lease {request_id!r} exists"
            lease = Lease(request_id, list(block_ids), num_tokens, self._clock() + self.lease_seconds)
            self._leases[request_id] = lease
            return lease

    def pin(self, request_id: str) -> Lease | None:
        """Hold the lease open for a pull. None if unknown, released or expired."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.release_pending or lease.expires_at <= self._clock():
                return None
            lease.pins += 1
            return lease

    def unpin(self, request_id: str) -> None:
        with self._lock:
            lease = self._leases[request_id]
            assert lease.pins > 0, f"lease {request_id!r} unpinned more than pinned"
            lease.pins -= 1
            done = lease.pins == 0 and lease.release_pending
            if done:
                del self._leases[request_id]
            self._unpinned.notify_all()
        if done:
            self._free(request_id)

    def release(self, request_id: str, *, counted: str = "released") -> bool:
        """The ack: free now, or when the running pulls end. False if there is no such lease."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.release_pending:
                return False
            self._count(counted)
            if lease.pins:
                lease.release_pending = True
                return True
            del self._leases[request_id]
        self._free(request_id)
        return True

    def wait_unpinned(self, request_id: str, timeout_s: float) -> bool:
        """Wait (at most timeout_s) until no pull reads the lease: an ack that arrives while the puller's last
        bytes are still leaving is answered once the blocks are freed. True if no pull reads it now."""
        with self._unpinned:
            return self._unpinned.wait_for(
                lambda: not (lease := self._leases.get(request_id)) or not lease.pins, timeout=timeout_s
            )

    def expire(self) -> list[str]:
        """Free every lease past its deadline (pinned ones when their pull ends)."""
        now = self._clock()
        with self._lock:
            due = [rid for rid, lease in self._leases.items() if lease.expires_at <= now and not lease.release_pending]
        return [rid for rid in due if self.release(rid, counted="expired")]

    def release_all(self) -> int:
        """Shutdown: free everything (pinned leases when their pull ends)."""
        with self._lock:
            ids = [rid for rid, lease in self._leases.items() if not lease.release_pending]
        return sum(self.release(rid, counted="dropped") for rid in ids)

    def next_expiry(self) -> float | None:
        with self._lock:
            times = [lease.expires_at for lease in self._leases.values() if not lease.release_pending]
        return min(times) if times else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def _count(self, counted: str) -> None:
        if counted == "released":
            self.num_released += 1
        elif counted == "expired":
            self.num_expired += 1
        else:
            self.num_dropped += 1
