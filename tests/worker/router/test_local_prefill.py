"""Decoders as temporary prefillers: with no prefill worker in rotation (its pool being replaced by a rollout or a
rollback) the router sends PD requests straight to a decode worker, which computes the prompt itself: the same
tokens as a colocated worker, counted, no 503. Real processes."""

from __future__ import annotations

import httpx
import openai

from pdfleet_worker import metrics as m
from tests.support.components import free_port
from tests.worker.kv_transfer.test_kv_transfer import fresh_prompt, sample
from tests.worker.processes import MODEL, authenticated, router, start_all


def test_no_prefill_worker_in_rotation_decode_workers_prefill_locally(logdir, pipeline, token_file):
    gone = f"http://127.0.0.1:{free_port()}"  # a prefill pool whose every replica is away (nothing listens)
    r = authenticated(
        router(logdir, "--prefill", gone, "--decode", pipeline.decode.url, name="router-no-prefill"), token_file
    )
    try:
        start_all(r)  # ready: a decode worker alone can serve
        prompt = fresh_prompt(40, seed=71)
        want = openai.OpenAI(
            base_url=f"{pipeline.colo.url}/v1", api_key="-", max_retries=0, timeout=60
        ).completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        client = openai.OpenAI(base_url=f"{r.url}/v1", api_key="-", max_retries=0, timeout=60)
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert raw.headers["x-pdfleet-prefill"] == "local"
        assert raw.parse().choices[0].text == want.choices[0].text, "the decode worker's own prefill, same tokens"
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}
            )
            if c.choices
        )
        assert streamed == want.choices[0].text
        text = httpx.get(f"{r.url}/metrics", timeout=10).text
        assert sample(text, m.ROUTER_LOCAL_PREFILLS_TOTAL.name, tier="default") == 2
        assert sample(text, m.ROUTER_REQUESTS_TOTAL.name, code="200", tier="default") == 2
        assert sample(text, m.ROUTER_REQUESTS_TOTAL.name, code="503", tier="default") == 0
    finally:
        r.stop()


def test_with_a_prefill_worker_in_rotation_nothing_is_prefilled_locally(pipeline):
    before = sample(pipeline.router.metrics_text(), m.ROUTER_LOCAL_PREFILLS_TOTAL.name, tier="default")
    client = openai.OpenAI(base_url=f"{pipeline.router.url}/v1", api_key="-", max_retries=0, timeout=60)
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=fresh_prompt(24, seed=72), max_tokens=4, temperature=0
    )
    assert raw.headers["x-pdfleet-prefill"] != "local"
    assert sample(pipeline.router.metrics_text(), m.ROUTER_LOCAL_PREFILLS_TOTAL.name, tier="default") == before


def test_short_prompts_skip_the_prefill_pool_and_long_ones_use_it(logdir, pipeline, token_file):
    """Disaggregate only where it pays: under --pd-min-prompt-tokens a decode worker computes the prompt itself (the
    same tokens as a colocated worker); at or above it the prefill pool does and hands the KV over. Counted by
    route."""
    r = authenticated(
        router(
            logdir,
            "--prefill",
            pipeline.prefill.url,
            "--decode",
            pipeline.decode.url,
            "--pd-min-prompt-tokens",
            "32",
            name="router-short-prompts",
        ),
        token_file,
    )
    colo = openai.OpenAI(base_url=f"{pipeline.colo.url}/v1", api_key="-", max_retries=0, timeout=60)
    try:
        start_all(r)
        client = openai.OpenAI(base_url=f"{r.url}/v1", api_key="-", max_retries=0, timeout=60)
        for length, path in ((31, "local"), (32, "prefill_pool")):
            prompt = fresh_prompt(length, seed=90 + length)
            want = colo.completions.create(
                model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
            )
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
            )
            assert (raw.headers["x-pdfleet-prefill"] == "local") == (path == "local"), (length, raw.headers)
            assert raw.parse().choices[0].text == want.choices[0].text, length
        text = httpx.get(f"{r.url}/metrics", timeout=10).text
        assert sample(text, m.ROUTER_PD_ROUTES_TOTAL.name, tier="default", route="short_prompt") == 1
        assert sample(text, m.ROUTER_PD_ROUTES_TOTAL.name, tier="default", route="prefill_pool") == 1
        assert sample(text, m.ROUTER_LOCAL_PREFILLS_TOTAL.name, tier="default") == 0, "by design, not a fallback"
    finally:
        r.stop()


def test_prompt_length_counts_token_ids_text_and_chat_messages() -> None:
    from pdfleet_worker.router import routing

    assert routing.prompt_length("/v1/completions", {"prompt": [5, 6, 7]}) == 3
    for not_ids in ([1, True], [True], [[1, 2], [3]], [1, 2.0]):  # JSON's true is no token id, nor a batch, nor 2.0
        assert routing.prompt_length("/v1/completions", {"prompt": not_ids}) is None, not_ids
    assert routing.prompt_length("/v1/completions", {"prompt": "abcdefghi"}) == 3  # ~4 characters per token
    assert routing.prompt_length("/v1/completions", {"prompt": "a b c"}, count_tokens=lambda t: len(t.split())) == 3
    chat = {"messages": [{"role": "user", "content": "12345678"}]}
    assert routing.prompt_length("/v1/chat/completions", chat) == 2
    assert routing.prompt_length("/v1/chat/completions", {"messages": "x"}) is None


def test_answers_carry_the_revision_of_the_worker_that_gave_them(logdir, model_dir):
    """A worker started from a pod template of revision 7 ($PDFLEET_REVISION, from the pod's label) says so in
    /load; the router counts its answers under revision 7 (rollback analysis reads that revision alone)."""
    from tests.worker.processes import worker

    w = worker(logdir, model_dir, "both", name="rev7")
    w.env["PDFLEET_REVISION"] = "7"
    r = None
    try:
        start_all(w)  # before the router takes its URL: a worker whose chosen port was taken starts on another
        assert w.load()["revision"] == "7"
        r = router(logdir, "--workers", w.url, name="router-rev7")
        start_all(r)
        client = openai.OpenAI(base_url=f"{r.url}/v1", api_key="-", max_retries=0, timeout=60)
        client.completions.create(model=MODEL, prompt=fresh_prompt(8, seed=73), max_tokens=2, temperature=0)
        text = httpx.get(f"{r.url}/metrics", timeout=10).text
        name = m.ROUTER_REVISION_REQUESTS_TOTAL.name
        assert sample(text, name, revision="7", code="200", shed="false") == 1
        assert sample(text, name, revision="none", code="200", shed="false") == 0
    finally:
        if r is not None:
            r.stop()
        w.stop()
