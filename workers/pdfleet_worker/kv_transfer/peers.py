"""The prefill KV endpoints a decode worker may pull from and send its token to (`--kv-peers`): addresses, CIDRs and DNS
names (a headless Service: every ready pod's IP), each with an optional port; the TCP connector checks every connection
against it. No torch.

NOTE: a host in kv_transfer_params is matched, never resolved: an IP must be one the peers name or
resolve to, a name must be one of the peers' names. So a client-chosen name cannot point the decode
worker anywhere, and the address checked is the address connected to.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger("pdfleet.kv")

LOOPBACK = "127.0.0.1,::1,localhost"  # the default: prefill workers on this machine only
REFRESH_S = 30.0  # a peer name is re-resolved this often
MISS_REFRESH_S = 1.0  # or sooner, at most this often, when an address is not among its last answer

Resolver = Callable[[str], set[str]]


@dataclasses.dataclass(frozen=True)
class Peer:
    host: str  # an IP, a CIDR or a DNS name
    port: int | None = None  # None: any port

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and "/" not in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"


def parse(spec: str) -> list[Peer]:
    """'HOST[:PORT],...' (IPv6 as [ADDR]:PORT or bare, CIDRs allowed) -> peers; ValueError names the bad entry."""
    peers = []
    for raw in (s.strip() for s in spec.split(",")):
        if not raw:
            continue
        host, port = raw, None
        if raw.startswith("["):
            end = raw.find("]")
            rest = raw[end + 1 :] if end > 0 else None
            if rest is None or (rest and not rest.startswith(":")):
                raise ValueError(f"--kv-peers entry {raw!r}: expected [IPV6] or [IPV6]:PORT")
            host, port = raw[1:end], (rest[1:] if rest else None)
        elif raw.count(":") == 1:
            host, port = raw.split(":")
        if port is not None:
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--kv-peers entry {raw!r}: port {port!r} is not in 1-65535")
            port = int(port)
        if not host or any(c.isspace() for c in host):
            raise ValueError(f"--kv-peers entry {raw!r}: empty or malformed host")
        if "/" in host:
            try:
                ipaddress.ip_network(host, strict=False)
            except ValueError as e:
                raise ValueError(f"--kv-peers entry {raw!r}: {e}") from None
        peers.append(Peer(host.lower(), port))
    if not peers:
        raise ValueError("--kv-peers names no peer")
    return peers


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        addr = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def resolve(name: str) -> set[str]:
    return {info[4][0] for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}


class KVPeers:
    """Thread-safe; names are resolved on the caller's thread (the connector's pull threads)."""

    def __init__(self, peers: list[Peer], resolver: Resolver = resolve, clock: Callable[[], float] = time.monotonic):
        self.peers = peers
        self._resolver, self._clock = resolver, clock
        self._lock = threading.Lock()
        self._resolved: dict[str, tuple[float, set]] = {}  # name -> (when, addresses)

    @classmethod
    def from_spec(cls, spec: str, **kw) -> "KVPeers":
        return cls(parse(spec), **kw)

    def __str__(self) -> str:
        return ",".join(str(p) for p in self.peers)

    def allows(self, host: str, port: int) -> bool:
        """Whether a KV endpoint at host:port is one of ours (the token may be sent there)."""
        addr = _ip(host)
        name = host.lower().rstrip(".")
        for peer in self.peers:
            if peer.port is not None and peer.port != port:
                continue
            if peer.host.rstrip(".") == name:
                return True
            if addr is None:
                continue  # a name in the params must be a peer's own name
            if "/" in peer.host:
                if addr in ipaddress.ip_network(peer.host, strict=False):
                    return True
                continue
            own = _ip(peer.host)
            if own is not None:
                if own == addr:
                    return True
                continue
            if addr in self._addresses(peer.host, addr):
                return True
        return False

    def _addresses(self, name: str, wanted) -> set:
        now = self._clock()
        with self._lock:
            when, addrs = self._resolved.get(name, (None, set()))
        fresh = when is not None and (now - when < REFRESH_S and (wanted in addrs or now - when < MISS_REFRESH_S))
        if fresh:
            return addrs
        try:
            addrs = {a for a in (_ip(x) for x in self._resolver(name)) if a is not None}
        except OSError as e:
            log.warning("resolving KV peer %s failed: %s; keeping its last %d address(es)", name, e, len(addrs))
        with self._lock:
            self._resolved[name] = (now, addrs)
        return addrs
