"""Turns a SchedulerOutput into tensors, runs the model over the paged KV pool and samples; the only place lists become
tensors. LLMEngine calls it."""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time

import torch

from pdfleet_worker.config import EngineConfig, ModelConfig
from pdfleet_worker.engine import cuda_graphs
from pdfleet_worker.engine.kv_offload import DISK, HOST, Copy
from pdfleet_worker.engine.scheduler import ScheduledChunk, SchedulerOutput
from pdfleet_worker.layers import attention, cpu_kernels, packed_linear, quantized_linear, triton_attention
from pdfleet_worker.layers.attention import AttentionMetadata, KVCache, PrefillMeta
from pdfleet_worker.layers.sampler import SampledToken, Sampler
from pdfleet_worker.model.llama import LlamaForCausalLM, rope_cos_sin, use_cpu_kernels

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, kv_cache_dtype: str, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (keys, values and int8 scales)."""
    elem = 1 if kv_cache_dtype == "int8" else torch.tensor([], dtype=dtype).element_size()
    per_layer = 2 * cfg.num_kv_heads * block_size * cfg.head_dim * elem
    if kv_cache_dtype == "int8":
        per_layer += 2 * cfg.num_kv_heads * 4
    return cfg.num_layers * per_layer


# Copy kind -> (source store, destination store) given the copy's tier; "pool" is the device KV pool.
_COPY_STORES = {
    "save": lambda tier: ("pool", tier),
    "demote": lambda tier: (HOST, DISK),
    "load": lambda tier: (tier, "pool"),
    "swap_out": lambda tier: ("pool", "swap"),
    "swap_in": lambda tier: ("swap", "pool"),
}


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        engine_cfg: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        *,
        linear_split_room: int = 0,
    ):
        cfg = model.config
        self.model_config = cfg
        self.device = torch.device(engine_cfg.device)
        self.dtype = TORCH_DTYPES[engine_cfg.dtype]
        self.block_size = engine_cfg.block_size
        self.num_blocks = num_blocks
        self.backend = self._pick_backend(engine_cfg.attention_backend)
        # CPU linears: F.linear or oneDNN per weight shape, whichever this machine runs faster (timed here).
        self.linear_choice: packed_linear.LinearChoice | None = None
        self.int8_dequant_rows: dict[tuple[int, int], int] = {}
        self.linear_backend = "torch"
        if self.device.type == "cpu":
            self.linear_choice = packed_linear.choose(
                model,
                self.dtype,
                packed_linear.probe_rows(engine_cfg.max_num_seqs, engine_cfg.max_num_batched_tokens),
                split_room=linear_split_room,
            )
            packed_linear.pack_linears(model, self.linear_choice)
            self.linear_backend = self.linear_choice.backend
            self.int8_dequant_rows = quantized_linear.choose_dequant_rows(model)  # {} for a float model
        self.model = model
        cos, sin = rope_cos_sin(cfg, max_model_len)
        self.rope = (cos.to(self.device, self.dtype), sin.to(self.device, self.dtype))
        self.kv_cache_dtype = engine_cfg.kv_cache_dtype
        # CUDA graphs of decode steps (paged backend): padding rows need a block of their own, past
        # the ones the block manager hands out.
        self.graphs: cuda_graphs.DecodeGraphs | None = None
        self.use_graphs = (
            self.backend == "paged"
            and self.kv_cache_dtype == "auto"
            and os.environ.get("PDFLEET_CUDA_GRAPHS", "1") != "0"
        )
        pool_blocks = num_blocks + (1 if self.use_graphs else 0)
        self.caches = [self._new_layer_cache(cfg, pool_blocks) for _ in range(cfg.num_layers)]
        self.max_num_seqs, self.max_blocks = engine_cfg.max_num_seqs, math.ceil(max_model_len / self.block_size)
        # Decodes read the pool in place through their block tables (C++), when it builds here.
        self.decode_kernel = self.backend == "cpu" and cfg.head_dim % 16 == 0 and cpu_kernels.load()
        self.fused_ops = self.device.type == "cpu" and cpu_kernels.load()
        # Prefill chunks: SDPA or the C++ kernel, whichever this machine runs faster (timed here).
        self.prefill_choice: attention.PrefillChoice | None = None
        if self.decode_kernel:
            self.prefill_choice = attention.choose_prefill(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.dtype)
        self.prefill_kernel = self.prefill_choice is not None and self.prefill_choice.kernel == "kernel"
        if self.fused_ops:
            use_cpu_kernels(model)
        # With PDFLEET_COMPILE=1 decode-only steps run the model compiled (off by default: see docs/engine.md); the
        # first calls compile, which LLMEngine.warm_up pays before the server says ready.
        self.compiled = None
        if self.decode_kernel and os.environ.get("PDFLEET_COMPILE", "0") == "1":
            self.compiled = torch.compile(self.model.forward, dynamic=True, fullgraph=True)
        self.bind_cores: list[int] = []
        if self.device.type == "cpu":
            self.bind_cores = cpu_kernels.cores_to_bind(
                os.environ.get("PDFLEET_CPU_BIND", "auto"), torch.get_num_threads(), os.sched_getaffinity(0)
            )
        self.sampler = Sampler()
        # Off-device KV (init_offload): tier or "swap" -> per layer a KVCache of slots, same layout as the pool.
        self.stores: dict[str, list[KVCache]] = {}
        # Test and debugging hook: called as hook(request_ids, logits [S, V]) every step.
        self.logits_hook = None

    def _pick_backend(self, requested: str) -> str:
        if requested != "auto":
            return requested
        if self.device.type == "cpu":
            return "cpu"
        return "paged" if self.device.type == "cuda" and triton_attention.available() else "flex"

    def _new_layer_cache(self, cfg: ModelConfig, num_blocks: int) -> KVCache:
        shape = (2, cfg.num_kv_heads, num_blocks, self.block_size, cfg.head_dim)
        if self.kv_cache_dtype == "int8":
            return KVCache(
                torch.zeros(shape, dtype=torch.int8, device=self.device),
                torch.zeros(shape[:3], dtype=torch.float32, device=self.device),
            )
        return KVCache(torch.zeros(shape, dtype=self.dtype, device=self.device))

    # -- off-device KV: offload tiers and swap space ---------------------------------------
    def init_offload(
        self, *, host_blocks: int = 0, disk_blocks: int = 0, swap_blocks: int = 0, disk_dir: str | None = None
    ) -> None:
        """Slots for the host tier and swap space (RAM; pinned when the pool is on an accelerator) and for
        the disk tier: one memory-mapped file in disk_dir (an emptyDir in a pod), unlinked once mapped so
        nothing is left behind when the process ends."""
        cfg = self.model_config
        pin = self.device.type == "cuda"
        for name, n in ((HOST, host_blocks), ("swap", swap_blocks)):
            if n:
                self.stores[name] = [self._slots(cfg, n, pin=pin) for _ in range(cfg.num_layers)]
        if disk_blocks:
            directory = disk_dir or tempfile.gettempdir()
            os.makedirs(directory, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix="pdfleet-kv-", suffix=".bin", dir=directory)
            os.close(fd)
            try:
                self.stores[DISK] = self._mapped_slots(cfg, disk_blocks, path)
            finally:
                os.unlink(path)

    def _slots(self, cfg: ModelConfig, n: int, *, pin: bool) -> KVCache:
        shape = (2, cfg.num_kv_heads, n, self.block_size, cfg.head_dim)
        if self.kv_cache_dtype == "int8":
            return KVCache(
                torch.empty(shape, dtype=torch.int8, pin_memory=pin),
                torch.empty(shape[:3], dtype=torch.float32, pin_memory=pin),
            )
        return KVCache(torch.empty(shape, dtype=self.dtype, pin_memory=pin))

    def _mapped_slots(self, cfg: ModelConfig, n: int, path: str) -> list[KVCache]:
        """Every layer's slots as views of one shared mapping of `path` (kv of all layers, then scales)."""
        kv_dtype = torch.int8 if self.kv_cache_dtype == "int8" else self.dtype
        shape = (cfg.num_layers, 2, cfg.num_kv_heads, n, self.block_size, cfg.head_dim)
        kv_numel = math.prod(shape)
        elem = torch.tensor([], dtype=kv_dtype).element_size()
        scale_numel = cfg.num_layers * 2 * cfg.num_kv_heads * n if self.kv_cache_dtype == "int8" else 0
        nbytes = kv_numel * elem + scale_numel * 4
        with open(path, "r+b") as f:
            f.truncate(nbytes)
        raw = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        self.disk_mapping = raw  # the whole mapping (bench/levers_offload.py pages it out to read the file cold)
        kv = raw[: kv_numel * elem].view(kv_dtype).view(shape)
        if not scale_numel:
            return [KVCache(kv[i]) for i in range(cfg.num_layers)]
        scale = raw[kv_numel * elem :].view(torch.float32).view(cfg.num_layers, 2, cfg.num_kv_heads, n)
        return [KVCache(kv[i], scale[i]) for i in range(cfg.num_layers)]

    @torch.inference_mode()
    def apply_copies(self, copies: list[Copy]) -> list[tuple[str, str, int, float]]:
        """Run the scheduler's block copies with the effect of running them in order, batched: a copy joins the
        latest earlier run of its kind that no run in between conflicts with (writes what it reads, or reads or
        writes what it writes), so a prefix hit's evictions and loads, interleaved one block at a time by the
        block manager, become one save run and one load run. Returns (kind, tier, blocks, seconds) per run,
        for the cost model's bandwidth measurements."""
        runs: list[tuple[str, str, list[int], list[int], set, set]] = []  # kind, tier, src, dst, reads, writes
        for c in copies:
            src_store, dst_store = _COPY_STORES[c.kind](c.tier)
            read, write = (src_store, c.src), (dst_store, c.dst)
            target = None
            for run in reversed(runs):
                if run[0] == c.kind and run[1] == c.tier and write not in run[5] and read not in run[5]:
                    target = run
                    break  # NOTE: inside a run every read happens before every write
                if read in run[5] or write in run[5] or write in run[4]:
                    break
            if target is None:
                target = (c.kind, c.tier, [], [], set(), set())
                runs.append(target)
            target[2].append(c.src)
            target[3].append(c.dst)
            target[4].add(read)
            target[5].add(write)
        done = []
        for kind, tier, src, dst, _, _ in runs:
            t0 = time.perf_counter()
            self._copy_blocks(*self._ends(kind, tier), src, dst)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            done.append((kind, tier, len(src), time.perf_counter() - t0))
        return done

    def _ends(self, kind: str, tier: str) -> tuple[list[KVCache], list[KVCache]]:
        pool = self.caches
        if kind == "save":
            return pool, self.stores[tier]
        if kind == "demote":
            return self.stores[HOST], self.stores[DISK]
        if kind == "load":
            return self.stores[tier], pool
        if kind == "swap_out":
            return pool, self.stores["swap"]
        assert kind == "swap_in", f"unknown copy {kind}"
        return self.stores["swap"], pool

    @staticmethod
    def _copy_blocks(src_layers: list[KVCache], dst_layers: list[KVCache], src: list[int], dst: list[int]) -> None:
        """Per layer, per (key/value, KV head) row: index_select / index_copy_ along dim 0 of a [blocks, slot x
        head_dim] view, where torch copies whole contiguous rows (~4x the bandwidth of gathering along dim 2
        of the 5-D pool, measured on this CPU). On the CPU in chunks under torch's parallel grain (32768
        elements), so no copy opens an OpenMP region: with the compute threads bound to their cores a region
        opened between steps waits for them, seconds per prefix hit on a loaded machine (measured)."""
        s_idx = d_idx = None
        for s, d in zip(src_layers, dst_layers):
            rows, blocks = s.kv.shape[0] * s.kv.shape[1], s.kv.shape[2]
            s_rows = s.kv.view(rows, blocks, -1)
            d_rows = d.kv.view(rows, d.kv.shape[2], -1)
            if s_idx is None:
                step = len(src) if s.kv.is_cuda or d.kv.is_cuda else max(1, 32768 // s_rows.shape[2])
                s_idx = [
                    torch.tensor(src[i : i + step], dtype=torch.int64, device=s.kv.device)
                    for i in range(0, len(src), step)
                ]
                d_idx = [
                    torch.tensor(dst[i : i + step], dtype=torch.int64, device=d.kv.device)
                    for i in range(0, len(dst), step)
                ]
            for r in range(rows):
                for si, di in zip(s_idx, d_idx):
                    d_rows[r].index_copy_(0, di, s_rows[r].index_select(0, si).to(d.kv.device, non_blocking=True))
            if s.quantized:
                for si, di in zip(s_idx, d_idx):
                    d.scale.index_copy_(2, di, s.scale.index_select(2, si).to(d.scale.device, non_blocking=True))

    # -- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        for rid in out.finished_ids:
            self.sampler.forget(rid)
        if out.is_empty:
            return {}
        chunks = sorted(out.chunks, key=lambda c: len(c.token_ids) > 1)  # decodes first, stable
        input_ids, positions, meta, logits_rows, samplers = self._prepare(chunks)
        model = self.compiled if meta.fused_decode else self.model
        with self._bound():
            if (
                self.graphs is not None
                and not meta.prefills
                and self.graphs.fits(meta.num_decodes, meta.decode_block_tables.shape[1])
            ):
                hidden = self.graphs.run(input_ids, positions, meta)
            else:
                hidden = model(input_ids, positions, self.rope, meta, self.caches)  # [T, hidden]
            if self.sampler.prompts:  # prompt logprobs: logits at prompt positions, not only the last
                self.sampler.score_prompts(chunks, hidden, self.model.compute_logits)
            if not samplers:
                return {}
            logits = self.model.compute_logits(hidden[logits_rows])  # [S, V]
        ids = [c.request_id for c in samplers]
        if self.logits_hook is not None:
            self.logits_hook(ids, logits)
        sampled = self.sampler(logits, ids, [c.params for c in samplers], [c.num_output_tokens for c in samplers])
        return dict(zip(ids, sampled))

    @torch.inference_mode()
    def capture_graphs(self) -> int:
        """Capture the decode CUDA graphs (LLMEngine.warm_up calls this); returns how many."""
        if not self.use_graphs or self.graphs is not None:
            return 0
        graphs = cuda_graphs.DecodeGraphs(
            self.model,
            self.rope,
            self.caches,
            max_batch=self.max_num_seqs,
            max_blocks=self.max_blocks,
            block_size=self.block_size,
            scratch_block=self.num_blocks,
            device=self.device,
        )
        graphs.capture()
        self.graphs = graphs
        return len(graphs.graphs)

    @contextlib.contextmanager
    def _bound(self):
        """Compute threads bound to bind_cores while the model runs. NOTE: the calling thread is
        compute thread 0; its own affinity is restored afterwards, so what it starts between steps
        (a subprocess, a thread) inherits the process's cores, not one. The team is bound at every
        step (one small OpenMP region): each calling thread has a team of its own, whose threads
        start on the caller's core, and the worker steps first on its model-load thread, then on its
        engine thread, which glibc often gives the same thread id; bound once per id, the engine
        thread's team kept both threads on core 0 (a tiny model on 2 threads: 40 ms per token, not 2)."""
        if not self.bind_cores:
            yield
            return
        mine = os.sched_getaffinity(0)
        cpu_kernels.pin_threads(self.bind_cores)
        try:
            yield
        finally:
            os.sched_setaffinity(0, mine)

    def _prepare(self, chunks: list[ScheduledChunk]):
        bs, dev = self.block_size, self.device
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        samplers: list[ScheduledChunk] = []
        decodes: list[ScheduledChunk] = []
        prefills: list[tuple[int, ScheduledChunk]] = []
        for c in chunks:
            row = len(token_ids)
            n = len(c.token_ids)
            assert len(c.block_ids) * bs >= c.start_pos + n, f"{c.request_id}: block table too short"
            token_ids += c.token_ids
            pos = range(c.start_pos, c.start_pos + n)
            positions += pos
            slots += [c.block_ids[p // bs] * bs + p % bs for p in pos]
            if c.sample:
                logits_rows.append(row + n - 1)
                samplers.append(c)
            if n == 1:
                assert not prefills, "decodes must come first"
                decodes.append(c)
            else:
                prefills.append((row, c))
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        meta = AttentionMetadata(
            backend=self.backend,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decodes=len(decodes),
            decode_block_tables=torch.empty(0, 0, dtype=torch.int64, device=dev),
            decode_context_lens=torch.empty(0, dtype=torch.int64, device=dev),
            decode_mask=None,
            prefills=[],
        )
        if len(slots) == 1:
            meta.one_slot = divmod(slots[0], bs)
        if decodes:
            ctx = [c.start_pos + 1 for c in decodes]
            width = math.ceil(max(ctx) / bs)
            tables = [c.block_ids[:width] + [0] * (width - len(c.block_ids[:width])) for c in decodes]
            meta.decode_block_tables = torch.tensor(tables, dtype=torch.int64, device=dev)  # [Bd, W]
            meta.decode_context_lens = torch.tensor(ctx, dtype=torch.int64, device=dev)
            meta.decode_kernel = self.decode_kernel
            if self.compiled is not None and not prefills:
                # NOTE: tables at least 2 wide: torch.compile specializes sizes 0 and 1, and a
                # width-1 graph would recompile on the first context longer than one block.
                meta.fused_decode = True
                if width < 2:
                    meta.decode_block_tables = torch.nn.functional.pad(meta.decode_block_tables, (0, 2 - width))
            if len(decodes) == 1:
                meta.lone_decode_len = ctx[0]
            elif not self.decode_kernel:  # only the padded SDPA fallback reads the mask
                keys = torch.arange(width * bs, device=dev)
                meta.decode_mask = (keys[None, :] < meta.decode_context_lens[:, None])[None, :, None, :]
        for row, c in prefills:
            n = len(c.token_ids)
            ctx = c.start_pos + n
            table = torch.tensor(c.block_ids[: math.ceil(ctx / bs)], dtype=torch.int64, device=dev)
            mask = None
            if c.start_pos:
                mask = torch.arange(ctx, device=dev)[None, :] <= pos_t[row : row + n, None]  # [n, ctx]
            meta.prefills.append(PrefillMeta(row, n, ctx, table, mask))
            meta.prefill_kernel = self.prefill_kernel
        if self.backend == "flex":
            meta.flex = self._flex_metadata(chunks, pos_t)
        return (
            torch.tensor(token_ids, dtype=torch.int64, device=dev),
            pos_t,
            meta,
            torch.tensor(logits_rows, dtype=torch.int64, device=dev),
            samplers,
        )

    def _flex_metadata(self, chunks: list[ScheduledChunk], pos_t: torch.Tensor):
        bs, dev = self.block_size, self.device
        q_seq, kv_seq, kv_pos, kv_index = [], [], [], []
        for i, c in enumerate(chunks):
            ctx = c.start_pos + len(c.token_ids)
            q_seq += [i] * len(c.token_ids)
            kv_seq += [i] * ctx
            kv_pos += range(ctx)
            kv_index += [c.block_ids[p // bs] * bs + p % bs for p in range(ctx)]

        def t(x):
            return torch.tensor(x, dtype=torch.int64, device=dev)

        return attention.build_flex_metadata(t(q_seq), pos_t, t(kv_seq), t(kv_pos), t(kv_index))

    # -- KV import/export for prefill/decode disaggregation ----------------------------------
    @torch.inference_mode()
    def export_kv(self, block_ids: list[int]) -> list[dict[str, torch.Tensor]]:
        """Copies of the given blocks, per layer: kv [2, Hkv, n, block_size, D] (+ scale [2, Hkv, n])."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        out = []
        for c in self.caches:
            layer = {"kv": c.kv.index_select(2, idx).cpu()}
            if c.quantized:
                layer["scale"] = c.scale.index_select(2, idx).cpu()
            out.append(layer)
        return out

    @torch.inference_mode()
    def import_kv(self, block_ids: list[int], layers: list[dict[str, torch.Tensor]]) -> None:
        """Write blocks produced by export_kv (of a compatible engine) into the given block ids."""
        if len(layers) != len(self.caches):
            raise ValueError(f"KV has {len(layers)} layers, this model has {len(self.caches)}")
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        for c, layer in zip(self.caches, layers):
            for name in ("kv", "scale") if c.quantized else ("kv",):
                dest, src = getattr(c, name), layer[name]
                want = dest.shape[:2] + (len(block_ids),) + dest.shape[3:]
                if tuple(src.shape) != tuple(want) or src.dtype != dest.dtype:
                    raise ValueError(
                        f"KV {name} is {tuple(src.shape)} {src.dtype}, expected {tuple(want)} {dest.dtype}"
                    )
                dest.index_copy_(2, idx, src.to(self.device))
