"""The prefill -> decode hand-off per engine (router/handoff.py), exact and pure: what the router sends a vLLM prefill
worker (the fields vLLM's NixlConnector proxy sends), what it takes from the answer (a NIXL answer as vLLM 0.32 wrote it
here), what the decode worker gets; tests/worker/router/test_vllm_pd.py runs it between real vLLM servers."""

from __future__ import annotations

import pytest

from pdfleet_worker.router import handoff

CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "max_completion_tokens": 40,
    "stream": True,
    "stream_options": {"include_usage": True},
    "min_tokens": 5,
    "temperature": 0,
    "n": 1,
    "seed": 7,
}
# vLLM 0.32's NixlConnector prefill answer (kv_transfer_params as its scheduler's request_finished returns them).
NIXL_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1]],
    "remote_engine_id": "991c1e88-acb5-450d-a1bc-4444cdd3fd9b",
    "remote_request_id": "cmpl-8668-0-b563b264",
    "remote_host": "10.1.2.3",
    "remote_port": 15600,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 82,
    "remote_blocks_expiry_time": None,
    "transfer_mode": "pull",
    "remote_prefill_cached_tokens": 0,
}


def test_vllm_prefill_is_one_unstreamed_token_asking_to_hold_the_kv():
    got = handoff.prefill_body("vllm", CHAT)
    assert got == {
        "model": "tiny",
        "messages": CHAT["messages"],
        "max_completion_tokens": 1,
        "max_tokens": 1,
        "stream": False,
        "temperature": 0,
        "n": 1,
        "seed": 7,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    assert "max_completion_tokens" not in handoff.prefill_body("vllm", {"prompt": "x", "max_tokens": 9})
    assert CHAT["stream"] is True and CHAT["min_tokens"] == 5, "the client's request is not changed"
    assert handoff.prefill_body("vllm", CHAT)["kv_transfer_params"] is not handoff.VLLM_PREFILL_PARAMS


def test_pdfleet_prefill_gets_the_whole_request():
    assert handoff.prefill_body("pdfleet", CHAT) == dict(CHAT, kv_transfer_params={"do_remote_decode": True})


def test_decode_gets_the_clients_request_with_what_prefill_returned():
    hand = handoff.from_prefill("vllm", {"id": "cmpl-1", "choices": [], "kv_transfer_params": NIXL_PARAMS})
    assert hand.params is NIXL_PARAMS, "opaque to the router: the connector's own fields, untouched"
    assert hand.hosts == ("10.1.2.3",), "the side channel's address never reaches a client"
    assert handoff.decode_body(CHAT, hand) == dict(CHAT, kv_transfer_params=NIXL_PARAMS)
    mooncake = handoff.from_prefill(
        "vllm", {"kv_transfer_params": {"remote_bootstrap_addr": "http://10.0.0.9:8998", "remote_host": ""}}
    )
    assert mooncake.hosts == ("http://10.0.0.9:8998",)


def test_a_vllm_prefill_without_params_leaves_the_prompt_to_decode():
    # As vLLM's proxy does: no connector, or one that finds the KV by the prompt, returns none.
    for answer in ({"choices": []}, {"kv_transfer_params": None}):
        hand = handoff.from_prefill("vllm", answer)
        assert (hand.params, hand.hosts) == (None, ())
        assert handoff.decode_body(CHAT, hand) is CHAT


@pytest.mark.parametrize(
    "engine,answer,why",
    [
        ("vllm", [], "a list, not an object"),
        ("vllm", {"kv_transfer_params": "p:1"}, "kv_transfer_params is str"),
        ("pdfleet", {"choices": []}, "kv_transfer_params is missing"),
        ("pdfleet", {"kv_transfer_params": None}, "kv_transfer_params is missing"),
    ],
)
def test_answers_without_a_usable_handoff_are_refused(engine, answer, why):
    with pytest.raises(handoff.BadPrefillAnswer, match=why):
        handoff.from_prefill(engine, answer)


def test_decode_answers_lose_their_own_kv_transfer_params():
    answer = {"id": "x", "kv_transfer_params": {"remote_host": "10.1.2.4"}}
    assert handoff.scrub_decode_answer(answer) and answer == {"id": "x", "kv_transfer_params": None}
    assert not handoff.scrub_decode_answer(answer) and not handoff.scrub_decode_answer([])
