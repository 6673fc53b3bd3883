"""Scheduler unit tests with fake model outputs: budgets, chunking, preemption, remote and held KV. No torch."""

from __future__ import annotations

import pytest

from pdfleet_worker.engine.block_manager import BlockManager
from pdfleet_worker.engine.scheduler import Scheduler, StepCost
from pdfleet_worker.engine.sequence import Sequence, SequenceStatus
from pdfleet_worker.sampling_params import SamplingParams


def make(num_blocks=16, bs=4, budget=8, max_seqs=4, max_len=64):
    bm = BlockManager(num_blocks, bs)
    return Scheduler(
        bm, max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len, eos_token_ids=(0,)
    )


def add(s, rid, n, max_tokens=3, **kw):
    seq = Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, temperature=0), **kw)
    s.add(seq)
    return seq


def step(s, token=7):
    out = s.schedule()
    sampled = {c.request_id: token for c in out.chunks if c.sample}
    s.update(out, sampled)
    return out


def test_chunked_prefill_respects_budget_and_decodes_go_first():
    s = make(budget=8)
    a = add(s, "a", 3)
    out = step(s)
    assert [(c.request_id, len(c.token_ids), c.sample) for c in out.chunks] == [("a", 3, True)]
    add(s, "b", 20)
    out = step(s)
    # a decodes (1 token), b gets the remaining 7 of the budget
    assert [(c.request_id, len(c.token_ids), c.start_pos, c.sample) for c in out.chunks] == [
        ("a", 1, 3, True),
        ("b", 7, 0, False),
    ]
    out = step(s)
    assert [(c.request_id, len(c.token_ids), c.start_pos) for c in out.chunks] == [("a", 1, 4), ("b", 7, 7)]
    assert a.is_finished and a.finish_reason.value == "length" and a.output_token_ids == [7, 7, 7]
    out = step(s)
    assert [(c.request_id, len(c.token_ids), c.sample) for c in out.chunks] == [("b", 6, True)]
    while s.num_unfinished:
        step(s)
    assert s.bm.is_whole() and not s.requests


def test_max_num_seqs():
    s = make(budget=64, max_seqs=2)
    for i in range(4):
        add(s, f"r{i}", 2, max_tokens=2)
    out = step(s)
    assert [c.request_id for c in out.chunks] == ["r0", "r1"]
    assert len(s.running) == 2 and len(s.waiting) == 2


