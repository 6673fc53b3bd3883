"""The sampler's features (issue 27) held to transformers: logit_bias, repetition/presence/frequency penalties,
min_tokens, temperature, top-k, top-p and min-p on a mixed batch, exact against transformers' LogitsProcessors step
after step; greedy generation with them token-exact against HF generate; seeds; prompt logprobs against HF's forward
pass, through chunked prefill, a warm prefix cache and preemption."""

from __future__ import annotations

import pytest
import torch
from transformers.generation import logits_process as hf

from pdfleet_worker.layers.sampler import Sampler
from pdfleet_worker.sampling_params import SamplingParams
from tests.worker.oracle import random_prompts

EOS = 3
V = 384


def _reference(scores: torch.Tensor, prompt: list[int], outputs: list[int], p: SamplingParams) -> torch.Tensor:
    """transformers' processors in generate's order, one row; presence/frequency by OpenAI's formula."""
    ids = torch.tensor([prompt + outputs])
    x = scores.clone().unsqueeze(0)
    if p.logit_bias:
        x = hf.SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias.items()})(ids, x)
    if p.repetition_penalty != 1.0:
        x = hf.RepetitionPenaltyLogitsProcessor(float(p.repetition_penalty))(ids, x)
    if p.presence_penalty or p.frequency_penalty:
        counts = (
            torch.bincount(torch.tensor(outputs, dtype=torch.int64), minlength=V).unsqueeze(0)
            if outputs
            else torch.zeros(1, V, dtype=torch.int64)
        )
        x = x - torch.tensor([[p.frequency_penalty]]) * counts.int()
        x = x - torch.tensor([[p.presence_penalty]]) * (counts > 0)
    if p.min_tokens:
        x = hf.MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, [EOS] + list(p.stop_token_ids or ()))(
            ids, x
        )
    if not p.greedy:
        if p.temperature != 1.0:
            x = hf.TemperatureLogitsWarper(float(p.temperature))(ids, x)
        if p.top_k:
            x = hf.TopKLogitsWarper(p.top_k)(ids, x)
        if p.top_p < 1.0:
            x = hf.TopPLogitsWarper(p.top_p)(ids, x)
        if p.min_p:
            x = hf.MinPLogitsWarper(p.min_p)(ids, x)
    return x[0]


MIXED = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, logit_bias={5: 2.5, 7: -100.0, 11: 0.25}, top_k=20),
    SamplingParams(temperature=1.1, presence_penalty=0.5, frequency_penalty=0.8, top_p=0.9),
    SamplingParams(temperature=1.3, min_tokens=3, stop_token_ids=[9, 10], min_p=0.1),
    SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=-0.4),
    SamplingParams(
        temperature=0.9,
        logit_bias={2: 4.0},
        repetition_penalty=0.8,
        frequency_penalty=-0.3,
        top_k=50,
        top_p=0.8,
        min_p=0.05,
        min_tokens=2,
        seed=7,
    ),
]


# Every cut row has a top-k: the sampler takes the largest k with one topk instead of sorting the vocabulary.
ALL_TOP_K = [
    SamplingParams(temperature=0.8, top_k=5),
    SamplingParams(temperature=1.2, top_k=60, top_p=0.7, repetition_penalty=1.2),
    SamplingParams(temperature=1.0, top_k=300, top_p=0.95, min_p=0.02),
    SamplingParams(temperature=0, top_k=2, logit_bias={1: 9.0}),
    SamplingParams(temperature=0.5),
]


@pytest.mark.parametrize("batch", [MIXED, ALL_TOP_K], ids=["sorting", "topk"])
def test_batch_is_exact_against_transformers_processors_step_after_step(batch):
    g = torch.Generator().manual_seed(0)
    s = Sampler()
    s.eos_token_ids = (EOS,)
    prompts = random_prompts(len(batch), 4, 12, vocab=V, seed=11)
    ids = [f"r{i}" for i in range(len(batch))]
    for rid, prompt, p in zip(ids, prompts, batch):
        s.add(rid, prompt, p)
    outputs: list[list[int]] = [[] for _ in batch]
    for step in range(6):
        # NOTE: a few logits made large so that penalties and cut-offs change which tokens survive.
        logits = torch.randn(len(batch), V, generator=g) * 3
        logits[:, :16] += 4
        steps = [step] * len(batch)
        got = s.distribution(logits, ids, batch, steps)
        for i, (prompt, p) in enumerate(zip(prompts, batch)):
            want = _reference(logits[i], prompt, outputs[i], p)
            assert torch.equal(got[i], want), f"row {i} step {step}: {(got[i] - want).abs().nan_to_num().max()}"
            assert torch.isfinite(got[i]).sum() >= 1
        picked = s(logits, ids, batch, steps)
        for i, t in enumerate(picked):
            assert torch.isfinite(got[i][t.token_id]), f"row {i} picked an excluded token"
            outputs[i].append(t.token_id)
        if step < 3 and batch is MIXED:
            assert outputs[3][-1] not in (EOS, 9, 10), "min_tokens let a stop token through"


