"""Engine API: input validation, sampling options, stop strings, logprobs, stats and the PD KV hooks."""

from __future__ import annotations

import pytest
import torch

from pdfleet_worker.engine.llm_engine import QueueFullError
from pdfleet_worker.sampling_params import SamplingParams
from tests.worker.oracle import GREEDY, random_prompts


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(stop=123), "stop"),
        (dict(stop=[""]), "stop"),
        (dict(stop=["a", 5]), "stop"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(stop_token_ids=["x"]), "stop_token_ids"),
        (dict(logprobs=-1), "logprobs"),
        (dict(seed="x"), "seed"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.timeout(60)
def test_bad_requests_raise_value_errors_naming_the_field(llama, make_engine):
    eng = make_engine(llama.path, num_kv_blocks=8, block_size=4, max_num_waiting=2)
    assert eng.max_model_len == 256  # the model's; the pool holds 32 tokens
    with pytest.raises(ValueError, match="prompt is empty"):
        eng.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="prompt has 300 tokens"):
        eng.add_request("a", list(range(300)), GREEDY)
    with pytest.raises(ValueError, match="prompt token ids"):
        eng.add_request("a", [1, 10**6], GREEDY)
    with pytest.raises(ValueError, match="prompt must be"):
        eng.add_request("a", 42, GREEDY)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        eng.add_request("a", [1, 2], SamplingParams(stop=["x"]))
    # An unsatisfiable request (more blocks than the pool) is refused up front, never queued forever.
    with pytest.raises(ValueError, match="prompt .40 tokens. plus max_tokens"):
        eng.add_request("a", list(range(40)), SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="max_tokens .30. needs 10 KV blocks but the pool has 8"):
        eng.add_request("a", list(range(10)), SamplingParams(max_tokens=30))
    assert not eng.has_unfinished_requests()
    capped = make_engine(llama.path, num_kv_blocks=8, block_size=4, max_model_len=20)
    out = capped.generate([list(range(10))], SamplingParams(max_tokens=30, temperature=0))[0]
    assert out.finish_reason == "length" and out.num_output_tokens == 10  # the model length caps it
    # Admission limit: the waiting queue is bounded.
    eng.add_request("q1", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("q1", [1, 2], GREEDY)
    eng.add_request("q2", [1, 2], GREEDY)
    with pytest.raises(QueueFullError):
        eng.add_request("q3", [1, 2], GREEDY)
    assert eng.abort("q1") and eng.abort("q2")
    eng.step()


def test_unknown_architecture_and_missing_files(llama, tmp_path):
    import json
    import shutil

    from pdfleet_worker.config import EngineConfig, ModelConfig
    from pdfleet_worker.engine.llm_engine import LLMEngine

    d = tmp_path / "m"
    shutil.copytree(llama.path, d)
    cfg = json.loads((d / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_dir(str(tmp_path))
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        LLMEngine(EngineConfig(model=str(d)))
    (d / "config.json").write_text(json.dumps(cfg))
    for f in d.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLMEngine(EngineConfig(model=str(d)))


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(llama, make_engine):
    eng = make_engine(llama.path)
    p = random_prompts(1, 8, 8, seed=2)[0]
    sp = SamplingParams(max_tokens=10, temperature=1.5, seed=42, ignore_eos=True)
    a = eng.generate([p], sp)[0].new_token_ids
    b = eng.generate([p, p], [sp, SamplingParams(max_tokens=10, temperature=1.5, seed=43, ignore_eos=True)])
    assert b[0].new_token_ids == a, "same seed, same tokens, even batched with others"
    assert b[1].new_token_ids != a
    greedy = llama.oracle(p, 10).tokens
    assert (
        eng.generate([p], SamplingParams(max_tokens=10, temperature=0.7, top_k=1, ignore_eos=True))[0].new_token_ids
        == greedy
    )
    assert (
        eng.generate([p], SamplingParams(max_tokens=10, temperature=0.7, top_p=1e-6, ignore_eos=True))[0].new_token_ids
        == greedy
    )


def test_top_k_and_top_p_restrict_the_support():
    from pdfleet_worker.layers.sampler import Sampler

    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(200, 1)
    s = Sampler()
    got = {t.token_id for t in s(logits, [str(i) for i in range(200)], [SamplingParams(temperature=1, top_k=2)] * 200)}
    assert got == {0, 1}
    # probs ~ [.64, .24, .09, ...]: top_p=0.8 keeps the first two
    got = {
        t.token_id for t in s(logits, [str(i) for i in range(200)], [SamplingParams(temperature=1, top_p=0.8)] * 200)
    }
    assert got == {0, 1}


def test_logprobs_match_the_oracle(llama, make_engine):
    eng = make_engine(llama.path)
    p = random_prompts(1, 6, 6, seed=4)[0]
    out = eng.generate([p], SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))[0]
    ref = llama.oracle(p)
    for j, lp in enumerate(out.logprobs):
        want = torch.log_softmax(ref.logits[j], -1)
        assert lp.token_id == out.new_token_ids[j]
        assert abs(lp.logprob - float(want[lp.token_id])) < 1e-4
        assert [t for t, _ in lp.top] == torch.topk(want, 3).indices.tolist()


def test_stats_count_tokens_and_latencies(llama, make_engine):
    eng = make_engine(llama.path)
    prompts = random_prompts(3, 4, 9, seed=6)
    ttfts, itls, finished = [], [], []
    for rid, p in zip("abc", prompts):
        eng.add_request(rid, p, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
        it = eng.last_iteration_stats
        ttfts += it.ttfts_s
        itls += it.inter_token_latencies_s
        finished += it.finished
    s = eng.stats()
    assert s.prompt_tokens_total == sum(map(len, prompts))
    assert s.generation_tokens_total == 15
    assert len(ttfts) == 3 and len(itls) == 12 and all(x >= 0 for x in ttfts + itls)
    assert sorted(f.request_id for f in finished) == ["a", "b", "c"]
    assert all(f.finish_reason == "length" and f.num_output_tokens == 5 for f in finished)
    assert s.request_success_total["length"] == 3 and s.kv_cache_usage == 0.0


def test_pd_transfer_between_engines(llama, make_engine):
    """Prefill engine holds KV; decode engine admits with remote KV, imports it and catches up."""
    p = random_prompts(1, 21, 21, seed=12)[0]
    prefill = make_engine(llama.path, block_size=4)
    decode = make_engine(llama.path, block_size=4)
    assert prefill.kv_layout().compat_hash == decode.kv_layout().compat_hash
    prefill.add_request("x", p, SamplingParams(max_tokens=1, temperature=0), hold_kv=True)
    outs = prefill.step()
    held = outs[0].held_kv
    assert outs[0].finished and held.num_tokens == len(p) and len(held.block_ids) == 6
    first = outs[0].new_token_ids[0]
    assert prefill.stats().num_held_blocks == 6
    # The decode side gets prompt + first token; the prompt's KV comes from the prefill worker.
    decode.add_request("x", p + [first], GREEDY, remote_kv_tokens=len(p))
    outs = decode.step()
    load = outs[0].kv_load
    assert load.num_tokens == len(p) and load.first_token == 0 and len(load.block_ids) == 6
    decode.import_kv(load.block_ids, prefill.export_kv(held.block_ids))
    assert prefill.release_held("x")
    decode.remote_kv_done("x", ok=True)
    rows: list = []
    decode.model_runner.logits_hook = lambda ids, logits: rows.append(logits[0].clone())
    tokens = []
    while decode.has_unfinished_requests():
        for o in decode.step():
            tokens += o.new_token_ids
    ref = llama.oracle(p, 1 + len(tokens))
    assert [first] + tokens == ref.tokens
    assert float((rows[0] - ref.logits[1]).abs().max()) < 1e-4
    assert decode.stats().prompt_tokens_total == 1  # only the token after the transferred KV ran here


def test_pd_transfer_failure_recomputes(llama, make_engine):
    p = random_prompts(1, 9, 9, seed=13)[0]
    decode = make_engine(llama.path, block_size=4)
    decode.add_request("x", p, GREEDY, remote_kv_tokens=8)
    assert decode.step()[0].kv_load is not None
    decode.remote_kv_done("x", ok=False)
    with pytest.raises(ValueError, match="not waiting"):
        decode.remote_kv_done("x", ok=True)
    tokens = []
    while decode.has_unfinished_requests():
        for o in decode.step():
            tokens += o.new_token_ids
    assert tokens == llama.oracle(p).tokens


def test_kv_import_rejects_incompatible_shapes(llama, make_engine):
    a = make_engine(llama.path, block_size=4)
    b = make_engine(llama.path, block_size=8)
    with pytest.raises(ValueError, match="expected"):
        b.import_kv([0], a.export_kv([0]))
    assert a.kv_layout().compat_hash != b.kv_layout().compat_hash


def test_batched_generate_mixed_params(llama, make_engine):
    """Greedy and sampled requests share a batch without disturbing the greedy ones."""
    eng = make_engine(llama.path)
    prompts = random_prompts(4, 3, 12, seed=14)
    params = [GREEDY, SamplingParams(max_tokens=12, temperature=1.0, seed=1, ignore_eos=True)] * 2
    outs = eng.generate(prompts, params)
    for i in (0, 2):
        assert outs[i].new_token_ids == llama.oracle(prompts[i]).tokens


def test_warm_up_runs_the_model_and_leaves_no_trace(llama, make_engine):
    """The server warms the engine before /ready; afterwards it counts, caches and answers like a fresh one."""
    warm, cold = make_engine(llama.path), make_engine(llama.path)
    assert warm.warm_up() > 0
    fresh = cold.stats()
    assert warm.stats() == fresh
    assert fresh.prompt_tokens_total == fresh.generation_tokens_total == fresh.prefix_cache_queries_total == 0
    prompts = random_prompts(3, 20, 40, seed=7)
    assert [o.new_token_ids for o in warm.generate(prompts, GREEDY)] == [
        o.new_token_ids for o in cold.generate(prompts, GREEDY)
    ]
    assert warm.stats() == cold.stats()