def test_eos_and_stop_token_ids():
    s = make()
    a = add(s, "a", 2, max_tokens=10)
    step(s, token=0)
    assert a.finish_reason.value == "stop"
    b = Sequence("b", [1, 2], SamplingParams(max_tokens=10, stop_token_ids=[9]))
    s.add(b)
    step(s, token=9)
    assert b.finish_reason.value == "stop"
    c = Sequence("c", [1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    s.add(c)
    step(s, token=0)
    step(s, token=0)
    assert c.finish_reason.value == "length" and c.output_token_ids == [0, 0]
    assert s.bm.is_whole()


def test_model_length_stops():
    s = make(max_len=6)
    a = add(s, "a", 4, max_tokens=100)
    for _ in range(3):
        step(s)
    assert a.is_finished and a.num_tokens == 6 and a.finish_reason.value == "length"


def test_preemption_by_recompute_newest_first():
    s = make(num_blocks=4, bs=2, budget=16)
    a = add(s, "a", 3, max_tokens=4)  # needs up to 4 blocks alone
    b = add(s, "b", 3, max_tokens=4)
    step(s)  # both prefilled: a 2 blocks, b 2 blocks
    assert a.block_ids == [0, 1] and b.block_ids == [2, 3]
    assert step(s).preempted_ids == []  # position 3 still fits in 2 blocks each
    out = step(s)  # position 4 needs a 3rd block for a: b (newest) goes
    assert out.preempted_ids == ["b"]
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0 and not b.block_ids
    assert s.waiting[0] is b and s.num_preemptions == 1 and b.num_preemptions == 1
    assert [c.request_id for c in out.chunks] == ["a"]
    while s.num_unfinished:
        step(s)
    assert a.output_token_ids == [7] * 4 and b.output_token_ids == [7] * 4
    assert s.bm.is_whole()


def test_lone_sequence_that_cannot_grow_preempts_itself_and_recovers():
    s = make(num_blocks=3, bs=2, budget=16)
    a = add(s, "a", 3, max_tokens=3)
    step(s)
    holder = Sequence("x", [1, 2], SamplingParams())
    assert s.bm.allocate(holder, 2)  # someone else (a transfer) holds one block
    assert step(s).preempted_ids == [] and a.num_computed_tokens == 4
    out = step(s)
    assert out.preempted_ids == ["a"] and not out.chunks
    s.bm.free(holder)
    while s.num_unfinished:
        step(s)
    assert a.output_token_ids == [7, 7, 7] and s.bm.is_whole()


def test_abort_in_every_state():
    s = make(budget=4)
    r = add(s, "run", 2, max_tokens=10)
    w = add(s, "wait", 30, max_tokens=10)
    step(s)
    assert r.status == SequenceStatus.RUNNING and w.status == SequenceStatus.RUNNING  # w partially prefilled
    q = add(s, "queued", 2)
    assert s.abort("wait") is w and w.finish_reason.value == "abort"
    assert s.abort("queued") is q
    assert s.abort("run") is r
    assert s.abort("nope") is None
    assert s.bm.is_whole() and not s.requests and s.num_unfinished == 0
    out = s.schedule()
    assert set(out.finished_ids) == {"run", "wait", "queued"}


def test_remote_kv_admission_then_catch_up():
    s = make(budget=8)
    a = add(s, "a", 10, max_tokens=2, remote_kv_tokens=9)
    out = s.schedule()
    assert not out.chunks and len(out.kv_loads) == 1
    load = out.kv_loads[0]
    assert (load.block_ids, load.first_token, load.num_tokens) == ([0, 1, 2], 0, 9)
    assert a.status == SequenceStatus.WAITING_FOR_REMOTE_KV
    assert not s.schedule().chunks  # still waiting: nothing to run
    s.remote_kv_done("a", ok=True)
    out = step(s)
    assert [(c.start_pos, len(c.token_ids), c.sample) for c in out.chunks] == [(9, 1, True)]
    step(s)
    assert a.is_finished and s.bm.is_whole()


def test_remote_kv_failure_recomputes_locally():
    s = make(budget=8)
    a = add(s, "a", 10, max_tokens=1, remote_kv_tokens=9)
    s.schedule()
    s.remote_kv_done("a", ok=False)
    out = step(s)
    assert [(c.start_pos, len(c.token_ids)) for c in out.chunks] == [(0, 8)]
    step(s)
    assert a.is_finished and s.bm.is_whole()


def test_hold_kv_keeps_blocks_until_released():
    s = make()
    a = add(s, "a", 6, max_tokens=1, hold_kv=True)
    step(s)
    assert a.is_finished and s.held["a"] is a and a.block_ids == [0, 1]
    assert s.bm.num_free_blocks == 14 and s.num_unfinished == 0
    assert s.release_held("a") and not s.release_held("a")
    assert s.bm.is_whole() and not s.requests


def test_abort_releases_held_kv():
    s = make()
    add(s, "a", 6, max_tokens=1, hold_kv=True)
    step(s)
    assert s.abort("a") is None and s.bm.is_whole()


def test_prefix_stats_count_admissions_only():
    s = make(num_blocks=4, bs=2, budget=16, max_seqs=1)
    add(s, "a", 4, max_tokens=1)
    add(s, "b", 4, max_tokens=1)
    step(s)  # b cannot be admitted (max_num_seqs), must not be counted yet
    assert s.bm.stats.requests == 1 and s.bm.stats.queries == 4
    step(s)
    assert s.bm.stats.requests == 2 and s.bm.stats.hits == 2  # b shares a's first full block


# -- partial prefill: cut the last prompt, or leave it whole for the next step -----------------------------
def fitted(fixed_s: float, per_token_s: float) -> StepCost:
    """A step cost fitted to exact observations at two token counts."""
    cost = StepCost()
    for _ in range(4):
        for n in (2, 40):
            cost.observe(n, fixed_s + per_token_s * n)
    return cost


def test_step_cost_fits_fixed_and_per_token_and_waits_for_spread():
    cost = StepCost()
    assert cost.fit() is None
    for _ in range(20):
        cost.observe(16, 0.025)  # decode-only steps: one token count says nothing about the slope
    assert cost.fit() is None
    for _ in range(3):
        cost.observe(512, 0.25)
    fixed, per_token = cost.fit()
    assert abs(per_token - (0.25 - 0.025) / (512 - 16)) < 1e-9
    assert abs(fixed + per_token * 16 - 0.025) < 1e-9
    cost.observe(0, 1.0)  # an empty step is not a sample
    assert cost.fit() == (fixed, per_token)
    cost.reset()
    assert cost.fit() is None


def test_step_cost_follows_the_host():
    cost = fitted(0.01, 0.001)
    for _ in range(600):  # the host got twice as slow
        for n in (2, 40):
            cost.observe(n, 2 * (0.01 + 0.001 * n))
    fixed, per_token = cost.fit()
    assert abs(per_token - 0.002) < 1e-6 and abs(fixed - 0.02) < 1e-5


def schedule_two_prompts(partial_prefill: str, cost: StepCost | None, *, b_len: int = 6):
    """Budget 10: a decodes (1 token), c's 5-token prompt fits whole, b's would be cut at 4."""
    s = Scheduler(
        BlockManager(32, 4),
        max_num_seqs=4,
        max_num_batched_tokens=10,
        max_model_len=64,
        eos_token_ids=(0,),
        partial_prefill=partial_prefill,
        step_cost=cost,
    )
    add(s, "a", 3, max_tokens=10)
    step(s)
    add(s, "c", 5)
    s.add(Sequence("b", list(range(100, 100 + b_len)), SamplingParams(max_tokens=3, temperature=0)))  # no shared prefix
    return s, step(s)


def test_fill_cuts_the_last_prompt():
    s, out = schedule_two_prompts("fill", fitted(0.001, 0.01))
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 1), ("c", 5), ("b", 4)]
    assert s.num_deferred_prefills == 0


