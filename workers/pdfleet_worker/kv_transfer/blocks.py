"""Where KV blocks lie in a worker's pool: the byte segments of a block range in wire order, so the connectors send
straight from the block tensors and receive straight into them; the TCP and NIXL connectors and server/pd.py call it.

Wire order is what `LLMEngine.export_kv` returns, concatenated: layer by layer, within a layer its tensors by
name ("kv", then "scale" for an int8 cache), each laid out as `tensor.index_select(2, blocks)` would be. The
block dim is dim 2 (`[2, Hkv, N, block_size, D]`, scales `[2, Hkv, N]`), so for every row of the dims before it
(k/v x KV head) a run of consecutive block ids is one contiguous segment: a prompt whose blocks were allocated
together moves as layers x 2 x Hkv segments, each one kernel copy, and nothing is gathered in Python.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# Above this many segments in one layer (a fragmented range) the layer is gathered with index_select (one C
# copy) instead: Linux takes at most 1024 buffers per sendmsg/recvmsg, and a Python slice per segment would
# cost more than the copy.
MAX_SEGMENTS = 1024

# A layer's bytes on the way out: views ready to send, or a function that gathers a copy and returns its views.
SendLayer = list[memoryview] | Callable[[], list[memoryview]]

# (block ids) -> per layer {"kv": [2, Hkv, n, block_size, D], "scale": [2, Hkv, n]?}; LLMEngine.export_kv.
ExportFn = Callable[[list[int]], list[dict[str, torch.Tensor]]]


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, writable, without numpy (the worker image has none); the view
    keeps the tensor alive."""
    assert t.device.type == "cpu" and t.is_contiguous(), "a byte view needs a contiguous host tensor"
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    raw = (ctypes.c_ubyte * nbytes).from_address(t.data_ptr())
    raw._owner = t  # NOTE: ctypes does not own the memory: this reference keeps the storage alive
    return memoryview(raw).cast("B")


def spans(ids: Sequence[int]) -> list[tuple[int, int]]:
    """The runs of consecutive ids in `ids`, as (first id, length)."""
    out: list[tuple[int, int]] = []
    for b in ids:
        if out and b == out[-1][0] + out[-1][1]:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


