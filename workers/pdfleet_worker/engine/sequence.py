"""One request's tokens, progress and KV block table; created by LLMEngine, advanced by the Scheduler."""

from __future__ import annotations

import enum
import time

from pdfleet_worker.engine.output_text import OutputText
from pdfleet_worker.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    SWAPPED = "swapped"  # preempted with its KV in swap space (engine.preemption swap)
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model length
    ABORT = "abort"  # aborted by the caller (client gone, drain deadline)


class Sequence:
    """Progress is `num_computed_tokens` catching up with `num_tokens`.

    Chunked prefill, a prefix-cache hit and KV received from a prefill worker all just move
    `num_computed_tokens`; when it reaches `num_tokens` the next token is sampled.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        remote_kv_tokens: int = 0,
        hold_kv: bool = False,
        arrival_time: float | None = None,
    ):
        assert prompt_token_ids, "an empty prompt must be rejected before a Sequence is made"
        assert 0 <= remote_kv_tokens < len(prompt_token_ids), (
            f"remote KV for {remote_kv_tokens} tokens must leave one of "
            f"{len(prompt_token_ids)} prompt tokens to compute"
        )
        self.request_id = request_id
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit of the latest admission
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks, memoised by BlockManager
        self.num_published_blocks = 0  # leading blocks already offered to the prefix cache
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.remote_kv_tokens = remote_kv_tokens
        self.hold_kv = hold_kv
        self.num_preemptions = 0
        self.swap_slots: list[int] = []  # swap-space slots of its KV while SWAPPED, in block order
        self.offload_skipped: dict[str, int] = {}  # tier -> blocks found there but recomputed (cost model)
        self.output_text: OutputText | None = None  # LLMEngine's, while the request runs and it has a tokenizer
        # Lifecycle timestamps (time.monotonic) for metrics.
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.inter_token_latency: float | None = None  # of the latest token
        self.finished_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def reads_prefix_cache(self) -> bool:
        """Prompt logprobs need logits at every prompt position, so such a request computes its whole prompt."""
        return self.params.prompt_logprobs is None

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
