"""Loopback ports for the processes `pdfleet up` (and the tests and benchmarks) start. Standard library only: the
benchmarks' own virtualenvs import it without pdfleet's dependencies."""

from __future__ import annotations

import errno
import random
import socket


def port_free(port: int, host: str = "127.0.0.1", reuse: bool = True) -> bool:
    """Whether a listener could bind host:port now; `reuse` as a server binds (SO_REUSEADDR: TIME_WAIT is free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def ephemeral_floor() -> int:
    """The lowest port Linux gives an outgoing connection or a bind to port 0 (`ip_local_port_range`)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


_RANDOM = random.SystemRandom()  # its own entropy: processes started alike never draw alike


def free_port(host: str = "127.0.0.1", avoid: set[int] | frozenset[int] = frozenset()) -> int:
    """A loopback port nobody listens on now (and not one already handed out in `avoid`), for a child to listen on.

    Drawn at random below the kernel's ephemeral range rather than with bind(0): the kernel hands ports of that range
    to outgoing connections, and in the seconds a worker takes to import torch and listen, a connection may take its
    port. Polling the worker's /ready does it too: a connect to a closed loopback port inside the range can pick that
    same port as its own source and connect to itself, holding the port (the worker then exits on EADDRINUSE)."""
    floor = ephemeral_floor()
    low = max(1024, floor - 20000)
    for _ in range(256) if floor - low >= 2048 else ():
        port = _RANDOM.randrange(low, floor)
        if port not in avoid and port_free(port, host, reuse=False):
            return port
    for _ in range(64):  # a range that leaves no room below it (or none found free there): the kernel's choice
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port
    raise OSError(errno.EADDRNOTAVAIL, f"no free port found on {host}")
