"""The official openai SDK through the router of a 1 prefill + 1 decode pipeline: same greedy tokens as the engine alone
and as transformers, streaming and not; SSE framing, usage and [DONE]."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest

from tests.worker.processes import MODEL, pool_whole, wait_until, worker_urls

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MAX_NEW = 12
NEAR_TIE = 1e-4  # top-2 logit gap under which two correct fp32 kernels may pick differently
GREEDY = dict(temperature=0, max_tokens=MAX_NEW, extra_body={"ignore_eos": True, "return_token_ids": True})


@pytest.fixture(scope="module")
def client(pipeline) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{pipeline.router.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def engine_alone(model_dir):
    from pdfleet_worker.config import EngineConfig
    from pdfleet_worker.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=256, num_threads=1))


@pytest.fixture(scope="module")
def hf(model_dir):
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(hf, prompt: list[int], max_new: int = MAX_NEW) -> tuple[list[int], list]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return out.sequences[0, len(prompt) :].tolist(), [lg[0].float() for lg in out.logits]


def same_up_to_near_tie(got: list[int], want: list[int], logits: list, what: str) -> int:
    """Exact tokens, except that after a near-tie (top-2 gap < NEAR_TIE in the oracle) the rest may
    differ; returns how many tokens were compared. A mismatch that is no near-tie fails."""
    assert len(got) == len(want), f"{what}: {len(got)} tokens vs {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            top2 = torch.topk(logits[i], 2).values
            gap = float(top2[0] - top2[1])
            assert gap < NEAR_TIE, f"{what}: token {i} is {g}, expected {w} (oracle top-2 gap {gap:.2e})"
            return i
    return len(got)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 4096) for _ in range(length)] for length in (5, 37, 70)[:n]]


def test_sdk_through_pd_router_matches_engine_alone_and_transformers(pipeline, client, engine_alone, hf):
    from pdfleet_worker.sampling_params import SamplingParams

    for prompt in prompts(3, seed=1):
        full = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
        assert full.choices[0].finish_reason == "length"
        pd_tokens = full.choices[0].model_extra["token_ids"]
        assert full.usage.prompt_tokens == len(prompt) and full.usage.completion_tokens == MAX_NEW
        assert full.usage.total_tokens == len(prompt) + MAX_NEW

        streamed_ids, streamed_text, finish = [], [], []
        for chunk in client.completions.create(model=MODEL, prompt=prompt, stream=True, **GREEDY):
            ch = chunk.choices[0]
            streamed_ids += ch.model_extra["token_ids"]
            streamed_text.append(ch.text)
            finish.append(ch.finish_reason)
        assert streamed_ids == pd_tokens, "streamed tokens differ from the non-streamed answer"
        assert "".join(streamed_text) == full.choices[0].text, "deltas do not concatenate to the full text"
        assert finish[-1] == "length" and not any(finish[:-1]), "only the last choice chunk carries finish_reason"

        alone = engine_alone.generate([prompt], SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))[0]
        ref_tokens, ref_logits = hf_greedy(hf, prompt)
        same_up_to_near_tie(alone.new_token_ids, ref_tokens, ref_logits, "engine alone vs transformers")
        n = same_up_to_near_tie(pd_tokens, ref_tokens, ref_logits, "PD via router vs transformers")
        if n == MAX_NEW:
            assert pd_tokens == alone.new_token_ids, "PD and the engine alone differ without a near-tie"
        assert full.choices[0].text == engine_alone.tokenizer.decode(pd_tokens)
    # Prefill blocks were acked and freed, decode blocks freed: both pools whole again.
    wait_until(lambda: pool_whole(pipeline.prefill) and pool_whole(pipeline.decode), what="pools whole after PD")


def test_chat_stream_framing_usage_and_done(pipeline, client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert full.choices[0].message.role == "assistant"
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 10,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = []
    with httpx.stream("POST", f"{pipeline.router.url}/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["x-pdfleet-tier"] == "default" and "x-pdfleet-prefill" in resp.headers
        raw = resp.read().decode()
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    for block in raw.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            events.append(block[len("data: ") :])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant", "the first delta carries the role"
    choice_chunks = [c for c in chunks if c["choices"]]
    usage_chunks = [c for c in chunks if not c["choices"]]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1], "one usage chunk with choices: [] at the end"
    assert [c["choices"][0]["finish_reason"] for c in choice_chunks][-1] in ("stop", "length")
    assert all(c["choices"][0]["finish_reason"] is None for c in choice_chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in choice_chunks)
    assert text == full.choices[0].message.content
    assert usage_chunks[0]["usage"] == full.usage.model_dump(exclude_none=True) | {
        "prompt_tokens_details": {"cached_tokens": usage_chunks[0]["usage"]["prompt_tokens_details"]["cached_tokens"]}
    }
    assert usage_chunks[0]["usage"]["completion_tokens"] == full.usage.completion_tokens
    assert usage_chunks[0]["usage"]["prompt_tokens"] == full.usage.prompt_tokens

    # The SDK reads the same stream.
    parts = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == full.choices[0].message.content
    assert parts[-1].usage.completion_tokens == full.usage.completion_tokens


def test_colocated_tier_by_alias_and_header_gives_the_same_tokens(pipeline, client):
    prompt = prompts(2, seed=7)[1]
    pd = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    by_alias = client.completions.with_raw_response.create(model="tiny-colo", prompt=prompt, **GREEDY)
    assert by_alias.headers["x-pdfleet-tier"] == "colo"
    assert worker_urls(pipeline.router)[by_alias.headers["x-pdfleet-worker"]] == pipeline.colo.url
    colo = by_alias.parse()
    assert colo.model == MODEL, "the alias is rewritten to the model the tier serves"
    by_header = client.completions.create(
        model=MODEL, prompt=prompt, extra_headers={"x-pdfleet-tier": "colo"}, **GREEDY
    )
    assert colo.choices[0].model_extra["token_ids"] == by_header.choices[0].model_extra["token_ids"]
    # PD recomputes the last prompt token on the decode worker: equal unless a near-tie flips.
    assert pd.choices[0].model_extra["token_ids"][:4] == colo.choices[0].model_extra["token_ids"][:4]
    models = {m.id for m in client.models.list().data}
    assert {MODEL, "tiny-colo"} <= models
    with pytest.raises(openai.BadRequestError, match="unknown tier"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_headers={"x-pdfleet-tier": "gold"})


def test_pd_with_n_choices_and_prompt_lists(pipeline, client):
    batch = prompts(2, seed=3)
    resp = client.completions.create(model=MODEL, prompt=batch, n=2, **GREEDY)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.usage.prompt_tokens == sum(len(p) for p in batch)
    assert resp.usage.completion_tokens == 4 * MAX_NEW
    # greedy: both choices of a prompt agree, and each prompt matches its single-prompt answer
    assert resp.choices[0].model_extra["token_ids"] == resp.choices[1].model_extra["token_ids"]
    single = client.completions.create(model=MODEL, prompt=batch[1], **GREEDY)
    assert resp.choices[2].model_extra["token_ids"] == single.choices[0].model_extra["token_ids"]
    sampled = client.completions.create(
        model=MODEL, prompt=batch[0], n=2, temperature=1.0, seed=5, max_tokens=8, logprobs=2
    )
    assert all(len(c.logprobs.tokens) == 8 and len(c.logprobs.top_logprobs[0]) >= 2 for c in sampled.choices)
    wait_until(lambda: pool_whole(pipeline.prefill) and pool_whole(pipeline.decode), what="pools whole")
