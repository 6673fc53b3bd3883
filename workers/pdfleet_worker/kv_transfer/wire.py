"""Framing on the KV endpoint's sockets: length-prefixed JSON messages, and block bytes sent from and received into
lists of buffers with sendmsg/recvmsg_into (no joining, no copies in Python); the TCP and NIXL connectors call it."""

from __future__ import annotations

import json
import os
import socket
import struct
import time

MAX_HEADER = 1 << 20
_LEN = struct.Struct(">I")
_TIMEVAL = struct.Struct("@ll")  # struct timeval (Linux)
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


def frame(obj: dict) -> bytes:
    """A message as it goes on the wire: its length, then its JSON."""
    data = json.dumps(obj).encode()
    return _LEN.pack(len(data)) + data


def send_msg(sock: socket.socket, obj: dict) -> None:
    sock.sendall(frame(obj))


def recv_msg(sock: socket.socket, deadline: float | None) -> dict:
    head = bytearray(_LEN.size)
    recv_exact(sock, memoryview(head), deadline)
    (size,) = _LEN.unpack(head)
    if size > MAX_HEADER:
        raise ValueError(f"message of {size} bytes is larger than {MAX_HEADER}")
    body = bytearray(size)
    recv_exact(sock, memoryview(body), deadline)
    obj = json.loads(body)
    if not isinstance(obj, dict):
        raise ValueError("message is not a JSON object")
    return obj


def _arm(sock: socket.socket, deadline: float | None) -> None:
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("deadline passed")
        sock.settimeout(left)


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    got = 0
    while got < len(view):
        _arm(sock, deadline)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"connection closed after {got} of {len(view)} bytes")
        got += n


def send_views(sock: socket.socket, views: list[memoryview]) -> int:
    """Send every byte of `views`, in order (at most IOV_MAX buffers per call); returns the byte count. The
    socket's own timeout bounds each call."""
    pending = [v for v in views if len(v)]
    total = sum(len(v) for v in pending)
    i = 0
    while i < len(pending):
        n = sock.sendmsg(pending[i : i + IOV_MAX])
        i = _advance(pending, i, n)
    return total


def blocking(sock: socket.socket, seconds: float | None, option: int) -> None:
    """Blocking mode with the kernel's own timeout (SO_RCVTIMEO or SO_SNDTIMEO; None: none): a blocking call
    moves all it was given in one syscall (MSG_WAITALL, a whole sendmsg) instead of a poll and a partial move
    per wakeup."""
    if seconds is not None and seconds <= 0:
        raise socket.timeout("deadline passed")
    sock.settimeout(None)
    seconds = seconds or 0.0  # NOTE: a zero timeval is "no timeout" to the kernel
    sock.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(int(seconds), int(seconds % 1 * 1e6)))


def recv_views(sock: socket.socket, views: list[memoryview], deadline: float | None) -> int:
    """Fill every byte of `views`, in order, from the socket (scatter reads, IOV_MAX buffers per call, each
    waiting for all its bytes); ConnectionError if the peer closes first, socket.timeout past the deadline.
    Leaves the socket blocking (the next recv_msg sets its timeout again)."""
    pending = [v for v in views if len(v)]
    total = sum(len(v) for v in pending)
    got, i = 0, 0
    while i < len(pending):
        blocking(sock, None if deadline is None else deadline - time.monotonic(), socket.SO_RCVTIMEO)
        try:
            n = sock.recvmsg_into(pending[i : i + IOV_MAX], 0, socket.MSG_WAITALL)[0]
        except BlockingIOError as e:  # SO_RCVTIMEO passed with nothing received
            raise socket.timeout("deadline passed") from e
        if n == 0:
            raise ConnectionError(f"connection closed after {got} of {total} bytes")
        got += n
        i = _advance(pending, i, n)
    return total


def _advance(pending: list[memoryview], i: int, n: int) -> int:
    """Consume n bytes from pending[i:]; returns the index of the first buffer not yet complete."""
    while n:
        size = len(pending[i])
        if n >= size:
            n -= size
            i += 1
        else:
            pending[i] = pending[i][n:]
            n = 0
    return i
