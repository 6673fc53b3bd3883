"""The TCP KV connector: a prefill worker serves leased blocks on a socket straight from its pool, a decode worker
receives them straight into the destination blocks; the server starts it, the NIXL connector extends it.

Wire format: every message is a 4-byte big-endian length and a JSON object (wire.py); a successful pull
answer is followed by the raw bytes of its tensors, layer by layer, in the order its header lists.
  pull    {"op": "pull", "token", "request_id", "compat_hash", "first_block", "num_blocks"}
          -> {"ok": true, "nbytes", "tensors": [{"layer", "name", "dtype", "shape"}...]} + bytes
          |  {"ok": false, "reason", "error"}
  release {"op": "release", "token", "request_id", "ok"} -> {"ok": true, "released": bool}
The bytes leave with sendmsg over views of the pool's block tensors (a run of consecutive blocks is one
segment per k/v head row, blocks.py), the header and all layers in one call of up to IOV_MAX buffers, and
arrive with recvmsg_into straight into views of the destination blocks, all layers in one call waiting for
every byte: neither side copies or gathers in Python, and a pull costs each side a few syscalls and one
wakeup, as a raw socket copy does (bench/pd.py compares them). Only a range too fragmented for views goes
layer by layer (gathered into a copy on the way out, scattered from one on the way in).
With a deployment token configured, every request frame must carry it in `token` (compared in constant
time); anything else is answered {"ok": false, "reason": "unauthorized"} and the connection closed. The
pulling side connects only to KV endpoints its peers allow (--kv-peers), so the token goes nowhere else;
mid-rotation it retries once, on a new connection, with the token the file held before.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time

import torch

from pdfleet_worker.kv_transfer import blocks
from pdfleet_worker.kv_transfer import connector as c
from pdfleet_worker.kv_transfer.blocks import KVPool, WireTensor
from pdfleet_worker.kv_transfer.connector import ExportFn, KVConnector, KVTransferError, PulledKV
from pdfleet_worker.kv_transfer.idle import IdleConnections
from pdfleet_worker.kv_transfer.lease import Lease, LeaseTable
from pdfleet_worker.kv_transfer.params import KVTransferParams, RemotePrompt
from pdfleet_worker.kv_transfer.peers import KVPeers
from pdfleet_worker.kv_transfer.wire import blocking, frame, recv_msg, recv_views, send_msg, send_views

log = logging.getLogger("pdfleet.kv")

# close() waits this long for the threads answering pulls: one may be copying blocks out (torch) when the
# sockets close, and a process that exits under it aborts (server/runner.py).
CLOSE_JOIN_S = 5.0
# An ack waits this long for pulls still reading its lease before it is answered (it frees the blocks anyway).
RELEASE_WAIT_S = 1.0


class TcpKVConnector(KVConnector):
    name = "tcp"
    # NOTE: a NIXL endpoint answers byte-stream pulls too, so a TCP decode worker pulls from either.
    pulls_from = frozenset({"tcp", "nixl"})

    def __init__(
        self,
        host: str = "0.0.0.0",
        port: int = 0,
        *,
        on_sent=None,
        on_refused=None,
        io_timeout_s: float = 30.0,
        token: c.Credential | None = None,
        peers: KVPeers | None = None,
    ):
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
        self.transfers: collections.Counter[str] = collections.Counter()  # pulls answered/done, by how bytes moved
        self._idle = IdleConnections()  # decode side: connections kept between pulls

    # -- prefill side ---------------------------------------------------------------------------
    def serve(self, leases: LeaseTable, source: KVPool | ExportFn, compat_hash: str) -> tuple[str, int]:
        assert self._listener is None, "already serving"
        self._leases, self._source, self._compat_hash = leases, blocks.source(source), compat_hash
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

    def _moved(self, path: str) -> None:
        with self._lock:
            self.transfers[path] += 1

    def moved(self) -> dict[str, int]:
        with self._lock:
            return dict(self.transfers)

    def running_threads(self) -> list[str]:
        """Names of this connector's threads still alive (after close: those that outlived CLOSE_JOIN_S)."""
        with self._lock:
            return sorted(t.name for t in self._threads if t.is_alive())

    def close(self) -> None:
        """Stop accepting, cut open connections, and wait (CLOSE_JOIN_S at most) for their threads to end."""
        self._idle.close()
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
                    msg = recv_msg(conn, None)
                except (ConnectionError, socket.timeout, OSError):
                    return
                op = msg.get("op")
                if self.token is not None and not self.token.accepts(_token_of(msg)):
                    log.warning(
                        "KV %s refused: %s token from %s",
                        op if isinstance(op, str) else "request",
                        "no" if msg.get("token") is None else "a wrong",
                        _peer_name(conn),
                    )
                    if self.on_refused is not None:
                        self.on_refused(c.UNAUTHORIZED)
                    send_msg(
                        conn,
                        {"ok": False, "reason": c.UNAUTHORIZED, "error": "the KV endpoint needs the deployment token"},
                    )
                    return
                if op == "pull":
                    self._answer_pull(conn, msg)
                elif op == "release":
                    rid = str(msg.get("request_id"))
                    released = self._leases.release(rid)
                    if released:  # NOTE: a pull that delivered its bytes may not have unpinned yet (threads)
                        self._leases.wait_unpinned(rid, RELEASE_WAIT_S)
                    send_msg(conn, {"ok": True, "released": released})
                else:
                    send_msg(conn, {"ok": False, "reason": c.BAD_RESPONSE, "error": f"unknown op {op!r}"})
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
            send_msg(
                conn,
                {
                    "ok": False,
                    "reason": c.INCOMPATIBLE,
                    "error": f"KV layout mismatch: this prefill engine has compat hash {self._compat_hash}, "
                    f"the puller has {theirs} (model, dtype, KV dtype, layers, KV heads, head dim "
                    f"or block size differ); refusing to send blocks",
                },
            )
            return
        lease = self._leases.pin(rid)
        if lease is None:
            send_msg(
                conn,
                {
                    "ok": False,
                    "reason": c.UNKNOWN_REQUEST,
                    "error": f"no KV held for request {rid!r} (lease expired, released or never held)",
                },
            )
            return
        try:
            first, n = msg.get("first_block"), msg.get("num_blocks")
            if not (
                isinstance(first, int)
                and isinstance(n, int)
                and first >= 0
                and n >= 1
                and first + n <= len(lease.block_ids)
            ):
                send_msg(
                    conn,
                    {
                        "ok": False,
                        "reason": c.BAD_RESPONSE,
                        "error": f"block range {first}+{n} is outside the {len(lease.block_ids)} held blocks",
                    },
                )
                return
            # NOTE: read outside the engine thread on purpose. Held blocks are finished and
            # referenced, so nothing writes them; the pin keeps them from being freed under us.
            nbytes = self._answer_blocks(conn, msg, lease, lease.block_ids[first : first + n])
            if nbytes is not None and self.on_sent is not None:
                self.on_sent(nbytes)
        finally:
            self._leases.unpin(rid)

    def _answer_blocks(self, conn: socket.socket, msg: dict, lease: Lease, block_ids: list[int]) -> int | None:
        """Send the blocks after their header; returns the bytes delivered (None: none were)."""
        specs, layers = blocks.header_and_layers(self._source, block_ids)
        nbytes = sum(s.nbytes for s in specs)
        blocking(conn, self.io_timeout_s, socket.SO_SNDTIMEO)  # NOTE: _serve_conn sets its timeout back
        head = frame({"ok": True, "nbytes": nbytes, "tensors": [s.to_json() for s in specs]})
        # NOTE: the header and every layer whose views are ready go out in one sendmsg (IOV_MAX buffers a
        # call); a layer that needs a gathered copy first sends what is pending, so earlier layers are on the
        # wire while it is copied.
        pending: list[memoryview] = [memoryview(head)]
        for layer in layers:
            if callable(layer):
                send_views(conn, pending)
                pending = []
            pending += blocks.ready(layer)
        send_views(conn, pending)
        self._moved("tcp")
        return nbytes

    # -- decode side ----------------------------------------------------------------------------
    def _connect(self, params: KVTransferParams, deadline: float) -> socket.socket:
        """A new connection to an endpoint _exchange found trusted."""
        try:
            sock = socket.create_connection((params.host, params.port), timeout=max(deadline - time.monotonic(), 0.001))
        except socket.timeout as e:
            raise KVTransferError(c.TIMEOUT, f"connecting to {params.host}:{params.port} timed out") from e
        except OSError as e:
            raise KVTransferError(
                c.CONNECT, f"cannot connect to the prefill worker's KV endpoint {params.host}:{params.port}: {e}"
            ) from e
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _ask(self, params: KVTransferParams, frame: dict, deadline: float) -> tuple[socket.socket, dict]:
        """Send `frame` with our token, read the answer's header; the caller closes the socket or hands it back
        (_done). Refused as unauthorized while a rotated-out token is still valid: once more with that one."""
        tokens: list[str | None] = list(self.token.for_sending()) if self.token is not None else []
        for i, token in enumerate(tokens or [None]):
            sock, head = self._exchange(params, frame if token is None else {**frame, "token": token}, deadline)
            if head.get("reason") == c.UNAUTHORIZED and i + 1 < len(tokens):
                sock.close()
                continue
            return sock, head
        raise AssertionError("unreachable: the last try returns")

    def _exchange(self, params: KVTransferParams, frame: dict, deadline: float) -> tuple[socket.socket, dict]:
        """On an idle connection to the endpoint if one is kept (again on a new one if the endpoint had closed
        it), else on a new connection."""
        if not self.trusts(params.host, params.port):  # NOTE: again for a kept connection: --kv-peers may change
            raise KVTransferError(
                c.UNTRUSTED_PEER,
                f"KV endpoint {params.host}:{params.port} is not among this "
                f"worker's --kv-peers ({self.peers}); not contacted",
            )
        sock = self._idle.take((params.host, params.port))
        if sock is not None:
            try:
                return sock, self._send_and_read(sock, frame, deadline)
            except ConnectionError:
                sock.close()  # closed while idle (the endpoint's io timeout, a restart): a new connection
            except BaseException:
                sock.close()
                raise
        sock = self._connect(params, deadline)
        try:
            return sock, self._send_and_read(sock, frame, deadline)
        except BaseException:
            sock.close()
            raise

    @staticmethod
    def _send_and_read(sock: socket.socket, frame: dict, deadline: float) -> dict:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        send_msg(sock, frame)
        return recv_msg(sock, deadline)

    def _done(self, params: KVTransferParams, sock: socket.socket) -> None:
        """An exchange ended at a message boundary: keep the connection for the next one."""
        self._idle.give((params.host, params.port), sock)

    def pull(
        self,
        params: KVTransferParams,
        prompt: RemotePrompt,
        first_block: int,
        dest_block_ids: list[int],
        compat_hash: str,
        timeout_s: float,
        into: KVPool | None = None,
    ) -> PulledKV:
        deadline = time.monotonic() + timeout_s
        n = len(dest_block_ids)
        if params.connector not in self.pulls_from:
            raise KVTransferError(
                c.UNSUPPORTED,
                f"KV connector {params.connector!r} is not one this worker pulls from "
                f"({', '.join(sorted(self.pulls_from))})",
            )
        sock = None
        try:
            plan = self._prepare(params, dest_block_ids, into)
            frame = {
                "op": "pull",
                "request_id": prompt.request_id,
                "compat_hash": compat_hash,
                "first_block": first_block,
                "num_blocks": n,
                **self._pull_extra(params),
            }
            sock, head = self._ask(params, frame, deadline)
            if not head.get("ok"):
                raise KVTransferError(str(head.get("reason", c.BAD_RESPONSE)), str(head.get("error", head)))
            specs = blocks.parse_header(head.get("tensors"), n)
            nbytes = head.get("nbytes")
            if not isinstance(nbytes, int) or nbytes != sum(s.nbytes for s in specs):
                raise KVTransferError(c.BAD_RESPONSE, f"malformed pull answer {head}")
            if into is not None:
                into.check(specs)
            pulled = self._receive_blocks(sock, head, specs, nbytes, dest_block_ids, into, plan, deadline)
            self._done(params, sock)
            sock = None
            return pulled
        except KVTransferError:
            raise
        except socket.timeout as e:
            raise KVTransferError(
                c.TIMEOUT, f"KV pull from {params.host}:{params.port} did not finish within {timeout_s:g}s"
            ) from e
        except (ConnectionError, OSError) as e:
            raise KVTransferError(c.PEER_CLOSED, f"KV pull from {params.host}:{params.port} broke: {e}") from e
        except ValueError as e:
            raise KVTransferError(c.BAD_RESPONSE, f"KV pull from {params.host}:{params.port}: {e}") from e
        finally:
            if sock is not None:
                sock.close()

    def _pull_extra(self, params: KVTransferParams) -> dict:
        """Fields a subclass adds to the pull frame (how it wants the bytes)."""
        return {}

    def _prepare(self, params: KVTransferParams, dest_block_ids: list[int], into: KVPool | None):
        """What receiving needs, made before the pull is asked for: the destination blocks' views."""
        return self._views(dest_block_ids, into)

    @staticmethod
    def _views(dest_block_ids: list[int], into: KVPool | None):
        return into.recv_layers(dest_block_ids) if into is not None and into.host else None

    def _receive_blocks(
        self,
        sock: socket.socket,
        head: dict,
        specs: list[WireTensor],
        nbytes: int,
        dest_block_ids: list[int],
        into: KVPool | None,
        plan,
        deadline: float,
    ) -> PulledKV:
        if plan is not None:
            # NOTE: consecutive layers landing in place are one scatter read (IOV_MAX buffers a call); a staged
            # layer ends the read so that its copy goes into its blocks before the next layer is read.
            pending: list[memoryview] = []
            for views, scatter in plan:
                pending += views
                if scatter is not None:
                    recv_views(sock, pending, deadline)
                    scatter()
                    pending = []
            recv_views(sock, pending, deadline)
            self._moved("tcp")
            return PulledKV(None, nbytes, in_place=True)
        # NOTE: torch.empty, not bytearray: no zero-filling of a buffer about to be overwritten.
        buf = torch.empty(nbytes, dtype=torch.uint8)
        recv_views(sock, [blocks.byte_view(buf)], deadline)  # NOTE: one call waiting for every byte
        self._moved("tcp")
        return PulledKV(self._tensors(buf, specs), nbytes)

    @staticmethod
    def _tensors(flat: torch.Tensor, specs: list[WireTensor]) -> list[dict[str, torch.Tensor]]:
        layers: list[dict[str, torch.Tensor]] = []
        off = 0
        for spec in specs:
            if spec.layer == len(layers):
                layers.append({})
            size = spec.nbytes
            layers[-1][spec.name] = flat[off : off + size].view(spec.dtype).view(spec.shape)
            off += size
        return layers

    def release(self, params: KVTransferParams, prompt: RemotePrompt, ok: bool, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        sock = None
        try:
            sock, head = self._ask(params, {"op": "release", "request_id": prompt.request_id, "ok": ok}, deadline)
            if head.get("reason") == c.UNAUTHORIZED:
                raise KVTransferError(c.UNAUTHORIZED, str(head.get("error", head)))
            self._done(params, sock)
            sock = None
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
