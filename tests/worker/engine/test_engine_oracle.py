"""Engine vs the transformers oracle (fp32, greedy, identical weights) under every batching feature."""

from __future__ import annotations

import pytest

from pdfleet_worker.sampling_params import SamplingParams
from tests.worker.oracle import GREEDY, MAX_NEW, compare, random_prompts, run_and_capture

MIXED = random_prompts(6, 1, 40, seed=1)


def test_matches_transformers_greedy(tiny, make_engine):
    """Llama (GQA, head_dim != hidden/heads, llama3 RoPE, rope_theta 5e5, untied) and Qwen2 (qkv
    bias, MQA, tied, rope_theta 1e6, sharded checkpoint): tokens exact, logits within 1e-4."""
    eng = make_engine(tiny.path)
    tokens, logits, reasons = run_and_capture(eng, MIXED)
    cmp = compare(tiny, MIXED, tokens, logits)
    assert reasons == ["length"] * len(MIXED)
    assert cmp.near_ties <= 1, cmp
    print(f"{tiny.name}: {cmp}")


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_attention_backends_agree(llama, make_engine, backend):
    eng = make_engine(llama.path, attention_backend=backend, max_num_batched_tokens=16, block_size=4)
    tokens, logits, _ = run_and_capture(eng, MIXED)
    assert compare(llama, MIXED, tokens, logits).near_ties <= 1