def test_auto_leaves_a_prompt_whole_for_the_next_step_on_a_compute_bound_device():
    s, out = schedule_two_prompts("auto", fitted(0.001, 0.01))
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 1), ("c", 5)]
    assert [q.request_id for q in s.waiting] == ["b"] and s.num_deferred_prefills == 1
    out = step(s)  # b runs whole next to two decodes: its first token comes in this step, as a cut b's would
    assert [(c.request_id, len(c.token_ids), c.sample) for c in out.chunks] == [
        ("a", 1, True),
        ("c", 1, True),
        ("b", 6, True),
    ]
    while s.num_unfinished:
        step(s)
    assert s.bm.is_whole() and not s.requests


def test_auto_cuts_where_the_step_cost_is_flat_or_unknown():
    # fixed cost dominates (a GPU far from compute-bound): the cut chunk is nearly free, so fill the step
    _, out = schedule_two_prompts("auto", fitted(0.020, 0.00001))
    assert [c.request_id for c in out.chunks] == ["a", "c", "b"]
    # no fit yet (only steps of one size seen): vLLM's behavior
    _, out = schedule_two_prompts("auto", StepCost())
    assert [c.request_id for c in out.chunks] == ["a", "c", "b"]


def test_auto_cuts_a_prompt_that_would_be_cut_in_the_next_step_too():
    # b needs 8: next step's two decodes leave 8 of the budget, so it fits and waits
    _, out = schedule_two_prompts("auto", fitted(0.001, 0.01), b_len=8)
    assert [c.request_id for c in out.chunks] == ["a", "c"]
    # b needs 9: it would be cut next step as well, so it starts now
    _, out = schedule_two_prompts("auto", fitted(0.001, 0.01), b_len=9)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 1), ("c", 5), ("b", 4)]


def test_auto_cuts_when_the_queue_behind_would_pay_more_than_the_step_gains():
    def with_queue(behind: int):
        s = Scheduler(
            BlockManager(64, 4),
            max_num_seqs=16,
            max_num_batched_tokens=10,
            max_model_len=64,
            partial_prefill="auto",
            step_cost=fitted(0.03, 0.01),
        )
        add(s, "a", 3, max_tokens=10)
        step(s)
        add(s, "c", 5)
        for i in range(behind + 1):  # b first, then the queue behind it
            s.add(Sequence(f"b{i}", list(range(100 * (i + 1), 100 * (i + 1) + 6)), SamplingParams(max_tokens=3)))
        return s, step(s)

    # waiting costs each prompt behind b0 ~ fixed x chunk / budget (0.012 s); cutting costs c 0.04 s: 3 behind wait
    s, out = with_queue(3)
    assert [c.request_id for c in out.chunks] == ["a", "c"] and s.num_deferred_prefills == 1
    # 4 behind (0.048 s in all) pay more than c gains: b0 is cut to fill the step
    s, out = with_queue(4)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 1), ("c", 5), ("b0", 4)]
    assert s.num_deferred_prefills == 0


def test_auto_does_not_defer_a_small_tail():
    # b's chunk of 4 tokens against a step of 6: under DEFER_SHARE when the fixed cost is large enough
    _, out = schedule_two_prompts("auto", fitted(0.2, 0.01))
    assert [c.request_id for c in out.chunks] == ["a", "c", "b"]


def test_partial_prefill_modes_are_checked():
    with pytest.raises(ValueError, match="partial_prefill must be one of"):
        Scheduler(BlockManager(4, 4), max_num_seqs=1, max_num_batched_tokens=4, max_model_len=8, partial_prefill="x")
    with pytest.raises(ValueError, match="needs a step_cost"):
        Scheduler(BlockManager(4, 4), max_num_seqs=1, max_num_batched_tokens=4, max_model_len=8, partial_prefill="auto")
