"""The NIXL KV connector: the TCP connector's control plane (token, leases, layout check, peers, acks) with the block
bytes moved by NIXL, the decode worker READing the prefill worker's registered pool straight into its own (one-sided;
UCX over shared memory/TCP on one host, RDMA between GPU nodes); the server builds it for `--kv-connector nixl`.

  pull {..., "nixl": {"agent"}}                              the puller asks for a NIXL read
    -> {"ok": true, "nbytes", "tensors", "nixl": {"agent", "metadata" (base64), "regions": [[address, pool
        blocks] per tensor in wire order], "block_ids"}}     where the leased blocks lie
    the puller READs, then {"op": "done", "ok"} -> {"ok": true}; the lease stays pinned until then.
A pull frame without "nixl" (a TCP decode worker) is answered with the bytes on the socket, as TcpKVConnector
does, and this side pulls from TCP endpoints the same way: the two connectors interoperate in one pool.

NOTE: NIXL's Python agent runs its progress thread without pause (about half a core each, FACTS.md), so it is
off here: the puller drives progress by polling its transfer, and the serving side polls its agent while a
pull it answered is open (UCX over TCP emulates a one-sided read with messages the target must answer).
The data plane trusts whoever holds the agent metadata, which only token-checked pullers receive; the
blocks they read are the leased ones, pinned until their "done".
"""

from __future__ import annotations

import base64
import importlib
import logging
import select
import socket
import threading
import time
import uuid

import torch

from pdfleet_worker.kv_transfer import blocks
from pdfleet_worker.kv_transfer import connector as c
from pdfleet_worker.kv_transfer.blocks import KVPool, WireTensor
from pdfleet_worker.kv_transfer.connector import ExportFn, KVTransferError, PulledKV
from pdfleet_worker.kv_transfer.lease import Lease, LeaseTable
from pdfleet_worker.kv_transfer.params import KVTransferParams
from pdfleet_worker.kv_transfer.tcp import TcpKVConnector
from pdfleet_worker.kv_transfer.wire import recv_msg, send_msg

log = logging.getLogger("pdfleet.kv")

PACKAGE = "nixl-cu12"  # what `pip install` needs here (the `nixl` meta package also pulls the CUDA 13 build)
PROGRESS_S = 0.0002  # the serving side's poll of its agent while a NIXL pull is open
POLL_S = 0.0001  # the puller's poll of its transfer


def load_api():
    """NIXL's Python API module: `nixl._api` (the meta package, which picks the CUDA build) or `nixl_cu12._api`.
    RuntimeError naming the package when neither imports."""
    errors = []
    raise_exc = logging.raiseExceptions
    try:
        for name in ("nixl._api", "nixl_cu12._api"):
            try:
                api = importlib.import_module(name)
            except ImportError as e:
                errors.append(f"{name}: {e}")
                continue
            nixl_log = logging.getLogger("nixl")
            if nixl_log.level in (logging.NOTSET, logging.INFO):
                nixl_log.setLevel(logging.WARNING)  # NOTE: NIXL logs each agent's start at INFO on stdout
            return api
    finally:
        logging.raiseExceptions = raise_exc  # NOTE: importing NIXL's logging turns this process-wide flag off
    raise RuntimeError(
        f"--kv-connector nixl needs NIXL's Python package, which this environment lacks "
        f"(pip install {PACKAGE}; {'; '.join(errors)})"
    )


