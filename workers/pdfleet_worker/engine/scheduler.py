"""Continuous batching: picks which tokens of which sequences run each step; LLMEngine calls it. No torch."""

from __future__ import annotations

import collections
import dataclasses
import math
import time

from pdfleet_worker.config import PARTIAL_PREFILL_MODES
from pdfleet_worker.engine.block_manager import BlockManager
from pdfleet_worker.engine.kv_offload import Copy
from pdfleet_worker.engine.sequence import FinishReason, Sequence, SequenceStatus
from pdfleet_worker.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """Tokens of one sequence to run this step: positions start_pos .. start_pos+len(token_ids)-1."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]  # the block table; covers start_pos + len(token_ids) tokens
    sample: bool  # the chunk reaches the last known token: sample the next one
    params: SamplingParams
    num_output_tokens: int  # tokens generated so far (the sampler's per-request step index)


@dataclasses.dataclass(frozen=True)
class KVLoad:
    """Blocks of a newly admitted request that must be filled with KV from a prefill worker."""

    request_id: str
    block_ids: list[int]  # destination blocks, in token order
    first_token: int  # token index of the first slot of block_ids[0]
    num_tokens: int  # tokens whose KV must arrive


@dataclasses.dataclass
class SchedulerOutput:
    """The only thing that crosses from the scheduler to the model runner."""

    chunks: list[ScheduledChunk]
    num_batched_tokens: int
    preempted_ids: list[str]
    finished_ids: list[str]  # finished or aborted since the previous step: drop per-request state
    kv_loads: list[KVLoad]
    # Block copies (offload tiers, swap space) to run before this step's forward pass, in order.
    copies: list[Copy] = dataclasses.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


# auto: a new prompt's partial chunk waits for the next step when it would lengthen this step by at least this share
DEFER_SHARE = 0.25


class StepCost:
    """A step's seconds as fixed + per_token x scheduled tokens, fitted by least squares to the engine's recent
    steps (each observation's weight decays by `decay` per step, so the fit follows the host). No fit until
    the steps seen span enough token counts to tell the two terms apart (decode-only steps alone do not)."""

    MIN_WEIGHT = 4.0  # observations' worth
    MIN_SPREAD = 8.0  # tokens: the weighted standard deviation of the token counts seen

    def __init__(self, decay: float = 0.99):
        assert 0 < decay < 1, decay
        self.decay = decay
        self.reset()

    def reset(self) -> None:
        self._w = self._n = self._t = self._nn = self._nt = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or not seconds > 0:
            return
        d = self.decay
        self._w = self._w * d + 1.0
        self._n = self._n * d + tokens
        self._t = self._t * d + seconds
        self._nn = self._nn * d + tokens * tokens
        self._nt = self._nt * d + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None while the steps seen cannot tell them apart."""
        if self._w < self.MIN_WEIGHT:
            return None
        mean_n = self._n / self._w
        var_n = self._nn / self._w - mean_n * mean_n
        if var_n < self.MIN_SPREAD**2:
            return None
        per_token = (self._nt / self._w - mean_n * self._t / self._w) / var_n
        if not per_token > 0 or not math.isfinite(per_token):
            return None
        return max(0.0, self._t / self._w - per_token * mean_n), per_token


class Scheduler:
    """Waiting and running queues under a token budget per step and a cap on running sequences.

    Running sequences go first (decodes and unfinished prefill chunks), then waiting ones are
    admitted FCFS while budget, sequence slots and blocks last; the last one admitted may get a partial chunk
    (chunked prefill). With partial_prefill "auto" a prompt that would be cut here waits for the next step
    instead when it runs whole there, `step_cost` says its chunk would lengthen this step by DEFER_SHARE or
    more, and the queue behind it is short enough that the budget left unused costs it less than the cut
    costs this step (`_defers`): on a compute-bound device the cut chunk delays the prompts and decodes that
    finish in this step, and the cut prompt gets its first token in the next step either way. "fill" always
    fills the budget (vLLM's chunked prefill). When a running sequence needs a
    block and none is free, the newest running sequence is preempted: by recompute (its blocks are
    freed, it waits again at the front), or with preemption "swap" by copying its computed blocks to
    the block manager's swap space (OffloadIndex) and back when it is rescheduled, before any waiting
    request is admitted. A victim whose blocks do not fit in the swap space left is recomputed
    (counted in OffloadIndex.swap_stats.fallbacks).
    """

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        preemption: str = "recompute",
        partial_prefill: str = "fill",
        step_cost: StepCost | None = None,
    ):
        if partial_prefill not in PARTIAL_PREFILL_MODES:
            raise ValueError(f"partial_prefill must be one of {PARTIAL_PREFILL_MODES}, got {partial_prefill!r}")
        if partial_prefill == "auto" and step_cost is None:
            raise ValueError('partial_prefill "auto" needs a step_cost to decide with')
        if preemption not in ("recompute", "swap"):
            raise ValueError(f"preemption must be recompute or swap, got {preemption!r}")
        if preemption == "swap" and (block_manager.offload is None or not block_manager.offload.swap_capacity):
            raise ValueError("preemption swap needs swap space (an OffloadIndex with swap_blocks > 0)")
        self.preemption = preemption
        self.partial_prefill = partial_prefill
        self.step_cost = step_cost
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.swapped: collections.deque[Sequence] = collections.deque()  # preempted to swap space, oldest first
        self.waiting_for_kv: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}  # finished, blocks kept for a KV transfer
        self.requests: dict[str, Sequence] = {}  # every unfinished or held request
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        self.num_deferred_prefills = 0  # steps in which the head of the queue waited rather than be cut

    # -- admission -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        assert seq.request_id not in self.requests, f"duplicate request id {seq.request_id!r}"
        assert seq.status == SequenceStatus.WAITING, f"{seq} is not new"
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_kv) + len(self.swapped)

    # -- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        kv_loads: list[KVLoad] = []

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            assert n > 0, f"{seq} is running with nothing to compute"
            while not self.bm.allocate(seq, seq.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                chunks.append(self._chunk(seq, n))
                budget -= n
                i += 1

        while (
            self.swapped
            and budget > 0
            and not preempted
            and len(self.running) + len(self.waiting_for_kv) < self.max_num_seqs
        ):
            seq = self.swapped[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.bm.allocate(seq, seq.num_computed_tokens + n):
                break
            self.swapped.popleft()
            self.bm.offload.swap_in(seq.swap_slots, seq.block_ids[: len(seq.swap_slots)])
            seq.swap_slots = []
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(self._chunk(seq, n))
            budget -= n

        while (
            self.waiting
            and not self.swapped
            and budget > 0
            and not preempted
            and len(self.running) + len(self.waiting_for_kv) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            assert seq.num_computed_tokens == 0 and not seq.block_ids, f"{seq} waits with KV"
            # At least the last token is computed here: its logits pick the next token.
            hits = self.bm.find_cached_prefix(seq, seq.num_tokens - 1) if seq.reads_prefix_cache else []
            num_cached = len(hits) * self.bm.block_size
            if seq.remote_kv_tokens > num_cached:
                if not self.bm.allocate(seq, seq.remote_kv_tokens, hits):
                    break
                self._admitted(seq, num_cached)
                seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
                self.waiting_for_kv[seq.request_id] = seq
                first = len(hits)
                kv_loads.append(
                    KVLoad(
                        seq.request_id,
                        seq.block_ids[first:],
                        first * self.bm.block_size,
                        seq.remote_kv_tokens - num_cached,
                    )
                )
                continue
            need = seq.num_tokens - num_cached
            n = min(need, budget)
            if n < need and self._defers(need, n, chunks):
                self.num_deferred_prefills += 1
                break
            if not self.bm.allocate(seq, num_cached + n, hits):
                break
            self._admitted(seq, num_cached)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(self._chunk(seq, n))
            budget -= n

        finished, self._finished_ids = self._finished_ids, []
        copies = self.bm.offload.take_copies() if self.bm.offload is not None else []
        return SchedulerOutput(
            chunks=chunks,
            num_batched_tokens=self.max_num_batched_tokens - budget,
            preempted_ids=[s.request_id for s in preempted],
            finished_ids=finished,
            kv_loads=kv_loads,
            copies=copies,
        )

    def _defers(self, need: int, chunk: int, chunks: list[ScheduledChunk]) -> bool:
        """partial_prefill auto: whether the head of the queue, needing `need` tokens of which `chunk` fit in this
        step, waits whole for the next step rather than be cut here.

        With the step's time as fixed + per_token x tokens: cutting adds per_token x chunk to this step, paid by
        every prompt that gets its first token in it (and every decode); waiting leaves that much of the budget
        unused, which under a queue costs each prompt behind it about fixed x chunk / budget (the share of one
        more step's fixed cost before it). The cut prompt finishes in the next step either way."""
        if self.partial_prefill != "auto" or not chunks:
            return False
        now = {c.request_id: len(c.token_ids) for c in chunks}
        next_step = sum(max(1, q.num_tokens - q.num_computed_tokens - now.get(q.request_id, 0)) for q in self.running)
        if need + next_step > self.max_num_batched_tokens:
            return False  # cut in the next step too: better to start now
        fit = self.step_cost.fit()
        if fit is None:
            return False
        fixed, per_token = fit
        scheduled = sum(now.values())
        if per_token * chunk < DEFER_SHARE * (fixed + per_token * scheduled):
            return False  # a small chunk next to the step: not worth a step of its own
        first_tokens = max(1, sum(1 for c in chunks if c.sample and len(c.token_ids) > 1))
        behind = len(self.waiting) - 1
        return fixed * behind <= per_token * self.max_num_batched_tokens * first_tokens

    def _admitted(self, seq: Sequence, num_cached: int) -> None:
        self.waiting.popleft()
        self.bm.record_query(seq.num_tokens, num_cached)
        seq.num_computed_tokens = seq.num_cached_tokens = num_cached
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(
            request_id=seq.request_id,
            token_ids=seq.token_ids[start : start + n],
            start_pos=start,
            block_ids=list(seq.block_ids),
            sample=start + n == seq.num_tokens,
            params=seq.params,
            num_output_tokens=seq.num_output_tokens,
        )

    def _preempt(self, seq: Sequence) -> None:
        """Swap out (preemption swap, while the swap space has room), else recompute later: give back
        every block and requeue at the front."""
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.preemption == "swap":
            off = self.bm.offload
            n = self.bm.blocks_needed(seq.num_computed_tokens)
            if n and off.can_swap(n):
                seq.swap_slots = off.swap_out(seq.block_ids[:n])
                self.bm.free(seq)
                seq.status = SequenceStatus.SWAPPED
                self.swapped.appendleft(seq)
                return
            if n:
                off.swap_stats.fallbacks += 1
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    # -- after the model ran ---------------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Sequence]:
        """Advance progress by what was computed, append sampled tokens and apply token-level
        stops. Returns the sequences that got a new token (finished ones included)."""
        now = time.monotonic()
        advanced: list[Sequence] = []
        for chunk in output.chunks:
            seq = self.requests.get(chunk.request_id)
            if seq is None or seq.status != SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed_tokens += len(chunk.token_ids)
            assert seq.num_computed_tokens <= seq.num_tokens, f"{seq} computed past its tokens"
            self.bm.cache_full_blocks(seq)
            if not chunk.sample:
                continue
            token = sampled[chunk.request_id]
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.inter_token_latency = None if seq.last_token_time is None else now - seq.last_token_time
            seq.last_token_time = now
            advanced.append(seq)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
        return advanced

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if p.stop_token_ids and token in p.stop_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take a sequence out of every queue; free its blocks unless it holds them for transfer."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == SequenceStatus.WAITING_FOR_REMOTE_KV:
            del self.waiting_for_kv[seq.request_id]
        elif seq.status == SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.bm.offload.drop_swap(seq.swap_slots)
            seq.swap_slots = []
        else:
            raise AssertionError(f"{seq} finished twice")
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.monotonic()
        self._finished_ids.append(seq.request_id)
        if seq.hold_kv and reason != FinishReason.ABORT and seq.block_ids:
            self.held[seq.request_id] = seq
        else:
            self.bm.free(seq)
            del self.requests[seq.request_id]

    def abort(self, request_id: str) -> Sequence | None:
        """Stop a request wherever it is; held KV blocks are released too. None if unknown."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        if seq.status == SequenceStatus.FINISHED:
            self.release_held(request_id)
            return None
        self.finish(seq, FinishReason.ABORT)
        return seq

    # -- prefill/decode disaggregation -----------------------------------------------------
    def remote_kv_done(self, request_id: str, ok: bool) -> Sequence:
        """The KV announced by a KVLoad arrived (ok) or did not (recompute it here)."""
        seq = self.waiting_for_kv.pop(request_id, None)
        if seq is None:
            raise KeyError(f"request {request_id!r} is not waiting for remote KV")
        if ok:
            seq.num_computed_tokens = seq.remote_kv_tokens
            self.bm.cache_full_blocks(seq)
        seq.remote_kv_tokens = 0
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return seq

    def release_held(self, request_id: str) -> bool:
        """Free the blocks a finished request kept for a KV transfer (ack or lease expiry)."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            return False
        self.bm.free(seq)
        del self.requests[request_id]
        return True