def runs(*id_lists: Sequence[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Split equally long block-id lists where any of them stops being consecutive: the first id of every run
    in each list, and the runs' lengths (int64)."""
    n = len(id_lists[0])
    assert n > 0 and all(len(ids) == n for ids in id_lists), "block lists differ in length"
    # NOTE: a Python walk, not tensor ops: a prompt's few hundred ids take microseconds this way, ~60 us as ops.
    firsts = [0] + [i for i in range(1, n) if any(ids[i] != ids[i - 1] + 1 for ids in id_lists)]
    lengths = [b - a for a, b in zip(firsts, firsts[1:] + [n])]
    return [torch.tensor([ids[i] for i in firsts], dtype=torch.int64) for ids in id_lists], torch.tensor(
        lengths, dtype=torch.int64
    )


def segments(
    shape: Sequence[int], elem: int, starts: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte offsets and sizes, in wire order, of the runs (first block, length) in a contiguous tensor whose
    dim 2 is the block dim."""
    rows, pool_blocks, per_block = math.prod(shape[:2]), shape[2], math.prod(shape[3:]) * elem
    row = torch.arange(rows, dtype=torch.int64)[:, None] * pool_blocks
    offsets = (row + starts[None, :]) * per_block
    return offsets.flatten(), (lengths * per_block).repeat(rows)


@dataclasses.dataclass(frozen=True)
class WireTensor:
    """One tensor of a transfer as its header names it."""

    layer: int
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]  # dim 2 is the number of blocks moved

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def to_json(self) -> dict:
        return {"layer": self.layer, "name": self.name, "dtype": DTYPE_NAMES[self.dtype], "shape": list(self.shape)}


def parse_header(specs: object, num_blocks: int) -> list[WireTensor]:
    """The tensors a pull answer announces; ValueError when they are not layers in order holding num_blocks."""
    if not isinstance(specs, list):
        raise ValueError(f"tensors {specs!r} is not a list")
    out: list[WireTensor] = []
    for spec in specs:
        dtype = DTYPES.get(spec.get("dtype")) if isinstance(spec, dict) else None
        shape, layer = (spec.get("shape"), spec.get("layer")) if dtype is not None else (None, None)
        if (
            not isinstance(shape, list)
            or len(shape) < 3
            or shape[2] != num_blocks
            or not all(isinstance(d, int) and d >= 0 for d in shape)
            or not isinstance(spec.get("name"), str)
        ):
            raise ValueError(f"tensor {spec} does not hold {num_blocks} blocks")
        if layer not in ((out[-1].layer, out[-1].layer + 1) if out else (0,)):
            raise ValueError(f"tensor {spec} is out of layer order")
        out.append(WireTensor(layer, spec["name"], dtype, tuple(shape)))
    return out


class KVPool:
    """A worker's block tensors: per layer {"kv": [2, Hkv, N, bs, D], "scale": [2, Hkv, N]?}, allocated once,
    blocks along dim 2. Reading held blocks and writing blocks a KVLoad announced may happen off the engine
    thread: the lease (prefill) and the engine loop's deferred abort (decode) keep those blocks owned."""

    def __init__(self, layers: list[dict[str, torch.Tensor]]):
        if not layers:
            raise ValueError("a KV pool needs at least one layer")
        self.layers = [dict(sorted(layer.items())) for layer in layers]
        self.num_blocks = next(iter(self.layers[0].values())).shape[2]
        for layer in self.layers:
            for name, t in layer.items():
                if t.dim() < 3 or t.shape[2] != self.num_blocks or not t.is_contiguous():
                    raise ValueError(
                        f"KV pool tensor {name} {tuple(t.shape)} is not contiguous with "
                        f"{self.num_blocks} blocks on dim 2"
                    )
        self.device = next(iter(self.layers[0].values())).device
        # Per layer, per tensor: its bytes, rows before the block dim (k/v x KV head), bytes per block.
        self._geometry = (
            [
                [
                    (byte_view(t), math.prod(t.shape[:2]), math.prod(t.shape[3:]) * t.element_size())
                    for t in layer.values()
                ]
                for layer in self.layers
            ]
            if self.host
            else None
        )

    @classmethod
    def of_caches(cls, caches) -> "KVPool":
        """From the model runner's per-layer KVCache objects (kv, and scale for an int8 cache)."""
        return cls([{"kv": c.kv, **({"scale": c.scale} if c.scale is not None else {})} for c in caches])

    @property
    def host(self) -> bool:
        """Whether sockets can read and write the tensors directly (host memory)."""
        return self.device.type == "cpu"

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in layer.values()]

    def wire(self, num_blocks: int) -> list[WireTensor]:
        return [
            WireTensor(i, name, t.dtype, (*t.shape[:2], num_blocks, *t.shape[3:]))
            for i, layer in enumerate(self.layers)
            for name, t in layer.items()
        ]

    def check(self, specs: list[WireTensor]) -> None:
        """ValueError unless a transfer announced as `specs` lands in this pool as it is."""
        n = specs[0].shape[2] if specs else 0
        if specs != self.wire(n):
            theirs = [(s.layer, s.name, DTYPE_NAMES[s.dtype], s.shape) for s in specs[:3]]
            ours = [(s.layer, s.name, DTYPE_NAMES[s.dtype], s.shape) for s in self.wire(n)[:3]]
            raise ValueError(
                f"KV {theirs}... does not fit this pool {ours}... ({len(specs)} vs {len(self.wire(n))} tensors)"
            )

    # -- byte views, layer by layer (host pools) --------------------------------------------------
    def send_layers(self, block_ids: Sequence[int]) -> list[SendLayer]:
        """For each layer, the buffers holding its bytes in wire order: views of the pool itself, or, for a range
        too fragmented, a function that gathers a copy (called when the layer is next, so the copy is made while
        the layers before it are on the wire)."""
        assert self.host, "socket views need a host pool"
        runs_ = spans(block_ids)
        out: list[SendLayer] = []
        for i, layer in enumerate(self.layers):
            views = self._views(i, runs_)
            if views is None:

                def gather(layer=layer) -> list[memoryview]:
                    idx = torch.as_tensor(list(block_ids), dtype=torch.int64)
                    return [byte_view(t.index_select(2, idx)) for t in layer.values()]

                out.append(gather)
            else:
                out.append(views)
        return out

    def recv_layers(self, block_ids: Sequence[int]) -> list[tuple[list[memoryview], Callable[[], None] | None]]:
        """For each layer, the buffers its bytes go into and what to run once they are in (scatter a staged
        copy of a fragmented range into its blocks), or None when the views are the pool's own blocks.
        Made before the pull is asked for, so nothing is computed while its bytes arrive."""
        assert self.host, "socket views need a host pool"
        runs_ = spans(block_ids)
        out = []
        for i, layer in enumerate(self.layers):
            views = self._views(i, runs_)
            if views is not None:
                out.append((views, None))
                continue
            idx = torch.as_tensor(list(block_ids), dtype=torch.int64)
            staged = {
                name: torch.empty((*t.shape[:2], len(idx), *t.shape[3:]), dtype=t.dtype) for name, t in layer.items()
            }

            def scatter(layer=layer, staged=staged, idx=idx) -> None:
                for name, t in layer.items():
                    t.index_copy_(2, idx, staged[name])

            out.append(([byte_view(s) for s in staged.values()], scatter))
        return out

    def _views(self, layer: int, runs_: list[tuple[int, int]]) -> list[memoryview] | None:
        """Views of layer `layer`'s segments for the block runs (first, length), in wire order; None past
        MAX_SEGMENTS."""
        assert self._geometry is not None
        geometry = self._geometry[layer]
        if sum(rows for _, rows, _ in geometry) * len(runs_) > MAX_SEGMENTS:
            return None
        views = []
        for whole, rows, per_block in geometry:
            row_bytes = self.num_blocks * per_block
            for r in range(rows):
                base = r * row_bytes
                views += [whole[base + b * per_block : base + (b + n) * per_block] for b, n in runs_]
        return views

    # -- addresses (registered memory: NIXL) -------------------------------------------------------
    def regions(self) -> list[tuple[int, int]]:
        """(address, pool blocks) of every tensor in wire order: what a reader needs to address blocks."""
        return [(t.data_ptr(), t.shape[2]) for t in self.tensors()]


def address_list(
    tensors: Sequence[tuple[int, Sequence[int], int]], starts: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """[segments, 2] int64 (address, size) in wire order over tensors given as (base address, shape, element
    size), for the runs (first block, length) of one side of a transfer."""
    parts = []
    for base, shape, elem in tensors:
        offsets, sizes = segments(shape, elem, starts, lengths)
        parts.append(torch.stack([offsets + base, sizes], dim=1))
    return torch.cat(parts) if parts else torch.empty(0, 2, dtype=torch.int64)


class Exported:
    """A block source from an ExportFn (a pool on an accelerator, or a test's stand-in): gathered copies."""

    def __init__(self, export: ExportFn):
        self.export = export

    def header_and_layers(self, block_ids: list[int]) -> tuple[list[WireTensor], list[SendLayer]]:
        layers = [{name: t.contiguous().cpu() for name, t in sorted(layer.items())} for layer in self.export(block_ids)]
        specs = [
            WireTensor(i, name, t.dtype, tuple(t.shape)) for i, layer in enumerate(layers) for name, t in layer.items()
        ]
        return specs, [[byte_view(t) for t in layer.values()] for layer in layers]


def ready(layer: SendLayer) -> list[memoryview]:
    """A layer's views on its way out, its copy gathered first if it needs one."""
    return layer() if callable(layer) else layer


def source(blocks: "KVPool | ExportFn") -> "KVPool | Exported":
    """What a prefill side reads blocks from: its pool (host) or an export function (copies)."""
    if isinstance(blocks, KVPool):
        return blocks if blocks.host else Exported(_export_of(blocks))
    return Exported(blocks)


def header_and_layers(src: "KVPool | Exported", block_ids: list[int]) -> tuple[list[WireTensor], list[SendLayer]]:
    if isinstance(src, KVPool):
        return src.wire(len(block_ids)), src.send_layers(block_ids)
    return src.header_and_layers(block_ids)


def _export_of(pool: KVPool) -> ExportFn:
    def export(block_ids: list[int]) -> list[dict[str, torch.Tensor]]:
        idx = torch.as_tensor(block_ids, dtype=torch.int64, device=pool.device)
        return [{name: t.index_select(2, idx).cpu() for name, t in layer.items()} for layer in pool.layers]

    return export