def test_a_tie_at_the_kth_value_keeps_every_tied_token_like_transformers():
    logits = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 1.0, 0.0, -1.0]])
    p = SamplingParams(temperature=1.0, top_k=3, top_p=0.99)
    got = Sampler().distribution(logits, ["t"], [p], [0])[0]
    assert torch.equal(got, _reference(logits[0], [], [], p))
    assert torch.isfinite(got).sum() == 5


def test_greedy_rows_pick_the_processed_argmax_and_counts_follow_the_output():
    s = Sampler()
    p = SamplingParams(temperature=0, frequency_penalty=2.0)
    logits = torch.zeros(1, V)
    logits[0, 10] = 1.0
    logits[0, 11] = 0.5
    picked = [s(logits, ["a"], [p], [i])[0].token_id for i in range(3)]
    # 10 wins once, then its count costs it 2.0 per use: 11 (0.5 - 0) beats 10 (1 - 2), then 0 (0) beats both
    assert picked == [10, 11, 0]
    s.forget("a")
    assert not s.counts.slot and s.counts.free, "a forgotten request's row is reused"


def test_seeded_rows_do_not_depend_on_the_batch_or_the_other_rows():
    s = Sampler()
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=1.0, seed=123)
    alone = [s(logits[:1], ["x"], [seeded], [k])[0].token_id for k in range(20)]
    mixed = [
        s(
            logits,
            ["x", "y", "z", "w"],
            [seeded, SamplingParams(), SamplingParams(seed=5), SamplingParams(temperature=0)],
            [k, 0, 3, 1],
        )[0].token_id
        for k in range(20)
    ]
    assert alone == mixed
    assert len(set(alone)) > 5, "draws at different steps differ"
    other = [s(logits[:1], ["x"], [SamplingParams(temperature=1.0, seed=124)], [k])[0].token_id for k in range(20)]
    assert other != alone


def test_seeded_draws_follow_the_distribution():
    """Uniform draws hashed from (seed, step) sample a known distribution: 4000 draws within 4 sigma of each mass."""
    s = Sampler()
    logits = torch.full((1, V), -30.0)
    logits[0, :4] = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.10]))
    draws = [s(logits, ["x"], [SamplingParams(seed=k)], [j])[0].token_id for k in range(200) for j in range(20)]
    n = len(draws)
    for token, mass in enumerate([0.5, 0.25, 0.15, 0.10]):
        sigma = (mass * (1 - mass) / n) ** 0.5
        assert abs(draws.count(token) / n - mass) < 4 * sigma, (token, draws.count(token) / n)


def _hf_generate(model, prompt: list[int], max_new: int, **kw) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, pad_token_id=0, **kw
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "kw,hf_kw",
    [
        (dict(repetition_penalty=1.8), dict(repetition_penalty=1.8)),
        (dict(logit_bias={17: 6.0, 40: 3.0}), dict(sequence_bias={(17,): 6.0, (40,): 3.0})),
        (dict(repetition_penalty=0.7, logit_bias={17: 2.0}), dict(repetition_penalty=0.7, sequence_bias={(17,): 2.0})),
    ],
)
def test_greedy_generation_with_processors_is_token_exact_against_hf_generate(tiny, make_engine, kw, hf_kw):
    eng = make_engine(tiny.path, max_num_batched_tokens=16)
    prompts = random_prompts(4, 3, 20, seed=5)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, **kw)
    got = [o.new_token_ids for o in eng.generate(prompts, params)]
    want = [_hf_generate(tiny, p, 12, **hf_kw) for p in prompts]
    assert got == want


