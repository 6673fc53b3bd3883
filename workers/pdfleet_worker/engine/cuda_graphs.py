"""CUDA graphs of decode-only steps, one per batch size of a ladder, captured at warm-up; ModelRunner replays them on
the paged backend.

A decode step's model call is the same kernels every time for a given batch size: the inputs
(token, position, slot, block table row, context length per sequence) are copied into static
buffers and the graph of the smallest captured size >= B is replayed. Rows past B are padding: they
write their KV into a scratch block the block manager never hands out, and attend to it alone.
"""

from __future__ import annotations

import torch

from pdfleet_worker.layers.attention import AttentionMetadata

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    """Captured decode steps of `model` over `caches` (whose last block, `scratch_block`, is padding's)."""

    def __init__(
        self,
        model,
        rope,
        caches,
        *,
        max_batch: int,
        max_blocks: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
    ):
        self.model, self.rope, self.caches = model, rope, caches
        self.block_size, self.scratch_block = block_size, scratch_block
        self.sizes = [b for b in BATCH_SIZES if b < max_batch] + [max_batch]
        n, dev = self.sizes[-1], device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), scratch_block * block_size, dtype=torch.int64, device=dev)
        self.tables = torch.full((n, max_blocks), scratch_block, dtype=torch.int64, device=dev)
        self.lens = torch.ones(n, dtype=torch.int64, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            backend="paged",
            slot_mapping=self.slots[:b],
            num_decodes=b,
            decode_block_tables=self.tables[:b],
            decode_context_lens=self.lens[:b],
            decode_mask=None,
            prefills=[],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (smaller graphs then share its memory pool)."""
        self._reset(self.sizes[-1])
        for b in reversed(self.sizes):
            args = (self.input_ids[:b], self.positions[:b], self.rope, self._meta(b), self.caches)
            self.model(*args)  # warm: kernel selection and allocations happen outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.model(*args)
            self.pool = graph.pool()
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize()

    def _reset(self, b: int) -> None:
        self.slots[:b] = self.scratch_block * self.block_size
        self.tables[:b] = self.scratch_block
        self.lens[:b] = 1

    def fits(self, num_decodes: int, width: int) -> bool:
        return bool(self.graphs) and num_decodes <= self.sizes[-1] and width <= self.tables.shape[1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the graph for meta.num_decodes decodes -> hidden [B, hidden] (a view of its static output)."""
        b = meta.num_decodes
        size = next(s for s in self.sizes if s >= b)
        graph, out = self.graphs[size]
        self._reset(size)
        w = meta.decode_block_tables.shape[1]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slots[:b].copy_(meta.slot_mapping)
        self.tables[:b, :w].copy_(meta.decode_block_tables)
        self.lens[:b].copy_(meta.decode_context_lens)
        graph.replay()
        return out[:b]
