"""One simulated worker replica: the engine's continuous batching, token budget and KV capacity as an aggregate model.

The scheduler rules are the engine's (`pdfleet_worker.engine.scheduler`, vLLM v1 style): every step
first gives each running sequence its one decode token, then spends what is left of the token budget
on prompt chunks in FIFO order (chunked prefill), admitting a waiting request only when a sequence
slot and KV for its context are free (on a pdfleet engine, a prompt the budget would cut waits whole for
the next step when it runs whole there, the step-time model says the cut would lengthen this step by a
quarter or more and the queue behind it is short, as the engine's partial prefill auto does by its measured
step cost); when the KV of the running batch no longer fits, the newest
sequence is preempted and recomputed later, or with engine.preemption swap parked in the swap space
(bounded: a victim that does not fit is recomputed, as the engine does) and rejoins without recomputing
(the copy back is not timed: a memcpy of its KV, small next to a step). No prefix cache is modelled, so
engine.kvOffload (which keeps evicted prefix-cache blocks) changes nothing here.

Time advances two ways, so that a day of traffic costs events per request, not per token:
- while prompt tokens are to be computed the replica runs discrete steps (one event per step);
- while it only decodes, it runs *fluid*: all B running sequences gain one token per step of
  `step_time(B, KV)`, so the replica keeps a virtual clock V (steps done) and each sequence finishes
  at a known V. Events happen only at a completion, a KV overflow, or when new work arrives.
The KV a decoding batch holds is S0 + B x V (S0 summed at admission), so usage is exact at any time.

Requests live in `Requests` (parallel lists indexed by request id); a replica holds only ids.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from heapq import heappop, heappush
from typing import TYPE_CHECKING, Any

from pdfleet_operator.sim.perf_model import ReplicaPerf
from pdfleet_operator.sim.stats import bin_index

if TYPE_CHECKING:
    from pdfleet_operator.sim.router import Load, Pool
    from pdfleet_operator.sim.stats import Histogram

# Request status codes.
ACTIVE, DONE, REJECTED, TOO_LONG, UNFINISHED = 0, 1, 2, 3, 4
# Replica modes.
IDLE, STEPPING, FLUID = 0, 1, 2
# The engine's scheduler.DEFER_SHARE (the operator does not import the worker; a test keeps them equal).
DEFER_SHARE = 0.25
# The simulator's event kind of a replica's own events (`sim.simulator.REPLICA`).
EVENT = 0
# Tolerance on V (in decode steps) for float error over millions of steps.
_EPS = 1e-6


class Requests:
    """Per-request state as parallel lists (list indexing is what a Python DES does fastest)."""

    __slots__ = (
        "arrival",
        "prompt",
        "output",
        "t_first",
        "t_done",
        "status",
        "gen",
        "need",
        "ctx",
        "epoch",
        "v0",
        "c0",
        "preemptions",
        "second_gap",
        "deployment",
    )

    def __init__(self, arrival: list[float], prompt: list[int], output: list[int], deployment: list[int]) -> None:
        n = len(arrival)
        self.arrival, self.prompt, self.output, self.deployment = arrival, prompt, output, deployment
        nan = math.nan
        self.t_first = [nan] * n  # when the first token was produced
        self.t_done = [nan] * n
        self.status = [ACTIVE] * n
        self.gen = [0] * n  # output tokens produced so far
        self.need = [0] * n  # prompt tokens this request still has to compute where it waits
        self.ctx = [0] * n  # KV tokens it needs where it waits (or holds where it runs)
        self.epoch = [0] * n  # bumped on preemption: invalidates its entries in a running heap
        self.v0 = [0.0] * n  # replica V when it joined the running batch
        self.c0 = [0] * n  # its context when it joined
        self.preemptions = [0] * n
        self.second_gap = [nan] * n  # first token -> second token (the KV hand-off, in PD)
        self.deployment = deployment

    def __len__(self) -> int:
        return len(self.arrival)


class Replica:
    """One worker replica (prefill, decode or colocated) of one pool; driven by `Simulator` events.

    Its own events go on the simulator's heap as `(t, next(seq), EVENT, replica, version)` through `push`
    (`heapq.heappush` bound to the heap): an event whose version is no longer the replica's is stale.
    """

    __slots__ = (
        "id",
        "deployment",
        "role",
        "accelerator_class",
        "perf",
        "reqs",
        "push",
        "seq",
        "itl",
        "on_prefilled",
        "max_waiting",
        "created_at",
        "ready_at",
        "node",
        "draining",
        "removed_at",
        "waiting",
        "need_waiting",
        "prefilling",
        "running",
        "order",
        "B",
        "S0",
        "V",
        "kv_fixed",
        "t_last",
        "mode",
        "st",
        "st_bin",
        "version",
        "step_chunks",
        "step_decode",
        "inflight",
        "url",
        "prompt_tokens",
        "gen_tokens",
        "preempted",
        "deferred_prefills",
        "busy_s",
        "V0",
        "swapped",
        "swapped_tokens",
        "swap_fallbacks",
        "dirty",
        "load",
        "route_score",
        "route_at",
        "pool",
        "grouped",
    )

    def __init__(
        self,
        rid: int,
        deployment: int,
        role: str,
        accelerator_class: str,
        perf: ReplicaPerf,
        reqs: Requests,
        push: Callable[[tuple], None],
        seq: Iterator[int],
        itl: "Histogram",
        on_prefilled: Callable[["Replica", int, float], None],
        max_waiting: int,
        created_at: float,
        ready_at: float,
        node: str,
    ) -> None:
        self.id, self.deployment, self.role, self.accelerator_class = rid, deployment, role, accelerator_class
        self.perf, self.reqs, self.push, self.seq, self.itl = perf, reqs, push, seq, itl
        self.on_prefilled = on_prefilled
        self.max_waiting = max_waiting
        self.created_at, self.ready_at, self.node = created_at, ready_at, node
        self.draining = False
        self.removed_at: float | None = None
        self.waiting: deque[int] = deque()
        self.need_waiting = 0  # prompt tokens of the waiting requests
        self.prefilling: list[int] = []  # admitted, prompt partly computed (FIFO)
        self.running: list[tuple[float, int, int]] = []  # heap of (V at which it finishes, epoch, id)
        self.order: list[tuple[int, int]] = []  # (id, epoch) in admission order: the preemption victim is last
        self.B = 0  # running (decoding) sequences
        self.S0 = 0.0  # KV of the running batch is S0 + B * V
        self.V = 0.0  # decode steps done (fractional while fluid)
        self.V0 = 0.0  # sum of V at which each running sequence joined
        self.kv_fixed = 0  # KV of prefilling requests and of prompts held for a KV pull
        self.t_last = 0.0
        self.mode = IDLE
        self.st = 0.0  # step time while fluid
        self.st_bin = 0  # its bin in the ITL histogram
        self.version = 0  # bumps invalidate scheduled events
        self.step_chunks: list[tuple[int, int]] = []
        self.step_decode = 0
        self.inflight = 0  # requests routed here whose KV is still in transfer
        self.url = f"sim://replica-{rid:06d}"  # the router's name for it
        self.prompt_tokens = 0  # counters, as the worker's /metrics has them
        self.gen_tokens = 0
        self.preempted = 0
        self.swapped: dict[int, int] = {}  # preempted to swap space: request id -> KV tokens parked
        self.swapped_tokens = 0
        self.swap_fallbacks = 0
        self.busy_s = 0.0
        self.deferred_prefills = 0
        # the router's kept score (`sim.router`); `dirty`: what the router reads may have changed since
        self.load: Load | None = None
        self.route_score: tuple[Any, ...] = ()
        self.route_at = created_at
        self.dirty = True
        self.pool: Pool | None = None  # the router's `Pool` this replica is routable in
        self.grouped = False  # whether the pool holds it under `route_score`

    def touch(self) -> None:
        """What the router reads of this replica changed: its pool rescores it before the next pick."""
        if not self.dirty:
            self.dirty = True
            if self.pool is not None:
                self.pool.touched.append(self)

    # --- what the router and the metrics see ------------------------------------------------------
    def ready(self, now: float) -> bool:
        return not self.draining and self.removed_at is None and now >= self.ready_at

    def kv_used(self, now: float) -> float:
        v = self.V
        if self.mode == FLUID and self.st > 0:
            v += (now - self.t_last) / self.st
        return self.kv_fixed + self.S0 + self.B * v

    def generated(self, now: float) -> float:
        """Tokens generated so far, as a worker's counter has them (it counts every token as it is sampled):
        those of finished and preempted sequences plus what the running batch has made since joining."""
        v = self.V
        if self.mode == FLUID and self.st > 0:
            v += (now - self.t_last) / self.st
        return self.gen_tokens + max(0.0, self.B * v - self.V0)

    def kv_usage(self, now: float) -> float:
        return min(1.0, self.kv_used(now) / self.perf.kv_capacity_tokens)

    def queue_len(self) -> int:
        return len(self.waiting)

    def num_running(self) -> int:
        return self.B + len(self.prefilling)

    def idle(self) -> bool:
        return not self.waiting and not self.prefilling and self.B == 0 and self.kv_fixed == 0 and self.inflight == 0

    # --- input -------------------------------------------------------------------------------------
    def enqueue(self, rid: int, now: float, *, force: bool = False) -> bool:
        """A request routed here (need/ctx set by the caller); False when the waiting queue is full (503)."""
        waiting = self.waiting
        if not force and len(waiting) >= self.max_waiting:
            return False
        if not self.dirty:  # NOTE: touch() inlined here and in on_event (once or twice per request)
            self.dirty = True
            if self.pool is not None:
                self.pool.touched.append(self)
        waiting.append(rid)
        self.need_waiting += self.reqs.need[rid]
        if self.mode != STEPPING:
            self._advance(now)
            self._kick(now)
        return True

    def receive(self, rid: int, now: float) -> None:
        """A request whose KV was pulled here (need 0, ctx set by the caller) and that the router sent here before
        (`add_inflight(1)`) queues; a decode queue never drops a request mid-stream."""
        self.inflight -= 1
        if self.mode != FLUID or self.waiting:
            self.enqueue(rid, now, force=True)
            return
        # NOTE: enqueue + _kick's admission for the common case (a decoding replica with nothing waiting): it
        # joins now if a seat and its KV are free, else it waits; _kick then finds the same
        if not self.dirty:
            self.dirty = True
            if self.pool is not None:
                self.pool.touched.append(self)
        self._advance(now)
        p = self.perf
        B = self.B
        if B + len(self.prefilling) < p.max_num_seqs and (
            self.kv_fixed + self.S0 + B * self.V + self.reqs.ctx[rid] <= p.kv_capacity_tokens
        ):
            self._join(rid, now)
        else:
            self.waiting.append(rid)
            self.need_waiting += self.reqs.need[rid]
        self._kick(now)

    def release(self, tokens: int, now: float) -> None:
        """A decode replica finished pulling a held prompt's KV: its blocks are free again."""
        self.touch()
        self.kv_fixed -= tokens
        assert self.kv_fixed >= 0, f"replica {self.id}: released more KV than held"
        mode = self.mode
        if mode == FLUID or (mode == IDLE and self.waiting):
            self._advance(now)
            self._kick(now)
        elif mode == IDLE:
            # NOTE: _kick would find nothing to run and stay idle; only its version bump is skipped, and an
            # idle replica has no event of its current version waiting (its last _kick pushed none)
            self.t_last = now

    def hold(self, tokens: int) -> None:
        self.touch()
        self.kv_fixed += tokens

    def add_inflight(self, n: int) -> None:
        """Requests the router sent here that the engine does not see yet (HTTP hop, KV pull)."""
        self.touch()
        self.inflight += n

    # --- events ------------------------------------------------------------------------------------
    def on_event(self, now: float) -> None:
        """One of its events of the current `version` is due (the simulator drops the stale ones)."""
        if not self.dirty:
            self.dirty = True
            if self.pool is not None:
                self.pool.touched.append(self)
        if self.mode == STEPPING:
            self._finish_step(now)
        else:
            self._advance(now)
            self._complete(now)
            B = self.B
            if B and self.kv_fixed + self.S0 + B * self.V > self.perf.kv_capacity_tokens + _EPS:
                self._preempt(now)
        self._kick(now)

    # --- internals -----------------------------------------------------------------------------------
    def _advance(self, now: float) -> None:
        """Bring a fluid replica's virtual clock to `now` (events are scheduled so nothing finishes inside);
        not called while stepping."""
        if self.mode == FLUID:
            dt = now - self.t_last
            if dt > 0:
                steps = dt / self.st
                self.V += steps
                weight = self.B * steps
                if weight > 0:  # Histogram.add(st, weight) with st's bin kept
                    itl = self.itl
                    itl.counts[self.st_bin] += weight
                    itl.total += weight
                self.busy_s += dt
        self.t_last = now

    def _complete(self, now: float) -> None:
        running = self.running
        limit = self.V + _EPS
        if not running or running[0][0] > limit:
            return
        reqs = self.reqs
        epochs, gen, v0 = reqs.epoch, reqs.gen, reqs.v0
        while running and running[0][0] <= limit:
            _, epoch, rid = heappop(running)
            if epoch != epochs[rid]:
                continue
            self.B -= 1
            self.S0 -= reqs.c0[rid] - v0[rid]
            self.V0 -= v0[rid]
            out = reqs.output[rid]
            self.gen_tokens += out - gen[rid]
            gen[rid] = out
            epochs[rid] = epoch + 1
            reqs.status[rid] = DONE
            reqs.t_done[rid] = now
        if self.B == 0:
            self.S0, self.V0, self.order = 0.0, 0.0, []

    def _drop_stale_top(self) -> None:
        reqs, running = self.reqs, self.running
        while running and running[0][1] != reqs.epoch[running[0][2]]:
            heappop(running)

    def _preempt(self, now: float) -> None:
        """Out of KV for the running batch: recompute the newest sequence later (front of the queue)."""
        reqs = self.reqs
        while self.order:
            rid, epoch = self.order.pop()
            if epoch == reqs.epoch[rid]:
                break
        else:
            raise AssertionError(f"replica {self.id}: {self.B} running sequences but none to preempt")
        made = int(self.V - reqs.v0[rid] + _EPS)
        made = min(made, reqs.output[rid] - reqs.gen[rid] - 1)
        reqs.gen[rid] += made
        self.gen_tokens += made
        self.B -= 1
        self.S0 -= reqs.c0[rid] - reqs.v0[rid]
        self.V0 -= reqs.v0[rid]
        reqs.epoch[rid] += 1
        reqs.preemptions[rid] += 1
        self.preempted += 1
        reqs.ctx[rid] = reqs.prompt[rid] + reqs.gen[rid]
        reqs.need[rid] = reqs.ctx[rid]
        swap = self.perf.swap_space_tokens
        if swap:
            if self.swapped_tokens + reqs.ctx[rid] <= swap:  # its KV waits in swap space: nothing to recompute
                self.swapped[rid] = reqs.ctx[rid]
                self.swapped_tokens += reqs.ctx[rid]
                reqs.need[rid] = 0
            else:
                self.swap_fallbacks += 1
        self.waiting.appendleft(rid)
        self.need_waiting += reqs.need[rid]
        if self.B == 0:
            self.S0, self.V0, self.order = 0.0, 0.0, []

    def _join(self, rid: int, now: float) -> None:
        """A request whose prompt KV is all here starts decoding."""
        reqs = self.reqs
        gen = reqs.gen[rid]
        left = reqs.output[rid] - gen
        assert left > 0, f"request {rid} joins decoding with nothing left to generate"
        if self.swapped:
            self.swapped_tokens -= self.swapped.pop(rid, 0)
        V, ctx, epoch = self.V, reqs.ctx[rid], reqs.epoch[rid]
        reqs.v0[rid] = V
        reqs.c0[rid] = ctx
        self.S0 += ctx - V
        self.V0 += V
        B = self.B = self.B + 1
        heappush(self.running, (V + left, epoch, rid))
        self.order.append((rid, epoch))
        if gen == 1 and reqs.second_gap[rid] != reqs.second_gap[rid]:
            # NOTE: the first decode token comes one step after joining; the step time here is the
            # batch's current one, so the hand-off gap is exact up to that step's length.
            reqs.second_gap[rid] = now - reqs.t_first[rid] + self.perf.step_time(B, self.kv_fixed + self.S0 + B * V)

    def _admit_transferred(self, now: float) -> None:
        """Waiting requests whose KV arrived (need 0) join the batch while seats and KV allow, FIFO."""
        reqs, p, waiting = self.reqs, self.perf, self.waiting
        need, ctx = reqs.need, reqs.ctx
        seats = p.max_num_seqs - len(self.prefilling)
        while waiting and need[waiting[0]] == 0:
            rid = waiting[0]
            if self.B >= seats:
                return
            if self.kv_fixed + self.S0 + self.B * self.V + ctx[rid] > p.kv_capacity_tokens:
                return
            waiting.popleft()
            self._join(rid, now)

    def _kick(self, now: float) -> None:
        """Choose what runs next from `now`: a discrete step, a fluid decode phase, or nothing."""
        waiting, reqs = self.waiting, self.reqs
        if waiting and reqs.need[waiting[0]] == 0:
            self._admit_transferred(now)
        version = self.version = self.version + 1
        if self.prefilling:
            self._start_step(now)
            return
        p, B = self.perf, self.B
        kv_fixed, V = self.kv_fixed, self.V
        # NOTE: _has_prefill_work inlined (nothing is prefilling): a seat and KV for the head of the queue
        if waiting and B < p.max_num_seqs and kv_fixed + self.S0 + B * V + reqs.ctx[waiting[0]] <= p.kv_capacity_tokens:
            self._start_step(now)
            return
        running = self.running
        epochs = reqs.epoch
        while running and running[0][1] != epochs[running[0][2]]:  # _drop_stale_top
            heappop(running)
        self.t_last = now
        if B == 0:
            self.mode = IDLE
            return
        kv_run = self.S0 + B * V
        self.mode = FLUID
        st = self.st = p.step_time(B, kv_fixed + kv_run)
        self.st_bin = bin_index(st)
        steps = running[0][0] - V
        room = (p.kv_capacity_tokens - kv_fixed - kv_run) / B
        if room < steps:
            steps = (room if room > 0.0 else 0.0) + _EPS
        # NOTE: conditionals, not max(): the same values, without a builtin call per phase
        self.push((now + (steps if steps > 0.0 else 0.0) * st, next(self.seq), EVENT, self, version))

    def _start_step(self, now: float) -> None:
        """One discrete step: decode tokens for the batch, then prompt chunks within the budget."""
        reqs, p = self.reqs, self.perf
        self.mode = STEPPING
        self.t_last = now
        if self.running:
            self._drop_stale_top()
        while self.B and self.kv_fixed + self.S0 + self.B * (self.V + 1) > p.kv_capacity_tokens:
            self._preempt(now)
            self._drop_stale_top()
        budget = p.max_num_batched_tokens - self.B
        chunks: list[tuple[int, int]] = []
        need = reqs.need
        computed = 0
        prefilling = self.prefilling
        for rid in prefilling:
            if budget <= 0:
                break
            take = need[rid]
            if take > budget:
                take = budget
            chunks.append((rid, take))
            budget -= take
            computed += take
        waiting = self.waiting
        if waiting and budget > 0:
            ctx, cap, seats = reqs.ctx, p.kv_capacity_tokens, p.max_num_seqs
            while budget > 0 and waiting:
                rid = waiting[0]
                if self.B + len(prefilling) >= seats:
                    break
                if self.kv_fixed + self.S0 + self.B * (self.V + 1) + ctx[rid] > cap:
                    break
                take = need[rid]
                if take > budget and p.defers_partial_prefill and self._defers(take, budget, computed, chunks):
                    self.deferred_prefills += 1
                    break
                waiting.popleft()
                self.need_waiting -= take
                if take == 0:
                    self._join(rid, now)
                    continue
                self.kv_fixed += ctx[rid]
                prefilling.append(rid)
                if take > budget:
                    take = budget
                chunks.append((rid, take))
                budget -= take
                computed += take
        B = self.B
        if not computed and not B:
            self._kick(now)  # only transferred requests were admitted: they decode fluidly
            return
        dur = p.step_time(computed + B, self.kv_fixed + self.S0 + B * self.V)
        self.step_chunks, self.step_decode = chunks, B
        self.push((now + dur, next(self.seq), EVENT, self, self.version))

    def _defers(self, need: int, chunk: int, computed: int, chunks: list[tuple[int, int]]) -> bool:
        """The engine's partial prefill auto (`Scheduler._defers`) by this replica's step-time model: the head
        of the queue waits whole for the next step when it runs whole there, its chunk would lengthen this step
        by DEFER_SHARE or more, and the queue behind it pays less for the budget left unused (the step's fixed
        cost, `overhead_s`, times the chunk's share of a budget, each) than the prompts finishing in this step
        gain (the chunk's compute, `flop_s_per_token` a token, each)."""
        B, p = self.B, self.perf
        budget = p.max_num_batched_tokens
        if not computed + B or need + B + len(self.prefilling) > budget:
            return False
        context = self.kv_fixed + self.S0 + B * self.V
        now = p.step_time(computed + B, context)
        if p.step_time(computed + B + chunk, context) - now < DEFER_SHARE * now:
            return False
        needs = self.reqs.need
        first_tokens = 0
        for rid, take in chunks:
            if take == needs[rid]:
                first_tokens += 1
        return p.overhead_s * (len(self.waiting) - 1) <= p.flop_s_per_token * budget * (first_tokens or 1)

    def _finish_step(self, now: float) -> None:
        reqs = self.reqs
        dur = now - self.t_last
        self.busy_s += dur
        if self.step_decode:
            self.V += 1.0
            self.itl.add(dur, self.step_decode)
            self._complete(now)
        need, gen = reqs.need, reqs.gen
        prefill = self.role == "prefill"
        for rid, take in self.step_chunks:
            left = need[rid] - take
            need[rid] = left
            if left > 0:
                continue
            self.prefilling.remove(rid)
            self.kv_fixed -= reqs.ctx[rid]
            if gen[rid] == 0:  # a fresh prompt (not a recompute): its step also samples the first token
                self.prompt_tokens += reqs.prompt[rid]
                gen[rid] = 1
                self.gen_tokens += 1
                reqs.t_first[rid] = now
            if prefill or gen[rid] >= reqs.output[rid]:
                self.on_prefilled(self, rid, now)
            else:
                reqs.ctx[rid] = reqs.prompt[rid] + gen[rid]
                self._join(rid, now)
        self.t_last = now
