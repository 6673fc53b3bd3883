"""The KV connector interface (serve leased blocks on the prefill side, pull them on the decode side); the TCP and NIXL
connectors implement it, the server calls it.

A pull either writes straight into the destination blocks of the decode worker's pool (`into`: the server's
path, safe off the engine thread because the engine loop frees an aborted request's blocks only once its pull
has ended) or returns host tensors for LLMEngine.import_kv (no pool given: tools, tests, accelerator pools).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Protocol

import torch

from pdfleet_worker.kv_transfer import blocks
from pdfleet_worker.kv_transfer.blocks import KVPool
from pdfleet_worker.kv_transfer.lease import LeaseTable
from pdfleet_worker.kv_transfer.params import KVTransferParams, RemotePrompt
from pdfleet_worker.kv_transfer.peers import KVPeers

# Failure reasons (the `reason` label of pdfleet_kv_transfer_failures_total).
CONNECT = "connect"  # the prefill worker's KV endpoint did not accept a connection
TIMEOUT = "timeout"  # no complete answer within the transfer timeout
PEER_CLOSED = "peer_closed"  # the connection broke midway (prefill worker died)
INCOMPATIBLE = "incompatible"  # KV layout hashes differ: refused, nothing imported
WEIGHTS_MISMATCH = "weights_mismatch"  # the layouts differ by their weights (another revision): refused, recomputed
UNKNOWN_REQUEST = "unknown_request"  # no lease (expired, released, or never held)
PROMPT_MISMATCH = "prompt_mismatch"  # the decode worker tokenized the prompt differently
BAD_RESPONSE = "bad_response"  # the answer does not fit the request (shapes, sizes, protocol)
UNSUPPORTED = "unsupported"  # a connector this worker does not have (or cannot pull from)
UNAUTHORIZED = "unauthorized"  # the KV endpoint refused the puller's token (or it sent none)
UNTRUSTED_PEER = "untrusted_peer"  # the params name a KV endpoint outside --kv-peers: never contacted

ExportFn = blocks.ExportFn


class Credential(Protocol):
    """The deployment token (wire/auth.SecretFile): checked on the serving side, sent on the pulling side."""

    def accepts(self, presented: str | None) -> bool: ...

    def for_sending(self) -> list[str]: ...


class KVTransferError(Exception):
    """A pull or release that did not happen; `reason` is one of the constants above."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass
class PulledKV:
    layers: list[dict[str, torch.Tensor]] | None  # as LLMEngine.import_kv takes them; None: written in place
    nbytes: int
    in_place: bool = False  # the bytes are in the destination blocks already


class KVConnector(abc.ABC):
    """One transport for KV blocks between engines with equal KVLayout.compat_hash."""

    name: str
    pulls_from: frozenset[str] = frozenset({"tcp"})  # the params' `connector` values this side can pull from
    token: Credential | None = None  # None: unauthenticated (a worker without --auth-token-file)
    peers: KVPeers | None = None  # decode side: the only KV endpoints contacted; None: any

    def trusts(self, host: str, port: int) -> bool:
        """Whether this worker may contact (and send its token to) the KV endpoint host:port; may resolve names."""
        return self.peers is None or self.peers.allows(host, port)

    # -- prefill side ---------------------------------------------------------------------------
    @abc.abstractmethod
    def serve(self, leases: LeaseTable, source: KVPool | ExportFn, compat_hash: str) -> tuple[str, int]:
        """Start answering pulls of leased blocks, read from `source` (the pool itself, or copies an export
        function makes); returns the bound (host, port)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving (in-flight transfers are cut; their leases expire as usual)."""

    def moved(self) -> dict[str, int]:
        """Pulls answered (prefill side) or done (decode side), by how the bytes moved ("tcp", "nixl")."""
        return {}

    def running_threads(self) -> list[str]:
        """Names of the connector's threads still alive: after close(), those the process must not exit under."""
        return []

    # -- decode side ----------------------------------------------------------------------------
    @abc.abstractmethod
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
        """Fetch `len(dest_block_ids)` blocks of `prompt` starting at its block `first_block`, into those blocks
        of `into` when given (a failed pull may leave them partly written). Raises KVTransferError; never
        blocks longer than timeout_s, and nothing writes into `into` once it returned."""

    @abc.abstractmethod
    def release(self, params: KVTransferParams, prompt: RemotePrompt, ok: bool, timeout_s: float) -> bool:
        """Tell the prefill worker it may free the prompt's blocks (the ack). True if it held them."""
