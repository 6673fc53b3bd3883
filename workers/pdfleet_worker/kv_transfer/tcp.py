"""The TCP KV connector: a prefill worker serves leased blocks on a socket, a decode worker pulls them into host tensors; the server starts it.

Wire format: every message is a 4-byte big-endian length and a JSON object; a successful pull
answer is followed by the raw bytes of its tensors, layer by layer, in the order its header lists.
  pull    {"op": "pull", "token", "request_id", "compat_hash", "first_block", "num_blocks"}
          -> {"ok": true, "nbytes", "tensors": [{"layer", "name", "dtype", "shape"}...]} + bytes
          |  {"ok": false, "reason", "error"}
  release {"op": "release", "token", "request_id", "ok"} -> {"ok": true, "released": bool}
With a deployment token configured, every request frame must carry it in `token` (compared in constant
time); anything else is answered {"ok": false, "reason": "unauthorized"} and the connection closed. The
pulling side connects only to KV endpoints its peers allow (--kv-peers), so the token goes nowhere else;
mid-rotation it retries once, on a new connection, with the token the file held before.
"""
from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time

import torch

from pdfleet_worker.kv_transfer import connector as c
from pdfleet_worker.kv_transfer.connector import ExportFn, KVConnector, KVTransferError, PulledKV
from pdfleet_worker.kv_transfer.lease import LeaseTable
from pdfleet_worker.kv_transfer.params import KVTransferParams, RemotePrompt
from pdfleet_worker.kv_transfer.peers import KVPeers

log = logging.getLogger("pdfleet.kv")

MAX_HEADER = 1 << 20
# close() waits this long for the threads answering pulls: one may be copying blocks out (torch) when the
# sockets close, and a process that exits under it aborts (server/runner.py).
CLOSE_JOIN_S = 5.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_LEN = struct.Struct(">I")


def _send_msg(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("deadline passed")
            sock.settimeout(left)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"connection closed after {got} of {len(view)} bytes")
        got += n


def _recv_msg(sock: socket.socket, deadline: float | None) -> dict:
    head = bytearray(_LEN.size)
    _recv_exact(sock, memoryview(head), deadline)
    (size,) = _LEN.unpack(head)
    if size > MAX_HEADER:
        raise ValueError(f"message of {size} bytes is larger than {MAX_HEADER}")
    body = bytearray(size)
    _recv_exact(sock, memoryview(body), deadline)
    obj = json.loads(body)
    if not isinstance(obj, dict):
        raise ValueError("message is not a JSON object")
    return obj


