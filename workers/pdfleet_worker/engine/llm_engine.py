"""The engine API (add_request / step / abort / stats, KV export and import); the server and benchmarks call it."""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from pdfleet_worker.config import EngineConfig, ModelConfig
from pdfleet_worker.engine.block_manager import BlockManager
from pdfleet_worker.engine.kv_layout import KVLayout, weights_digest
from pdfleet_worker.engine.kv_offload import DISK, HOST, TIERS, CostModel, OffloadIndex, SwapStats, TierStats
from pdfleet_worker.engine.model_runner import TORCH_DTYPES, ModelRunner, kv_bytes_per_block
from pdfleet_worker.engine.output_text import OutputText
from pdfleet_worker.engine.outputs import HeldKV, RequestOutput
from pdfleet_worker.engine.scheduler import Scheduler, StepCost
from pdfleet_worker.engine.sequence import FinishReason, Sequence, SequenceStatus
from pdfleet_worker.engine.stats import EngineStats, FinishedRequestStats, IterationStats
from pdfleet_worker.engine.structured import Grammars
from pdfleet_worker.layers import packed_linear
from pdfleet_worker.model.loader import load_model
from pdfleet_worker.model.tokenizer import IncrementalDetokenizer, Tokenizer
from pdfleet_worker.sampling_params import SamplingParams


class QueueFullError(RuntimeError):
    """The waiting queue is at max_num_waiting; the server answers 503 + Retry-After."""


