"""KV transfer between real prefill and decode workers: exact bytes, blocks freed on ack and on lease expiry,
incompatible layouts and prompts refused; plus the lease table and parameters on their own."""

from __future__ import annotations

import random

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdfleet_worker import metrics as m
from pdfleet_worker.kv_transfer import connector as c
from pdfleet_worker.kv_transfer.lease import LeaseTable
from pdfleet_worker.kv_transfer.params import KVTransferParams
from pdfleet_worker.kv_transfer.peers import KVPeers
from pdfleet_worker.wire import auth
from tests.worker.processes import AUTH, MODEL, pool_whole, wait_until

BLOCK = 16
# The tiny preset: 4 layers, 4 KV heads, head dim 32, fp32; k and v.
BYTES_PER_BLOCK = 4 * 2 * 4 * BLOCK * 32 * 4


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a /metrics exposition (0 when absent)."""
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def fresh_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 4096) for _ in range(length)]


def body(prompt, **extra) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def prefill(pipeline, prompt) -> dict:
    r = httpx.post(
        f"{pipeline.prefill.url}/v1/completions",
        json=body(prompt, kv_transfer_params={"do_remote_decode": True}),
        headers=AUTH,
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def decode(pipeline, prompt, params) -> httpx.Response:
    return httpx.post(
        f"{pipeline.decode.url}/v1/completions", json=body(prompt, kv_transfer_params=params), headers=AUTH, timeout=30
    )


def colocated_tokens(pipeline, prompt) -> list[int]:
    r = httpx.post(f"{pipeline.colo.url}/v1/completions", json=body(prompt), timeout=30)
    return r.json()["choices"][0]["token_ids"]


def test_transfer_moves_exactly_the_prompt_blocks_and_the_ack_frees_them(pipeline):
    p, d = pipeline.prefill, pipeline.decode
    sent0 = sample(p.metrics_text(), m.KV_TRANSFER_BYTES_TOTAL.name, direction="sent")
    recv0 = sample(d.metrics_text(), m.KV_TRANSFER_BYTES_TOTAL.name, direction="received")
    released0 = p.load()["leases_released"]
    prompt = fresh_prompt(50, seed=11)
    r = httpx.post(f"{pipeline.router.url}/v1/completions", json=body(prompt), timeout=30)
    assert r.status_code == 200, r.text
    # The decode worker computes the last prompt token itself: KV of 49 tokens = 4 blocks of 16.
    expected = -(-(len(prompt) - 1) // BLOCK) * BYTES_PER_BLOCK
    assert expected == 262144
    wait_until(lambda: p.load()["leases_released"] == released0 + 1, what="the ack")
    assert sample(p.metrics_text(), m.KV_TRANSFER_BYTES_TOTAL.name, direction="sent") - sent0 == expected
    assert sample(d.metrics_text(), m.KV_TRANSFER_BYTES_TOTAL.name, direction="received") - recv0 == expected
    assert r.json()["choices"][0]["token_ids"] == colocated_tokens(pipeline, prompt)
    wait_until(lambda: pool_whole(p) and pool_whole(d), what="prefill and decode pools whole after the ack")


def test_unacked_blocks_are_freed_when_the_lease_expires(pipeline):
    p, d = pipeline.prefill, pipeline.decode
    expired0 = sample(p.metrics_text(), m.KV_LEASES_EXPIRED_TOTAL.name)
    prompt = fresh_prompt(40, seed=12)
    params = prefill(pipeline, prompt)
    held = p.load()
    assert held["held_blocks"] == len(params["prompts"][0]["remote_block_ids"]) == 3 and held["leases"] == 1
    assert params["lease_seconds"] == 3.0
    # Nobody pulls: after 3 s the lease expires and the blocks come back.
    wait_until(lambda: pool_whole(p), timeout=10, what="blocks freed by lease expiry")
    assert sample(p.metrics_text(), m.KV_LEASES_EXPIRED_TOTAL.name) == expired0 + 1
    # A decode worker arriving late finds no lease, recomputes (its policy) and still answers right.
    failed0 = sample(d.metrics_text(), m.KV_TRANSFER_FAILURES_TOTAL.name, reason=c.UNKNOWN_REQUEST)
    r = decode(pipeline, prompt, params)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == colocated_tokens(pipeline, prompt)
    assert sample(d.metrics_text(), m.KV_TRANSFER_FAILURES_TOTAL.name, reason=c.UNKNOWN_REQUEST) == failed0 + 1
    wait_until(lambda: pool_whole(d), what="decode pool whole")


def test_incompatible_layout_is_refused_by_the_prefill_kv_endpoint(pipeline, token_file):
    from pdfleet_worker.kv_transfer.tcp import TcpKVConnector

    prompt = fresh_prompt(33, seed=13)
    raw = prefill(pipeline, prompt)
    params = KVTransferParams.from_json(raw)
    conn = TcpKVConnector(token=auth.token_file(token_file), peers=KVPeers.from_spec("127.0.0.1"))
    with pytest.raises(c.KVTransferError) as err:
        conn.pull(params, params.prompts[0], 0, [0, 1], "0000000000000000", timeout_s=5)
    assert err.value.reason == c.INCOMPATIBLE
    assert "KV layout mismatch" in str(err.value) and params.compat_hash in str(err.value)
    # The right hash gets exactly the blocks asked for.
    pulled = conn.pull(params, params.prompts[0], 1, [7], params.compat_hash, timeout_s=5)
    assert pulled.nbytes == BYTES_PER_BLOCK and pulled.layers[0]["kv"].shape == (2, 4, 1, BLOCK, 32)
    with pytest.raises(c.KVTransferError) as err:
        conn.pull(params, params.prompts[0], 2, [7, 8], params.compat_hash, timeout_s=5)
    assert err.value.reason == c.BAD_RESPONSE, "a range past the held blocks is refused"
    assert conn.release(params, params.prompts[0], ok=False, timeout_s=5) is True
    wait_until(lambda: pool_whole(pipeline.prefill), what="released blocks free")


@pytest.mark.parametrize("tamper,reason", [("compat_hash", c.INCOMPATIBLE), ("prompt_hash", c.PROMPT_MISMATCH)])
def test_decode_refuses_kv_it_cannot_use_and_recomputes(pipeline, tamper, reason):
    p, d = pipeline.prefill, pipeline.decode
    prompt = fresh_prompt(45, seed=14)
    params = prefill(pipeline, prompt)
    if tamper == "compat_hash":
        params["compat_hash"] = "deadbeefdeadbeef"
    else:
        params["prompts"][0]["prompt_hash"] = "0" * 16
    failed0 = sample(d.metrics_text(), m.KV_TRANSFER_FAILURES_TOTAL.name, reason=reason)
    recv0 = sample(d.metrics_text(), m.KV_TRANSFER_BYTES_TOTAL.name, direction="received")
    r = decode(pipeline, prompt, params)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == colocated_tokens(pipeline, prompt)
    text = d.metrics_text()
    assert sample(text, m.KV_TRANSFER_FAILURES_TOTAL.name, reason=reason) == failed0 + 1
    assert sample(text, m.KV_TRANSFER_BYTES_TOTAL.name, direction="received") == recv0, "no KV imported"
    # The refusal acks the lease at once: blocks free long before the 3 s expiry.
    wait_until(lambda: pool_whole(p), timeout=2, what="prefill blocks released by the refusal")


def test_malformed_transfer_params_are_a_400(pipeline):
    r = httpx.post(
        f"{pipeline.decode.url}/v1/completions",
        json=body([5, 6, 7], kv_transfer_params={"do_remote_prefill": True, "prompts": "x"}),
        headers=AUTH,
        timeout=10,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    r = httpx.post(
        f"{pipeline.decode.url}/v1/completions",
        json=body([5, 6, 7], kv_transfer_params={"do_remote_decode": True}),
        headers=AUTH,
        timeout=10,
    )
    assert r.status_code == 400 and "does not hold KV" in r.json()["error"]["message"]


# -- the pieces on their own ---------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_lease_table_frees_on_ack_and_expiry_but_never_under_a_pull():
    freed: list[str] = []
    clock = Clock()
    t = LeaseTable(2.0, freed.append, clock)
    t.add("a", [1, 2], 20)
    t.add("b", [3], 5)
    assert t.pin("a") is not None
    assert t.release("a") is True and freed == [], "a pinned lease waits for its pull"
    assert t.pin("a") is None, "no new pull on a released lease"
    t.unpin("a")
    assert freed == ["a"] and t.num_released == 1
    clock.t += 1.9
    assert t.expire() == [] and t.next_expiry() == pytest.approx(102.0)
    assert t.pin("b") is not None
    clock.t += 0.2
    assert t.expire() == ["b"] and freed == ["a"], "expired while pulled: freed when the pull ends"
    t.unpin("b")
    assert freed == ["a", "b"] and t.num_expired == 1 and len(t) == 0
    assert t.release("b") is False and t.pin("zzz") is None


def test_transfer_params_parse_and_reject():
    good = {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_host": "10.0.0.1",
        "remote_port": 9000,
        "connector": "tcp",
        "compat_hash": "h",
        "block_size": 16,
        "lease_seconds": 30,
        "prompts": [{"remote_request_id": "r", "remote_block_ids": [3, 4], "num_tokens": 20, "prompt_hash": "x"}],
    }
    params = KVTransferParams.from_json(good)
    assert params.to_json() == dict(good, lease_seconds=30.0)
    for bad, msg in [
        ({**good, "remote_port": "9000"}, "remote_port"),
        ({**good, "prompts": []}, "empty"),
        ({**good, "prompts": [{**good["prompts"][0], "num_tokens": 40}]}, "cannot hold"),
        ({**good, "prompts": [{**good["prompts"][0], "remote_block_ids": [-1]}]}, "non-negative"),
    ]:
        with pytest.raises(ValueError, match=msg):
            KVTransferParams.from_json(bad)


def test_compat_hash_covers_the_layout():
    from pdfleet_worker.engine.kv_layout import KVLayout

    base = KVLayout("m", "float32", "auto", 4, 4, 32, 16)
    others = [
        KVLayout("m", "float32", "auto", 4, 4, 32, 8),
        KVLayout("m", "bfloat16", "auto", 4, 4, 32, 16),
        KVLayout("m", "float32", "int8", 4, 4, 32, 16),
        KVLayout("m", "float32", "auto", 4, 2, 32, 16),
    ]
    assert len({base.compat_hash, *(o.compat_hash for o in others)}) == 5
