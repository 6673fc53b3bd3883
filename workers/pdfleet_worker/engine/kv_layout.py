"""KVLayout: what a prefill and a decode engine must agree on to exchange KV blocks, the weights' digest included; the
engine builds it once at load, the PD code compares its hash."""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import struct

# Bytes read from the start and from the end of every tensor of a checkpoint for its digest.
SAMPLE_BYTES = 4096
# safetensors' own bound on a header (a larger one is a corrupt or hostile file).
MAX_HEADER_BYTES = 100 << 20


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What two engines must agree on to exchange KV blocks. `model` identifies the weights (`weights_digest`),
    not the directory's name: two revisions of a model share their path (`/models/...`), and KV computed by one
    set of weights is wrong for another."""

    model: str
    dtype: str
    kv_cache_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    layout: str = "layer,{k,v},kv_head,block,slot,head_dim"
    quantization: str = "none"  # int8 weights compute other keys and values than the float checkpoint

    @property
    def compat_hash(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def weights_digest(model_dir: str) -> str:
    """A digest of a Hugging Face checkpoint: config.json's bytes, each *.safetensors file's header, and the first
    and last SAMPLE_BYTES of every tensor's data. ValueError names a file that is not a safetensors file.

    NOTE: not a hash of the whole files, on purpose: the worker computes it at every start-up, and reading tens of
    gigabytes for it would double a large model's load. The header alone is not enough either: a fine-tune of the
    same architecture has the same names, shapes and offsets, so a sample of every tensor's data goes in; a change
    confined to the middle of every tensor it touches would pass unseen (no training or merge does that).
    """
    h = hashlib.sha256()
    config = os.path.join(model_dir, "config.json")
    with open(config, "rb") as f:
        h.update(b"config.json\0" + f.read())
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        h.update(b"\0" + os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            header, data_start = _header(f, path)
            h.update(header)
            tensors = json.loads(header)
            for name in sorted(k for k in tensors if k != "__metadata__"):
                begin, end = _offsets(tensors[name], name, path)
                for at, size in _samples(begin, end):
                    f.seek(data_start + at)
                    h.update(f.read(size))
    return h.hexdigest()[:16]


def _header(f, path: str) -> tuple[bytes, int]:
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
    (size,) = struct.unpack("<Q", raw)
    if not 0 < size <= MAX_HEADER_BYTES:
        raise ValueError(f"{path}: not a safetensors file (header of {size} bytes)")
    header = f.read(size)
    if len(header) != size:
        raise ValueError(f"{path}: truncated safetensors header ({len(header)} of {size} bytes)")
    return header, 8 + size


def _offsets(entry, name: str, path: str) -> tuple[int, int]:
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(x, int) for x in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise ValueError(f"{path}: tensor {name!r} has no valid data_offsets")
    return offsets[0], offsets[1]


def _samples(begin: int, end: int) -> list[tuple[int, int]]:
    """(offset, size) of the bytes sampled from one tensor's data [begin, end)."""
    size = end - begin
    if size <= 2 * SAMPLE_BYTES:
        return [(begin, size)]
    return [(begin, SAMPLE_BYTES), (end - SAMPLE_BYTES, SAMPLE_BYTES)]