def test_min_tokens_holds_eos_back_like_hf_min_new_tokens(llama, make_engine):
    """A model whose EOS is its favourite token: HF's min_new_tokens and the engine's min_tokens agree."""
    eng = make_engine(llama.path)
    prompt = random_prompts(1, 6, 6, seed=9)[0]
    eos = llama.oracle(prompt, 1).tokens[0]  # the first greedy token, made the EOS
    eng.scheduler.eos_token_ids = frozenset({eos})
    eng.sampler.eos_token_ids = (eos,)
    plain = eng.generate([prompt], SamplingParams(max_tokens=10, temperature=0))[0]
    assert plain.new_token_ids == [eos] and plain.finish_reason == "stop"
    held = eng.generate([prompt], SamplingParams(max_tokens=10, temperature=0, min_tokens=4))[0]
    want = _hf_generate(llama, prompt, 10, min_new_tokens=4, eos_token_id=eos)
    assert held.new_token_ids == want[: len(held.new_token_ids)] and len(held.new_token_ids) >= 4
    assert eos not in held.new_token_ids[:4]


def test_plain_requests_stay_token_exact_with_featured_ones_in_the_batch(tiny, make_engine):
    """Sampler changes keep plain greedy rows exact against the oracle, whatever shares their batch."""
    eng = make_engine(tiny.path)
    prompts = random_prompts(4, 3, 16, seed=21)
    plain = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    busy = SamplingParams(
        max_tokens=8,
        temperature=1.2,
        top_k=30,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.4,
        presence_penalty=1.0,
        logit_bias={3: 5.0},
        seed=3,
        ignore_eos=True,
    )
    outs = eng.generate(prompts + prompts, [plain] * 4 + [busy] * 4)
    for p, out in zip(prompts, outs[:4]):
        assert out.new_token_ids == tiny.oracle(p, 8).tokens


def _hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model.hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1)  # [T, V]: row p predicts token p + 1


def _check_prompt_logprobs(model, prompt: list[int], entries, n: int) -> None:
    ref = _hf_prompt_logprobs(model, prompt)
    assert entries[0] is None and len(entries) == len(prompt)
    for p in range(1, len(prompt)):
        e, want = entries[p], ref[p - 1]
        assert e.token_id == prompt[p]
        assert abs(e.logprob - float(want[prompt[p]])) < 1e-4
        assert e.rank == int((want > want[prompt[p]]).sum()) + 1
        assert [t for t, _ in e.top] == torch.topk(want, n).indices.tolist()


def test_prompt_logprobs_match_hf_through_chunked_prefill_and_a_warm_prefix_cache(tiny, make_engine):
    eng = make_engine(tiny.path, max_num_batched_tokens=16, block_size=4, enable_prefix_caching=True)
    prompts = random_prompts(3, 20, 45, seed=8)
    eng.generate(prompts, SamplingParams(max_tokens=2, temperature=0))  # the prefix cache now holds them
    outs = eng.generate(prompts, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))
    for prompt, out in zip(prompts, outs):
        assert out.num_cached_tokens == 0, "prompt logprobs need every prompt position computed"
        _check_prompt_logprobs(tiny, prompt, out.prompt_logprobs, 3)
    assert not eng.sampler.prompts, "scored prompts leave no state behind"


def test_prompt_logprobs_survive_preemption(llama, make_engine):
    """A pool too small for all of them: sequences are preempted and recomputed; each prompt is scored once."""
    eng = make_engine(llama.path, num_kv_blocks=14, block_size=4, max_num_batched_tokens=12)
    prompts = random_prompts(4, 10, 14, seed=13)
    outs = eng.generate(prompts, SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0, ignore_eos=True))
    assert eng.stats().num_preemptions_total > 0
    for prompt, out in zip(prompts, outs):
        _check_prompt_logprobs(llama, prompt, out.prompt_logprobs, 0)


def test_bad_params_are_refused_naming_the_field(llama, make_engine):
    for kw, field in [
        (dict(min_p=1.5), "min_p"),
        (dict(min_tokens=20, max_tokens=4), "min_tokens"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(presence_penalty=float("nan")), "presence_penalty"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    eng = make_engine(llama.path)
    with pytest.raises(ValueError, match="logit_bias"):
        eng.add_request("x", [1, 2], SamplingParams(logit_bias={V + 5: 1.0}))
