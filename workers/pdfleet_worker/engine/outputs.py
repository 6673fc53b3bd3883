"""What LLMEngine.step() hands back per request (`RequestOutput`, with the KV a finished prefill keeps: `HeldKV`); the
server, the PD hand-off and tests read them."""

from __future__ import annotations

import dataclasses

from pdfleet_worker.engine.scheduler import KVLoad
from pdfleet_worker.layers.sampler import TokenLogprobs


@dataclasses.dataclass(frozen=True)
class HeldKV:
    """KV blocks a finished request keeps for a decode worker to pull (until release_held)."""

    block_ids: list[int]
    num_tokens: int


@dataclasses.dataclass
class RequestOutput:
    """What one step produced for one request: a delta of its output stream."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with the first token, when asked for
    held_kv: HeldKV | None = None
    kv_load: KVLoad | None = None  # admitted: fill these blocks, then call remote_kv_done
