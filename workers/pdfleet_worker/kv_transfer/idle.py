"""Idle KV connections a decode worker keeps per prefill endpoint between pulls, so a pull pays no connect, no serving
thread start and no cold TCP window; the TCP connector calls it.

NOTE: kept for less than the serving side's I/O timeout (it closes a connection idle that long), and a
request that finds its reused connection closed is sent again on a new one (TcpKVConnector._exchange).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

MAX_PER_PEER = 8  # the decode worker's pull threads
MAX_IDLE_S = 10.0  # the serving side closes after its io timeout (30 s by default)


class IdleConnections:
    """Thread-safe; newest first (its window is the warmest)."""

    def __init__(
        self,
        max_per_peer: int = MAX_PER_PEER,
        max_idle_s: float = MAX_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_per_peer, self.max_idle_s, self._clock = max_per_peer, max_idle_s, clock
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int], list[tuple[float, socket.socket]]] = {}
        self._closed = False

    def take(self, key: tuple[str, int]) -> socket.socket | None:
        stale = []
        found = None
        with self._lock:
            pool = self._idle.get(key, [])
            while pool:
                since, sock = pool.pop()
                if self._clock() - since < self.max_idle_s:
                    found = sock
                    break
                stale.append(sock)
        for sock in stale:
            sock.close()
        return found

    def give(self, key: tuple[str, int], sock: socket.socket) -> None:
        with self._lock:
            pool = self._idle.setdefault(key, [])
            if not self._closed and len(pool) < self.max_per_peer:
                pool.append((self._clock(), sock))
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = [s for pool in self._idle.values() for _, s in pool]
            self._idle.clear()
        for sock in socks:
            sock.close()