class NixlKVConnector(TcpKVConnector):
    name = "nixl"
    pulls_from = frozenset({"tcp", "nixl"})

    def __init__(self, host: str = "0.0.0.0", port: int = 0, **kw):
        api = load_api()  # first: a worker without NIXL fails here, at start, with the package's name
        super().__init__(host, port, **kw)
        conf = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=["UCX"],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.agent = api.nixl_agent(f"pdfleet-{uuid.uuid4().hex[:16]}", conf)
        if "UCX" not in self.agent.backends:
            raise RuntimeError(f"NIXL has no UCX backend here (plugins: {self.agent.plugin_list})")
        self._nixl_lock = threading.Lock()
        self._registered: dict[int, tuple[KVPool, object]] = {}  # id(pool) -> (pool, its registration)
        self._remotes: set[str] = set()  # remote agents whose metadata is loaded
        self._served: KVPool | None = None

    # -- registration ---------------------------------------------------------------------------
    def _register(self, pool: KVPool) -> None:
        with self._nixl_lock:
            if id(pool) not in self._registered:
                self._registered[id(pool)] = (pool, self.agent.register_memory(pool.tensors()))

    def _load_remote(self, name: str, metadata: bytes) -> None:
        with self._nixl_lock:
            if name not in self._remotes:
                loaded = self.agent.add_remote_agent(metadata)
                if isinstance(loaded, bytes):
                    loaded = loaded.decode()
                if loaded != name:
                    raise ValueError(f"NIXL metadata names agent {loaded!r}, the answer {name!r}")
                self._remotes.add(name)

    # -- prefill side ---------------------------------------------------------------------------
    def serve(self, leases: LeaseTable, source: KVPool | ExportFn, compat_hash: str) -> tuple[str, int]:
        if isinstance(source, KVPool):
            self._register(source)
            self._served = source
        else:
            log.warning("NIXL connector serving copies (no pool to register): pulls move over the socket")
        return super().serve(leases, source, compat_hash)

    def _answer_blocks(self, conn: socket.socket, msg: dict, lease: Lease, block_ids: list[int]) -> int | None:
        if not isinstance(msg.get("nixl"), dict) or self._served is None:
            return super()._answer_blocks(conn, msg, lease, block_ids)
        pool = self._served
        specs = pool.wire(len(block_ids))
        nbytes = sum(s.nbytes for s in specs)
        send_msg(
            conn,
            {
                "ok": True,
                "nbytes": nbytes,
                "tensors": [s.to_json() for s in specs],
                "nixl": {
                    "agent": self.agent.name,
                    "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                    "regions": [list(r) for r in pool.regions()],
                    "block_ids": list(block_ids),
                    "memory": _memory(pool.device),
                },
            },
        )
        done = self._await_done(conn)
        send_msg(conn, {"ok": True})
        if not done.get("ok"):
            return None
        self._moved("nixl")
        return nbytes

    def _await_done(self, conn: socket.socket) -> dict:
        """Progress the agent until the puller says its read ended (or the I/O timeout passes)."""
        deadline = time.monotonic() + self.io_timeout_s
        while True:
            readable, _, _ = select.select([conn], [], [], PROGRESS_S)
            if readable:
                msg = recv_msg(conn, deadline)
                if msg.get("op") != "done":
                    raise ValueError(f"expected the puller's done, got {msg.get('op')!r}")
                return msg
            if time.monotonic() > deadline:
                raise socket.timeout("the puller never said its NIXL read ended")
            self.agent.get_new_notifs()  # NOTE: drives UCX progress; nothing is sent as a notification

    # -- decode side ----------------------------------------------------------------------------
    def _pull_extra(self, params: KVTransferParams) -> dict:
        return {"nixl": {"agent": self.agent.name}} if params.connector == "nixl" else {}

    def _prepare(self, params: KVTransferParams, dest_block_ids: list[int], into: KVPool | None):
        return None if params.connector == "nixl" else super()._prepare(params, dest_block_ids, into)

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
        info = head.get("nixl")
        if info is None:
            if plan is None:  # asked for a NIXL read, answered with bytes: views now
                plan = self._views(dest_block_ids, into)
            return super()._receive_blocks(sock, head, specs, nbytes, dest_block_ids, into, plan, deadline)
        remote, remote_ids, remote_memory = self._remote_side(info, specs, len(dest_block_ids))
        staged = None
        if into is not None:
            self._register(into)
            local = [(t.data_ptr(), tuple(t.shape), t.element_size()) for t in into.tensors()]
            local_ids, device = list(dest_block_ids), into.device
        else:
            staged = torch.empty(nbytes, dtype=torch.uint8)
            local, off = [], staged.data_ptr()
            for s in specs:
                local.append((off, s.shape, torch.empty(0, dtype=s.dtype).element_size()))
                off += s.nbytes
            local_ids, device = list(range(len(dest_block_ids))), staged.device
        registration = self.agent.register_memory([staged]) if staged is not None else None
        ok = False
        try:
            self._read(
                (local, local_ids, _memory(device)), (remote, remote_ids, remote_memory), info["agent"], deadline
            )
            ok = True
        finally:
            if registration is not None:
                self.agent.deregister_memory(registration)
            try:
                send_msg(sock, {"op": "done", "ok": ok})
                recv_msg(sock, deadline)
            except (OSError, ValueError):
                if ok:
                    raise
        self._moved("nixl")
        if staged is not None:
            return PulledKV(self._tensors(staged, specs), nbytes)
        return PulledKV(None, nbytes, in_place=True)

    def _remote_side(self, info: object, specs: list[WireTensor], n: int) -> tuple[list, list[int], tuple[str, int]]:
        """The prefill side's tensors as (address, pool shape, element size), its block ids and memory (kind,
        device); loads its agent."""
        if not isinstance(info, dict):
            raise ValueError(f"malformed NIXL answer {info!r}")
        name, metadata, regions, ids, memory = (
            info.get(k) for k in ("agent", "metadata", "regions", "block_ids", "memory")
        )
        if not (
            isinstance(memory, list)
            and len(memory) == 2
            and memory[0] in ("DRAM", "VRAM")
            and isinstance(memory[1], int)
        ):
            raise ValueError(f"malformed NIXL answer: memory {memory!r}")
        if not (
            isinstance(name, str)
            and isinstance(metadata, str)
            and isinstance(regions, list)
            and len(regions) == len(specs)
            and isinstance(ids, list)
            and len(ids) == n
            and all(isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r) for r in regions)
            and all(isinstance(b, int) and 0 <= b for b in ids)
        ):
            raise ValueError(f"malformed NIXL answer (agent, metadata, {len(specs)} regions, {n} block ids expected)")
        if any(b >= blocks_ for (_, blocks_) in regions for b in ids):
            raise ValueError("NIXL answer names blocks past its pool")
        self._load_remote(name, base64.b64decode(metadata))
        remote = [
            (addr, (*s.shape[:2], pool_blocks, *s.shape[3:]), torch.empty(0, dtype=s.dtype).element_size())
            for s, (addr, pool_blocks) in zip(specs, regions)
        ]
        return remote, ids, (memory[0], memory[1])

    def _read(self, local: tuple, remote: tuple, agent: str, deadline: float) -> None:
        """One NIXL READ of every segment; `local` and `remote` are (tensors as (address, pool shape, element
        size), block ids, (memory kind, device)). Returns when it is done, raises when it failed; nothing
        writes into the local side after either."""
        import numpy as np  # NOTE: NIXL's own dependency; the worker image has numpy only with NIXL

        starts, lengths = blocks.runs(local[1], remote[1])

        def descs(side: tuple, first: torch.Tensor):
            addrs = blocks.address_list(side[0], first, lengths)
            arr = np.empty((addrs.shape[0], 3), dtype=np.uint64)
            arr[:, :2] = addrs.numpy()
            arr[:, 2] = side[2][1]
            return self.agent.get_xfer_descs(arr, side[2][0])

        handle = self.agent.initialize_xfer("READ", descs(local, starts[0]), descs(remote, starts[1]), agent)
        try:
            state = self.agent.transfer(handle)
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise socket.timeout("NIXL read did not finish in time")
                time.sleep(POLL_S)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise KVTransferError(c.PEER_CLOSED, f"NIXL read from agent {agent} failed ({state})")
        finally:
            self._release(handle)

    def _release(self, handle) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:
            # NOTE: a read still in flight that UCX cannot cancel: wait for it to end, so that nothing lands
            # in blocks the engine may already have handed to another request.
            log.warning("NIXL could not cancel a read in flight; waiting for it to end")
            while self.agent.check_xfer_state(handle) == "PROC":
                time.sleep(0.01)
            self.agent.release_xfer_handle(handle)


def _memory(device: torch.device) -> list:
    """NIXL's memory kind and device id of a pool on `device`."""
    return ["DRAM", 0] if device.type == "cpu" else ["VRAM", device.index or 0]
