"""The engine's numbers for the metrics module: one step's samples and increments (`IterationStats`), a finished
request's (`FinishedRequestStats`) and a snapshot of gauges and counters named after vLLM's (`EngineStats`); the only
thing that crosses from the engine to metrics."""

from __future__ import annotations

import dataclasses

from pdfleet_worker.engine.kv_offload import SwapStats, TierStats


@dataclasses.dataclass(frozen=True)
class FinishedRequestStats:
    request_id: str
    finish_reason: str
    e2e_latency_s: float
    queue_time_s: float
    ttft_s: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int


@dataclasses.dataclass
class IterationStats:
    """What happened in one step: histogram samples and counter increments for the metrics module."""

    num_prompt_tokens: int = 0  # prompt tokens computed this step
    num_generation_tokens: int = 0  # tokens sampled this step
    num_preemptions: int = 0
    ttfts_s: list[float] = dataclasses.field(default_factory=list)
    inter_token_latencies_s: list[float] = dataclasses.field(default_factory=list)
    finished: list[FinishedRequestStats] = dataclasses.field(default_factory=list)
    num_scheduled_tokens: int = 0  # tokens the model ran this step; 0: the step could do nothing


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot of gauges and cumulative counters, named after what vLLM exports."""

    num_requests_waiting: int
    num_requests_running: int
    num_requests_waiting_for_remote_kv: int
    num_requests_holding_kv: int
    kv_cache_usage: float  # 0..1; cached-but-free blocks count as free
    num_free_blocks: int
    num_total_blocks: int
    num_held_blocks: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions_total: int
    prefix_cache_queries_total: int  # tokens
    prefix_cache_hits_total: int  # tokens
    request_success_total: dict[str, int]
    num_prompt_tokens_waiting: int = 0  # prompt tokens of requests not yet admitted
    num_deferred_prefills_total: int = 0  # steps whose next prompt waited rather than be cut (partial_prefill auto)
    # Tiered KV offload and swap preemption (empty/zero when off).
    kv_offload: dict[str, TierStats] = dataclasses.field(default_factory=dict)  # tier -> cumulative counters
    kv_offload_usage: dict[str, float] = dataclasses.field(default_factory=dict)  # tier -> 0..1
    kv_offload_blocks: dict[str, int] = dataclasses.field(default_factory=dict)  # tier -> capacity in blocks
    kv_block_bytes: int = 0
    swap: SwapStats = dataclasses.field(default_factory=SwapStats)
    swap_space_usage: float = 0.0
    num_requests_swapped: int = 0