def test_flex_backend_agrees(llama, make_engine):
    """The CUDA path's FlexAttention code, run eagerly on CPU, computes the same attention."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    eng = make_engine(llama.path, attention_backend="flex", max_num_batched_tokens=16, block_size=4)
    prompts = MIXED[:3]
    tokens, logits, _ = run_and_capture(eng, prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert compare(llama, prompts, tokens, logits, max_new=4).near_ties <= 1


@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_chunked_prefill_budgets(tiny, make_engine, budget):
    eng = make_engine(tiny.path, max_num_batched_tokens=budget)
    tokens, logits, _ = run_and_capture(eng, MIXED)
    assert compare(tiny, MIXED, tokens, logits).near_ties <= 1


class ComputeBound:
    """A step cost that always reads compute-bound (no fixed cost): partial prefill auto waits wherever it may."""

    def observe(self, tokens: int, seconds: float) -> None:
        pass

    def reset(self) -> None:
        pass

    def fit(self) -> tuple[float, float]:
        return 0.0, 1.0


def test_partial_prefill_auto_leaves_prompts_whole_and_matches(tiny, make_engine):
    """Prompts that wait whole for the next step (partial_prefill auto) decode the same tokens as transformers."""
    eng = make_engine(tiny.path, max_num_batched_tokens=32, partial_prefill="auto")
    eng.scheduler.step_cost = ComputeBound()
    tokens, logits, _ = run_and_capture(eng, MIXED)
    assert eng.stats().num_deferred_prefills_total > 0
    assert compare(tiny, MIXED, tokens, logits).near_ties <= 1


@pytest.mark.parametrize("block_size", [1, 16, 7])
def test_block_sizes(tiny, make_engine, block_size):
    """7 divides none of the prompt lengths used here, so blocks end mid-prompt and mid-output."""
    prompts = [p for p in MIXED if len(p) % 7] or MIXED
    eng = make_engine(tiny.path, block_size=block_size, max_num_batched_tokens=32)
    tokens, logits, _ = run_and_capture(eng, prompts)
    assert compare(tiny, prompts, tokens, logits).near_ties <= 1


def test_prefix_caching_hits_equal_shared_full_blocks(tiny, make_engine):
    bs = 4
    shared = random_prompts(1, 23, 23, seed=7)[0]  # 5 full blocks + 3 tokens
    tails = random_prompts(3, 2, 9, seed=8)
    prompts = [shared + t for t in tails]
    eng = make_engine(tiny.path, block_size=bs)
    first_tokens, first_logits, _ = run_and_capture(eng, prompts[:1])
    assert eng.stats().prefix_cache_hits_total == 0
    rest_tokens, rest_logits, _ = run_and_capture(eng, prompts[1:])
    s = eng.stats()
    shared_full_block_tokens = (len(shared) // bs) * bs
    assert s.prefix_cache_hits_total == shared_full_block_tokens * 2
    assert s.prefix_cache_queries_total == sum(len(p) for p in prompts)
    compare(tiny, prompts, first_tokens + rest_tokens, first_logits + rest_logits)
    # The same prompt again hits every full block but the one holding its last token.
    again, again_logits, _ = run_and_capture(eng, prompts[:1])
    assert eng.stats().prefix_cache_hits_total - s.prefix_cache_hits_total == ((len(prompts[0]) - 1) // bs) * bs
    compare(tiny, prompts[:1], again, again_logits)


def test_prefix_hits_on_generated_tokens(llama, make_engine):
    """Blocks filled by generated tokens are cached too: a follow-up turn reuses them."""
    eng = make_engine(llama.path, block_size=4)
    p = random_prompts(1, 10, 10, seed=3)[0]
    (out,), _, _ = run_and_capture(eng, [p])
    follow = p + out + [5, 6, 7]
    before = eng.stats().prefix_cache_hits_total
    tokens, logits, _ = run_and_capture(eng, [follow])
    assert eng.stats().prefix_cache_hits_total - before == ((len(p) + len(out) - 1) // 4) * 4
    compare(llama, [follow], tokens, logits)


def test_forced_preemption_tiny_pool(tiny, make_engine):
    prompts = random_prompts(6, 8, 20, seed=5)
    # 10 blocks of 4 = 40 tokens: any one request fits (<= 32 tokens), three at once do not.
    eng = make_engine(tiny.path, block_size=4, num_kv_blocks=10, max_num_batched_tokens=64)
    tokens, logits, _ = run_and_capture(eng, prompts)
    assert eng.stats().num_preemptions_total > 0
    assert compare(tiny, prompts, tokens, logits).near_ties <= 1


def test_abort_mid_generation(llama, make_engine):
    prompts = random_prompts(4, 5, 30, seed=9)
    eng = make_engine(llama.path, block_size=4, max_num_batched_tokens=32)

    def abort_r1(engine, steps):
        if steps == 4:
            assert engine.abort("r1")
            assert not engine.abort("r1")

    tokens, logits, reasons = run_and_capture(eng, prompts, on_step=abort_r1)
    assert reasons[1] == "abort" and len(tokens[1]) < MAX_NEW
    # The aborted request's partial output is still the oracle's prefix.
    ref = llama.oracle(prompts[1])
    assert tokens[1] == ref.tokens[: len(tokens[1])]
    keep = [0, 2, 3]
    compare(llama, [prompts[i] for i in keep], [tokens[i] for i in keep], [logits[i] for i in keep])
    assert eng.stats().request_success_total["abort"] == 1


def test_max_num_seqs_and_late_arrivals(llama, make_engine):
    """Requests join while others decode; at most max_num_seqs run at once."""
    prompts = random_prompts(5, 3, 25, seed=11)
    eng = make_engine(llama.path, max_num_seqs=2, max_num_batched_tokens=8, block_size=4)
    running = []

    def watch(engine, steps):
        running.append(engine.stats().num_requests_running)
        if steps == 3:
            engine.add_request("late", prompts[0], GREEDY)

    extra: dict[str, list[int]] = {}
    tokens, logits, _ = run_and_capture(eng, prompts, on_step=watch, extra=extra)
    assert max(running) == 2
    compare(llama, prompts, tokens, logits)
    assert extra["late"] == tokens[0]


def test_int8_kv_cache_close(llama, make_engine):
    """int8 KV with per-block scales is lossy: logits stay close, most tokens agree."""
    eng = make_engine(llama.path, kv_cache_dtype="int8", block_size=4, max_num_batched_tokens=16)
    tokens, logits, _ = run_and_capture(eng, MIXED)
    worst, agree, total = 0.0, 0, 0
    for p, toks, rows in zip(MIXED, tokens, logits):
        ref = llama.oracle(p)
        for j, (a, b) in enumerate(zip(toks, ref.tokens)):
            worst = max(worst, float((rows[j] - ref.logits[j]).abs().max()))
            total += 1
            if a != b:
                break
            agree += 1
    scale = max(float(ref.logits[0].abs().max()) for ref in (llama.oracle(p) for p in MIXED))
    assert worst < 0.05 * scale, (worst, scale)
    assert agree >= 0.7 * len(MIXED) * MAX_NEW, (agree, total)


def test_bf16_runs_close_to_fp32(llama, make_engine):
    eng = make_engine(llama.path, dtype="bfloat16")
    tokens, logits, _ = run_and_capture(eng, MIXED[:3])
    for p, rows in zip(MIXED[:3], logits):
        ref = llama.oracle(p)
        diff = float((rows[0] - ref.logits[0]).abs().max())
        assert diff < 0.05 * float(ref.logits[0].abs().max()) + 0.05, diff