class TcpKVConnector(KVConnector):
    name = "tcp"

    def __init__(self, host: str = "0.0.0.0", port: int = 0, *, on_sent=None, on_refused=None,
                 io_timeout_s: float = 30.0, token: c.Credential | None = None, peers: KVPeers | None = None):
        assert token is None or peers is not None, "a token is sent only to --kv-peers: give the peers"
        self.host = host
        self.port = port
        self.on_sent = on_sent  # called with the byte count of each pull answered
        self.on_refused = on_refused  # called with the reason of each request refused unauthenticated
        self.io_timeout_s = io_timeout_s
        self.token = token
        self.peers = peers
        self._listener: socket.socket | None = None
        self._threads: set[threading.Thread] = set()  # the accept loop and one per open connection
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()

    # -- prefill side ---------------------------------------------------------------------------
    def serve(self, leases: LeaseTable, export: ExportFn, compat_hash: str) -> tuple[str, int]:
        assert self._listener is None, "already serving"
        self._leases, self._export, self._compat_hash = leases, export, compat_hash
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(64)
        self._listener = sock
        self._start_thread(self._accept_loop, (), "kv-accept")
        return sock.getsockname()[:2]

    def _start_thread(self, target, args: tuple, name: str) -> None:
        def run() -> None:
            try:
                target(*args)
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())
        t = threading.Thread(target=run, name=name, daemon=True)
        with self._lock:
            self._threads.add(t)
        t.start()

    def running_threads(self) -> list[str]:
        """Names of this connector's threads still alive (after close: those that outlived CLOSE_JOIN_S)."""
        with self._lock:
            return sorted(t.name for t in self._threads if t.is_alive())

    def close(self) -> None:
        """Stop accepting, cut open connections, and wait (CLOSE_JOIN_S at most) for their threads to end."""
        with self._lock:  # the accept loop registers a connection under the lock, or sees this and drops it
            self._closed.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + CLOSE_JOIN_S
        with self._lock:
            threads = [t for t in self._threads if t is not threading.current_thread()]
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed.is_set():
                    conn.close()
                    return
                self._conns.add(conn)
            self._start_thread(self._serve_conn, (conn,), "kv-conn")

    def _serve_conn(self, conn: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                conn.settimeout(self.io_timeout_s)
                try:
                    msg = _recv_msg(conn, None)
                except (ConnectionError, socket.timeout, OSError):
                    return
                op = msg.get("op")
                if self.token is not None and not self.token.accepts(_token_of(msg)):
                    log.warning("KV %s refused: %s token from %s", op if isinstance(op, str) else "request",
                                "no" if msg.get("token") is None else "a wrong", _peer_name(conn))
                    if self.on_refused is not None:
                        self.on_refused(c.UNAUTHORIZED)
                    _send_msg(conn, {"ok": False, "reason": c.UNAUTHORIZED,
                                     "error": "the KV endpoint needs the deployment token"})
                    return
                if op == "pull":
                    self._answer_pull(conn, msg)
                elif op == "release":
                    rid = str(msg.get("request_id"))
                    _send_msg(conn, {"ok": True, "released": self._leases.release(rid)})
                else:
                    _send_msg(conn, {"ok": False, "reason": c.BAD_RESPONSE, "error": f"unknown op {op!r}"})
        except (OSError, ValueError) as e:
            log.info("KV connection ended: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _answer_pull(self, conn: socket.socket, msg: dict) -> None:
        rid = str(msg.get("request_id"))
        theirs = msg.get("compat_hash")
        if theirs != self._compat_hash:
            _send_msg(conn, {"ok": False, "reason": c.INCOMPATIBLE,
                             "error": f"KV layout mismatch: this prefill engine has compat hash {self._compat_hash}, "
                                      f"the puller has {theirs} (model, dtype, KV dtype, layers, KV heads, head dim "
                                      f"or block size differ); refusing to send blocks"})
            return
        lease = self._leases.pin(rid)
        if lease is None:
            _send_msg(conn, {"ok": False, "reason": c.UNKNOWN_REQUEST,
                             "error": f"no KV held for request {rid!r} (lease expired, released or never held)"})
            return
        try:
            first, n = msg.get("first_block"), msg.get("num_blocks")
            if not (isinstance(first, int) and isinstance(n, int) and first >= 0 and n >= 1
                    and first + n <= len(lease.block_ids)):
                _send_msg(conn, {"ok": False, "reason": c.BAD_RESPONSE,
                                 "error": f"block range {first}+{n} is outside the {len(lease.block_ids)} held blocks"})
                return
            # NOTE: read outside the engine thread on purpose. Held blocks are finished and
            # referenced, so nothing writes them; the pin keeps them from being freed under us.
            layers = self._export(lease.block_ids[first:first + n])
            tensors, header = [], []
            for i, layer in enumerate(layers):
                for name in sorted(layer):
                    t = layer[name].contiguous()
                    tensors.append(t)
                    header.append({"layer": i, "name": name, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape)})
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            _send_msg(conn, {"ok": True, "nbytes": nbytes, "tensors": header})
            for t in tensors:
                conn.sendall(memoryview(t.view(torch.uint8).numpy()))
            if self.on_sent is not None:
                self.on_sent(nbytes)
        finally:
            self._leases.unpin(rid)

    # -- decode side ----------------------------------------------------------------------------
    def _connect(self, params: KVTransferParams, deadline: float) -> socket.socket:
        if not self.trusts(params.host, params.port):
            raise KVTransferError(c.UNTRUSTED_PEER, f"KV endpoint {params.host}:{params.port} is not among this "
                                                    f"worker's --kv-peers ({self.peers}); not contacted")
        try:
            sock = socket.create_connection((params.host, params.port), timeout=max(deadline - time.monotonic(), 0.001))
        except socket.timeout as e:
            raise KVTransferError(c.TIMEOUT, f"connecting to {params.host}:{params.port} timed out") from e
        except OSError as e:
            raise KVTransferError(c.CONNECT, f"cannot connect to the prefill worker's KV endpoint "
                                             f"{params.host}:{params.port}: {e}") from e
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _ask(self, params: KVTransferParams, frame: dict, deadline: float) -> tuple[socket.socket, dict]:
        """Connect, send `frame` with our token, read the answer's header; the caller closes the socket.
        Refused as unauthorized while a rotated-out token is still valid: once more with that one."""
        tokens: list[str | None] = list(self.token.for_sending()) if self.token is not None else []
        for i, token in enumerate(tokens or [None]):
            sock = self._connect(params, deadline)
            try:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                _send_msg(sock, frame if token is None else {**frame, "token": token})
                head = _recv_msg(sock, deadline)
            except BaseException:
                sock.close()
                raise
            if head.get("reason") == c.UNAUTHORIZED and i + 1 < len(tokens):
                sock.close()
                continue
            return sock, head
        raise AssertionError("unreachable: the last try returns")

    def pull(self, params: KVTransferParams, prompt: RemotePrompt, first_block: int, dest_block_ids: list[int],
             compat_hash: str, timeout_s: float) -> PulledKV:
        deadline = time.monotonic() + timeout_s
        n = len(dest_block_ids)
        sock = None
        try:
            sock, head = self._ask(params, {"op": "pull", "request_id": prompt.request_id, "compat_hash": compat_hash,
                                            "first_block": first_block, "num_blocks": n}, deadline)
            if not head.get("ok"):
                raise KVTransferError(str(head.get("reason", c.BAD_RESPONSE)), str(head.get("error", head)))
            specs = head.get("tensors")
            nbytes = head.get("nbytes")
            if not isinstance(specs, list) or not isinstance(nbytes, int) or nbytes < 0:
                raise KVTransferError(c.BAD_RESPONSE, f"malformed pull answer {head}")
            # NOTE: torch.empty, not bytearray: no zero-filling of a buffer about to be overwritten.
            buf = torch.empty(nbytes, dtype=torch.uint8)
            _recv_exact(sock, memoryview(buf.numpy()), deadline)
            return PulledKV(self._tensors(buf, specs, n), nbytes)
        except KVTransferError:
            raise
        except socket.timeout as e:
            raise KVTransferError(c.TIMEOUT, f"KV pull from {params.host}:{params.port} did not finish within "
                                             f"{timeout_s:g}s") from e
        except (ConnectionError, OSError) as e:
            raise KVTransferError(c.PEER_CLOSED, f"KV pull from {params.host}:{params.port} broke: {e}") from e
        except ValueError as e:
            raise KVTransferError(c.BAD_RESPONSE, f"KV pull from {params.host}:{params.port}: {e}") from e
        finally:
            if sock is not None:
                sock.close()

    @staticmethod
    def _tensors(flat: torch.Tensor, specs: list, num_blocks: int) -> list[dict[str, torch.Tensor]]:
        layers: list[dict[str, torch.Tensor]] = []
        off = 0
        for spec in specs:
            dtype = DTYPES.get(spec.get("dtype"))
            shape = spec.get("shape")
            layer = spec.get("layer")
            if dtype is None or not isinstance(shape, list) or len(shape) < 3 or shape[2] != num_blocks:
                raise KVTransferError(c.BAD_RESPONSE, f"tensor {spec} does not hold {num_blocks} blocks")
            if layer == len(layers):
                layers.append({})
            elif layer != len(layers) - 1:
                raise KVTransferError(c.BAD_RESPONSE, f"tensor {spec} is out of layer order")
            count = 1
            for d in shape:
                count *= d
            size = count * torch.empty(0, dtype=dtype).element_size()
            if off + size > len(flat):
                raise KVTransferError(c.BAD_RESPONSE, f"{len(flat)} bytes cannot hold tensor {spec}")
            layers[-1][spec["name"]] = flat[off:off + size].view(dtype).view(shape)
            off += size
        if off != len(flat):
            raise KVTransferError(c.BAD_RESPONSE, f"{len(flat) - off} bytes left over after the tensors")
        return layers

    def release(self, params: KVTransferParams, prompt: RemotePrompt, ok: bool, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        sock = None
        try:
            sock, head = self._ask(params, {"op": "release", "request_id": prompt.request_id, "ok": ok}, deadline)
            if head.get("reason") == c.UNAUTHORIZED:
                raise KVTransferError(c.UNAUTHORIZED, str(head.get("error", head)))
            return bool(head.get("released"))
        except KVTransferError:
            raise
        except socket.timeout as e:
            raise KVTransferError(c.TIMEOUT, f"KV release to {params.host}:{params.port} timed out") from e
        except (ConnectionError, OSError, ValueError) as e:
            raise KVTransferError(c.PEER_CLOSED, f"KV release to {params.host}:{params.port} failed: {e}") from e
        finally:
            if sock is not None:
                sock.close()


def _token_of(msg: dict) -> str | None:
    token = msg.get("token")
    return token if isinstance(token, str) else None


def _peer_name(conn: socket.socket) -> str:
    try:
        return "%s:%s" % conn.getpeername()[:2]
    except OSError:
        return "?"
