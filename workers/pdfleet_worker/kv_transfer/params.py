"""KVTransferParams: what a prefill worker returns and a decode worker needs to pull the KV (the wire contract); server
and router use it."""

from __future__ import annotations

import array
import dataclasses
import hashlib
from typing import Any

# Keys inside a request's `kv_transfer_params` object (named as vLLM names them where it has one).
DO_REMOTE_DECODE = "do_remote_decode"  # router -> prefill worker: hold the KV for a decode worker
DO_REMOTE_PREFILL = "do_remote_prefill"  # router -> decode worker: the KV comes from a prefill worker


def prompt_hash(token_ids: list[int]) -> str:
    """Identifies a tokenized prompt, so a decode worker that tokenized differently refuses the KV."""
    return hashlib.sha256(array.array("q", token_ids).tobytes()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class RemotePrompt:
    """One prompt's held KV on the prefill worker."""

    request_id: str  # the prefill engine's request id; the lease key
    block_ids: list[int]  # held blocks in token order
    num_tokens: int  # tokens whose KV the blocks hold
    prompt_hash: str


@dataclasses.dataclass(frozen=True)
class KVTransferParams:
    """Where and how to pull KV: the prefill engine's KV endpoint, layout hash and held prompts."""

    engine_id: str
    host: str
    port: int
    connector: str  # transport name (tcp)
    compat_hash: str  # KVLayout.compat_hash of the prefill engine
    block_size: int
    lease_seconds: float
    prompts: list[RemotePrompt]
    weights: str | None = None  # the prefill engine's weights digest (KVLayout.model): names a mismatch's cause
    revision: str | None = None  # the prefill worker's --revision

    def to_json(self) -> dict[str, Any]:
        optional = {k: v for k, v in (("weights", self.weights), ("revision", self.revision)) if v is not None}
        return {
            DO_REMOTE_PREFILL: True,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "connector": self.connector,
            "compat_hash": self.compat_hash,
            "block_size": self.block_size,
            "lease_seconds": self.lease_seconds,
            "prompts": [
                {
                    "remote_request_id": p.request_id,
                    "remote_block_ids": list(p.block_ids),
                    "num_tokens": p.num_tokens,
                    "prompt_hash": p.prompt_hash,
                }
                for p in self.prompts
            ],
            **optional,
        }

    @classmethod
    def from_json(cls, raw: Any) -> "KVTransferParams":
        """Parse and check the object a decode worker received; ValueError names the bad field."""
        if not isinstance(raw, dict):
            raise ValueError("kv_transfer_params must be an object")

        def field(obj: dict, key: str, kind: type | tuple[type, ...], where: str = "kv_transfer_params"):
            value = obj.get(key)
            if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
                raise ValueError(f"{where}.{key} is missing or not a {getattr(kind, '__name__', kind)}")
            return value

        prompts_raw = field(raw, "prompts", list)
        if not prompts_raw:
            raise ValueError("kv_transfer_params.prompts is empty")
        prompts = []
        for i, p in enumerate(prompts_raw):
            where = f"kv_transfer_params.prompts[{i}]"
            if not isinstance(p, dict):
                raise ValueError(f"{where} must be an object")
            blocks = field(p, "remote_block_ids", list, where)
            if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks):
                raise ValueError(f"{where}.remote_block_ids must be non-negative integers")
            num_tokens = field(p, "num_tokens", int, where)
            if num_tokens < 0:
                raise ValueError(f"{where}.num_tokens must be >= 0")
            prompts.append(
                RemotePrompt(
                    field(p, "remote_request_id", str, where),
                    list(blocks),
                    num_tokens,
                    field(p, "prompt_hash", str, where),
                )
            )
        port = field(raw, "remote_port", int)
        block_size = field(raw, "block_size", int)
        if not 0 < port < 65536 or block_size < 1:
            raise ValueError("kv_transfer_params.remote_port or block_size is out of range")
        for i, p in enumerate(prompts):
            if len(p.block_ids) * block_size < p.num_tokens:
                raise ValueError(
                    f"kv_transfer_params.prompts[{i}]: {len(p.block_ids)} blocks cannot hold {p.num_tokens} tokens"
                )
        optional = {}
        for key in ("weights", "revision"):
            if raw.get(key) is not None:
                optional[key] = field(raw, key, str)
        return cls(
            engine_id=field(raw, "remote_engine_id", str),
            host=field(raw, "remote_host", str),
            port=port,
            connector=raw.get("connector", "tcp") if isinstance(raw.get("connector", "tcp"), str) else "tcp",
            compat_hash=field(raw, "compat_hash", str),
            block_size=block_size,
            lease_seconds=float(field(raw, "lease_seconds", (int, float))),
            prompts=prompts,
            **optional,
        )