class LLMEngine:
    """Runs requests to completion one `step()` at a time. Not thread-safe: call it from one thread."""

    def __init__(self, config: EngineConfig, *, tokenizer: Tokenizer | None = None, load_tokenizer: bool = True):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_config = ModelConfig.from_dir(config.model)
        self.weights_digest = weights_digest(config.model)  # once: it reads every tensor's first and last bytes
        if tokenizer is None and load_tokenizer and os.path.isfile(os.path.join(config.model, "tokenizer.json")):
            tokenizer = Tokenizer(config.model)
        self.tokenizer = tokenizer
        dtype = TORCH_DTYPES[config.dtype]
        per_block = kv_bytes_per_block(self.model_config, config.block_size, config.kv_cache_dtype, dtype)
        num_blocks = config.num_kv_blocks or config.kv_cache_memory_bytes // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} holds no block of {per_block} bytes"
            )
        limit = self.model_config.max_position_embeddings
        if config.max_model_len is not None:
            if config.max_model_len > limit:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's {limit} positions")
            limit = config.max_model_len
        # NOTE: not capped by the pool: a request that cannot fit in the pool is refused at
        # add_request (ValueError) rather than silently cut short.
        self.max_model_len = limit
        self.kv_block_bytes = per_block
        tier_blocks = {HOST: config.kv_offload_host_bytes // per_block, DISK: config.kv_offload_disk_bytes // per_block}
        for tier, field in ((HOST, "kv_offload_host_bytes"), (DISK, "kv_offload_disk_bytes")):
            if getattr(config, field) and not tier_blocks[tier]:
                raise ValueError(f"{field}={getattr(config, field)} holds no KV block of {per_block} bytes")
        if any(tier_blocks.values()) and not config.enable_prefix_caching:
            raise ValueError("kv offload keeps evicted prefix-cache blocks: it needs enable_prefix_caching")
        swap_blocks = config.swap_space_bytes // per_block if config.preemption == "swap" else 0
        if config.preemption == "swap" and not swap_blocks:
            raise ValueError(f"swap_space_bytes={config.swap_space_bytes} holds no KV block of {per_block} bytes")
        offload = None
        if any(tier_blocks.values()) or swap_blocks:
            offload = OffloadIndex(
                host_blocks=tier_blocks[HOST],
                disk_blocks=tier_blocks[DISK],
                swap_blocks=swap_blocks,
                block_bytes=per_block,
                cost=CostModel(),
            )
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            hash_seed=config.prefix_hash_seed,
            offload=offload,
        )
        eos = set(self.model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=tuple(sorted(eos)),
            preemption=config.preemption,
            partial_prefill=config.partial_prefill,
            step_cost=StepCost(),
        )
        model = load_model(config.model, dtype, config.device, quantization=config.quantization)
        split_room = 0
        if torch.device(config.device).type == "cpu":
            # what the KV pool, its host tier and swap space will leave of the memory now free (weights loaded)
            from pdfleet_worker.server.device import free_memory

            to_come = (num_blocks + tier_blocks[HOST] + swap_blocks) * per_block
            split_room = max(0, free_memory("cpu").bytes - to_come) // packed_linear.SPLIT_ROOM_SHARE
        self.model_runner = ModelRunner(model, config, num_blocks, self.max_model_len, linear_split_room=split_room)
        self.sampler = self.model_runner.sampler
        self.sampler.eos_token_ids = tuple(sorted(eos))
        self.grammars: Grammars | None = None
        if tokenizer is not None and eos and os.path.isfile(os.path.join(config.model, "tokenizer.json")):
            with open(os.path.join(config.model, "tokenizer.json")) as f:
                self.grammars = Grammars(f.read(), self.model_config.vocab_size, sorted(eos))
        if offload is not None:
            self.model_runner.init_offload(
                host_blocks=tier_blocks[HOST],
                disk_blocks=tier_blocks[DISK],
                swap_blocks=swap_blocks,
                disk_dir=config.kv_offload_disk_dir,
            )
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._success: dict[str, int] = {r.value: 0 for r in FinishReason}
        self._aborted_outputs: list[RequestOutput] = []
        self._pending_stats = IterationStats()  # aborts between steps land in the next step's stats
        self.last_iteration_stats = IterationStats()

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        remote_kv_tokens: int = 0,
        hold_kv: bool = False,
    ) -> None:
        """Queue a request. remote_kv_tokens: KV of the first N prompt tokens comes from a prefill
        worker (see RequestOutput.kv_load); hold_kv: keep the blocks after finishing (prefill role).
        Raises ValueError naming the bad field, QueueFullError at the admission limit."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text but the engine has no tokenizer")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            vocab = self.model_config.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in token_ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; the model length is {self.max_model_len} "
                f"(prompt plus at least one generated token must fit)"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none")
        vocab = self.model_config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias names token {max(params.logit_bias)}; the vocabulary has {vocab}")
        if params.prompt_logprobs is not None and remote_kv_tokens:
            raise ValueError("prompt_logprobs need the whole prompt computed here: remote_kv_tokens must be 0")
        matcher = None
        if params.structured is not None:
            if self.grammars is None:
                raise ValueError("structured outputs need the model's tokenizer.json and an EOS token")
            matcher = self.grammars.matcher(params.structured)
        total = min(len(token_ids) + params.max_tokens, self.max_model_len)
        need = self.block_manager.blocks_needed(total)
        if need > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) needs "
                f"{need} KV blocks but the pool has {self.block_manager.num_blocks}; lower max_tokens"
            )
        if not 0 <= remote_kv_tokens < len(token_ids):
            raise ValueError(f"remote_kv_tokens must be in [0, {len(token_ids) - 1}], got {remote_kv_tokens}")
        if len(self.scheduler.waiting) >= self.config.max_num_waiting:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests waiting (max_num_waiting)")
        seq = Sequence(request_id, token_ids, params, remote_kv_tokens=remote_kv_tokens, hold_kv=hold_kv)
        self.scheduler.add(seq)
        self.sampler.add(request_id, token_ids, params, matcher)
        if self.tokenizer is not None:
            seq.output_text = OutputText(IncrementalDetokenizer(self.tokenizer, token_ids))

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks (held KV too). False if it is unknown or done."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self._aborted_outputs.append(self._output(seq, [], None, final=True))
        self._record_finished(seq, self._pending_stats)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, detokenize and apply stops."""
        started = time.perf_counter()
        it, self._pending_stats = self._pending_stats, IterationStats()
        outputs, self._aborted_outputs = self._aborted_outputs, []
        sched = self.scheduler.schedule()
        it.num_preemptions = len(sched.preempted_ids)
        it.num_scheduled_tokens = sched.num_batched_tokens
        offload = self.block_manager.offload
        if sched.copies:
            for kind, tier, n, seconds in self.model_runner.apply_copies(sched.copies):
                if kind == "load":
                    offload.cost.observe_copy(tier, n * self.kv_block_bytes, seconds)
        t0 = time.perf_counter()
        sampled = self.model_runner.execute(sched)
        if offload is not None and sched.chunks:
            prompt = sum(len(c.token_ids) for c in sched.chunks if len(c.token_ids) > 1)
            if prompt * 2 >= sched.num_batched_tokens:  # mostly prefill: a sample of its cost per token
                offload.cost.observe_prefill(sched.num_batched_tokens, time.perf_counter() - t0)
        for chunk in sched.chunks:
            if chunk.start_pos < self.scheduler.requests[chunk.request_id].num_prompt_tokens:
                it.num_prompt_tokens += min(
                    len(chunk.token_ids), self.scheduler.requests[chunk.request_id].num_prompt_tokens - chunk.start_pos
                )
        advanced = self.scheduler.update(sched, {rid: s.token_id for rid, s in sampled.items()})
        for load in sched.kv_loads:
            seq = self.scheduler.requests[load.request_id]
            out = self._output(seq, [], None, final=False)
            out.kv_load = load
            outputs.append(out)
        for seq in advanced:
            token = seq.token_ids[-1]
            it.num_generation_tokens += 1
            if seq.num_output_tokens == 1:
                it.ttfts_s.append(seq.first_token_time - seq.arrival_time)
            elif seq.inter_token_latency is not None:
                it.inter_token_latencies_s.append(seq.inter_token_latency)
            self._apply_stop_strings(seq)
            s = sampled[seq.request_id]
            out = self._output(seq, [token], [s.logprobs] if s.logprobs else None, final=seq.is_finished)
            if seq.num_output_tokens == 1 and seq.params.prompt_logprobs is not None:
                out.prompt_logprobs = self.sampler.take_prompt_logprobs(seq.request_id)
                assert out.prompt_logprobs is not None, f"{seq} sampled before its prompt was scored"
            outputs.append(out)
            if seq.is_finished:
                self._record_finished(seq, it)
        self._prompt_tokens_total += it.num_prompt_tokens
        self._generation_tokens_total += it.num_generation_tokens
        self.last_iteration_stats = it
        self.scheduler.step_cost.observe(sched.num_batched_tokens, time.perf_counter() - started)
        return outputs

    def _apply_stop_strings(self, seq: Sequence) -> None:
        out = seq.output_text
        if out is None:
            return
        before = out.text
        text = before + out.detokenizer.step(seq.token_ids)
        stops = seq.params.stop
        # NOTE: as vLLM: stop strings count only once min_tokens are out.
        if stops and not seq.is_finished and seq.num_output_tokens >= seq.params.min_tokens:
            start = max(0, len(before) - max(len(s) for s in stops) + 1)
            hits = [(text.find(s, start), s) for s in stops]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                text = text[: i + len(s)] if seq.params.include_stop_str_in_output else text[:i]
                self.scheduler.finish(seq, FinishReason.STOP)
        out.text = text

    def _output(self, seq: Sequence, new_tokens: list[int], logprobs, final: bool) -> RequestOutput:
        rid = seq.request_id
        new_text = ""
        if seq.output_text is not None:
            # Hold back what could be the start of a stop string until it is decided.
            hold = 0 if final or not seq.params.stop else max(len(s) for s in seq.params.stop) - 1
            new_text = seq.output_text.take(hold)
        held = None
        if final and seq.request_id in self.scheduler.held:
            held = HeldKV(list(seq.block_ids), seq.num_computed_tokens)
        return RequestOutput(
            request_id=rid,
            new_token_ids=new_tokens,
            new_text=new_text,
            finished=final,
            finish_reason=seq.finish_reason.value if final and seq.finish_reason else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=logprobs,
            held_kv=held,
        )

    def _record_finished(self, seq: Sequence, it: IterationStats) -> None:
        seq.output_text = None  # all of it streamed (a held prefill sequence outlives its request)
        reason = seq.finish_reason.value
        self._success[reason] += 1
        end = seq.finished_time or time.monotonic()
        it.finished.append(
            FinishedRequestStats(
                request_id=seq.request_id,
                finish_reason=reason,
                e2e_latency_s=end - seq.arrival_time,
                queue_time_s=(seq.first_scheduled_time or end) - seq.arrival_time,
                ttft_s=None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
                num_prompt_tokens=seq.num_prompt_tokens,
                num_output_tokens=seq.num_output_tokens,
                num_preemptions=seq.num_preemptions,
            )
        )

    # -- start-up --------------------------------------------------------------------------
    def warm_up(self) -> float:
        """Short greedy requests (one, then two at once) through prefill and decode steps, before the server says
        ready: the first call's costs (allocations, kernel selection, any compilation around the model) are paid
        here, not by the first client. Leaves no trace: counters as new, every block free, nothing in the prefix
        cache (the request is shorter than one block). Returns the seconds it took."""
        assert self.is_idle_and_whole(), "warm-up of an engine that already serves"
        t0 = time.monotonic()
        # NOTE: one sequence, then two: a compiled model has one graph for a lone decode and one for
        # any larger batch (torch.compile specializes size 1), and both are compiled here.
        greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        self.generate([[0]], greedy)
        self.generate([[0], [0]], greedy)
        self.model_runner.capture_graphs()  # CUDA (paged backend) only
        self._prompt_tokens_total = self._generation_tokens_total = 0
        self._success = {r.value: 0 for r in FinishReason}
        self.scheduler.num_preemptions = self.scheduler.num_deferred_prefills = 0
        self.scheduler.step_cost.reset()  # the first calls' costs are not the steps to come
        self.block_manager.stats = type(self.block_manager.stats)()
        if self.block_manager.offload is not None:
            off = self.block_manager.offload
            off.swap_stats = SwapStats()
            for t in off.tiers.values():
                t.stats = TierStats()
        self._pending_stats = IterationStats()
        self.last_iteration_stats = IterationStats()
        assert self.is_idle_and_whole(), "warm-up left a request or a block behind"
        return time.monotonic() - t0

    # -- convenience -----------------------------------------------------------------------
    def generate(
        self,
        prompts: list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (offline use and tests); one merged output per prompt, in order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        base = f"gen-{id(self)}-{time.monotonic_ns()}"
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        merged: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                m = merged.get(out.request_id)
                if m is None:
                    merged[out.request_id] = out
                    continue
                m.new_token_ids += out.new_token_ids
                m.new_text += out.new_text
                if out.logprobs:
                    m.logprobs = (m.logprobs or []) + out.logprobs
                m.prompt_logprobs = m.prompt_logprobs or out.prompt_logprobs
                m.finished, m.finish_reason = out.finished, out.finish_reason
                m.num_output_tokens, m.num_cached_tokens = out.num_output_tokens, out.num_cached_tokens
        return [merged[rid] for rid in ids]

    def stats(self) -> EngineStats:
        bm, s = self.block_manager, self.scheduler
        return EngineStats(
            num_requests_waiting=len(s.waiting),
            num_requests_running=len(s.running),
            num_requests_waiting_for_remote_kv=len(s.waiting_for_kv),
            num_requests_holding_kv=len(s.held),
            kv_cache_usage=bm.usage,
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            num_held_blocks=sum(len(q.block_ids) for q in s.held.values()),
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            num_preemptions_total=s.num_preemptions,
            num_deferred_prefills_total=s.num_deferred_prefills,
            prefix_cache_queries_total=bm.stats.queries,
            prefix_cache_hits_total=bm.stats.hits,
            request_success_total=dict(self._success),
            num_prompt_tokens_waiting=sum(q.num_prompt_tokens for q in s.waiting),
            **self._offload_stats(),
        )

    def _offload_stats(self) -> dict:
        off = self.block_manager.offload
        if off is None:
            return {}
        return dict(
            kv_offload={t: dataclasses.replace(off.tiers[t].stats) for t in TIERS},
            kv_offload_usage={t: off.usage(t) for t in TIERS},
            kv_offload_blocks={t: off.tiers[t].capacity for t in TIERS},
            kv_block_bytes=self.kv_block_bytes,
            swap=dataclasses.replace(off.swap_stats),
            swap_space_usage=off.swap_usage,
            num_requests_swapped=len(self.scheduler.swapped),
        )

    def is_idle_and_whole(self) -> bool:
        """No request anywhere and every block free: what tests assert after each case."""
        s = self.scheduler
        whole = self.block_manager.is_whole()
        off = self.block_manager.offload
        if off is not None:
            whole = whole and len(off.swap_free) == off.swap_capacity
        return not (s.waiting or s.running or s.waiting_for_kv or s.held or s.swapped or s.requests) and whole

    # -- prefill/decode disaggregation -----------------------------------------------------
    def kv_layout(self) -> KVLayout:
        cfg = self.model_config
        return KVLayout(
            model=self.weights_digest,
            dtype=self.config.dtype,
            kv_cache_dtype=self.config.kv_cache_dtype,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            block_size=self.config.block_size,
            quantization=self.config.quantization,
        )

    def export_kv(self, block_ids: list[int]) -> list[dict[str, torch.Tensor]]:
        """Copy out blocks (held by a finished hold_kv request) for a transfer."""
        return self.model_runner.export_kv(block_ids)

    def import_kv(self, block_ids: list[int], layers: list[dict[str, torch.Tensor]]) -> None:
        """Fill blocks announced by a KVLoad with data from export_kv on the prefill worker."""
        self.model_runner.import_kv(block_ids, layers)

    def remote_kv_done(self, request_id: str, ok: bool) -> None:
        """After a KVLoad: ok advances computed tokens by what arrived; not ok recomputes locally."""
        seq = self.scheduler.requests.get(request_id)
        if seq is None or seq.status != SequenceStatus.WAITING_FOR_REMOTE_KV:
            raise ValueError(f"request_id {request_id!r} is not waiting for remote KV")
        self.scheduler.remote_kv_done(request_id, ok)

    def release_held(self, request_id: str) -> bool:
        """Free the KV a finished hold_kv request kept (transfer acked or lease expired)."""
        return self.scheduler.release_held(request_id)
