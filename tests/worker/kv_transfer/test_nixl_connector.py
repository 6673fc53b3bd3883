"""pdfleet's own workers with the NIXL KV connector, for real: a prefill and a decode worker on `--kv-connector nixl`
(NIXL over UCX, DRAM to DRAM, on loopback) behind the router; greedy tokens equal what the prefill worker computes
whole, every KV moves as a NIXL read into the decode worker's blocks, NIXL and TCP pulls of the same blocks carry the
same bytes, a TCP worker and a NIXL worker pull from each other, and the deployment token guards the NIXL path as it
guards TCP.

What ran: nixl-cu12 1.5.1 from the main virtualenv (`make test` installs it), its UCX picking shared memory
and TCP on lo. What did not: NIXL between hosts, RDMA, GPU memory (VRAM registration is written, not run).
"""

from __future__ import annotations

import importlib.util
import random

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pdfleet_worker import metrics as m
from pdfleet_worker.kv_transfer import connector as c
from pdfleet_worker.kv_transfer.params import KVTransferParams
from pdfleet_worker.kv_transfer.peers import KVPeers
from pdfleet_worker.kv_transfer.tcp import TcpKVConnector
from pdfleet_worker.wire import auth
from tests.support.components import missing
from tests.worker.kv_transfer.test_kv_transfer import BLOCK, BYTES_PER_BLOCK, sample
from tests.worker.processes import AUTH, MODEL, authenticated, pool_whole, router, start_all, wait_until, worker

# NOTE: UCX on one host uses shared memory and TCP; pinned to lo so its TCP stays on this machine (FACTS.md).
UCX_ENV = {"UCX_NET_DEVICES": "lo"}


def require_nixl() -> None:
    if not any(importlib.util.find_spec(name) for name in ("nixl", "nixl_cu12")):
        missing("nixl-cu12")


@pytest.fixture(scope="module")
def nixl(logdir, model_dir, token_file):
    """(NIXL prefill, NIXL decode, TCP worker of role both, router over the NIXL pair), all with the token."""
    require_nixl()
    p = authenticated(
        worker(logdir, model_dir, "prefill", "--kv-connector", "nixl", "--kv-lease", "30s", name="nixl-prefill"),
        token_file,
    )
    d = authenticated(
        worker(
            logdir, model_dir, "decode", "--kv-connector", "nixl", "--kv-transfer-timeout", "20s", name="nixl-decode"
        ),
        token_file,
    )
    t = authenticated(worker(logdir, model_dir, "both", "--kv-lease", "30s", name="tcp-both"), token_file)
    for proc in (p, d, t):
        proc.env = dict(UCX_ENV)
    start_all(p, d, t)
    r = authenticated(router(logdir, "--prefill", p.url, "--decode", d.url, name="router-nixl"), token_file)
    try:
        start_all(r)
        yield p, d, t, r
    finally:
        for proc in (r, p, d, t):
            proc.stop()


def body(prompt, **extra) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 4096) for _ in range(length)]


def whole(proc, prompt) -> list[int]:
    """The prefill worker answering the request whole (no kv_transfer_params): the colocated reference."""
    r = httpx.post(f"{proc.url}/v1/completions", json=body(prompt), headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def transfers(proc) -> dict:
    return proc.load()["kv_transfers"]


def failures(proc) -> float:
    """Failed or refused pulls of every reason."""
    return sum(
        s.value
        for fam in text_string_to_metric_families(proc.metrics_text())
        for s in fam.samples
        if s.name == m.KV_TRANSFER_FAILURES_TOTAL.name
    )


def test_pd_through_the_router_moves_every_kv_as_a_nixl_read_and_tokens_equal_colocated(nixl):
    p, d, _, r = nixl
    assert d.load()["kv_connector"] == p.load()["kv_connector"] == "nixl"
    before_d, before_p = transfers(d).get("nixl", 0), transfers(p).get("nixl", 0)
    recv0 = sample(d.metrics_text(), m.KV_TRANSFER_BYTES_TOTAL.name, direction="received")
    moved = 0
    for i, length in enumerate((17, 50, 161)):
        prompt = prompt_of(length, seed=40 + i)
        answer = httpx.post(f"{r.url}/v1/completions", json=body(prompt), headers=AUTH, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["token_ids"] == whole(p, prompt)
        moved += -(-(length - 1) // BLOCK) * BYTES_PER_BLOCK
    assert transfers(d).get("nixl", 0) - before_d == 3 and transfers(p).get("nixl", 0) - before_p == 3
    assert transfers(d).get("tcp", 0) == 0, "a NIXL pair moved bytes over the socket"
    assert sample(d.metrics_text(), m.KV_TRANSFER_BYTES_TOTAL.name, direction="received") - recv0 == moved
    assert failures(d) == 0
    wait_until(lambda: pool_whole(p) and pool_whole(d), what="leases acked, pools whole")


def test_tcp_and_nixl_workers_pull_from_each_other(nixl):
    p, d, t, _ = nixl
    for source, puller, path in ((p, t, "tcp"), (t, d, "tcp")):
        prompt = prompt_of(70, seed=50)
        params = httpx.post(
            f"{source.url}/v1/completions",
            json=body(prompt, kv_transfer_params={"do_remote_decode": True}),
            headers=AUTH,
            timeout=60,
        ).json()["kv_transfer_params"]
        assert params["connector"] == source.load()["kv_connector"]
        before = transfers(puller).get(path, 0)
        answer = httpx.post(
            f"{puller.url}/v1/completions", json=body(prompt, kv_transfer_params=params), headers=AUTH, timeout=60
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["token_ids"] == whole(source, prompt)
        assert transfers(puller).get(path, 0) == before + 1, f"{puller.name} did not pull from {source.name}"
    assert failures(t) == 0 and failures(d) == 0


def test_a_nixl_read_carries_the_bytes_a_tcp_pull_does_and_needs_the_token(nixl, token_file, monkeypatch):
    from pdfleet_worker.kv_transfer.nixl import NixlKVConnector

    for key, value in UCX_ENV.items():
        monkeypatch.setenv(key, value)
    p = nixl[0]
    prompt = prompt_of(90, seed=60)
    params = KVTransferParams.from_json(
        httpx.post(
            f"{p.url}/v1/completions",
            json=body(prompt, kv_transfer_params={"do_remote_decode": True}),
            headers=AUTH,
            timeout=60,
        ).json()["kv_transfer_params"]
    )
    assert params.connector == "nixl"
    n = len(params.prompts[0].block_ids)
    peers = KVPeers.from_spec("127.0.0.1")
    anonymous = NixlKVConnector(peers=peers)
    with pytest.raises(c.KVTransferError) as err:
        anonymous.pull(params, params.prompts[0], 0, list(range(n)), params.compat_hash, 10)
    assert err.value.reason == c.UNAUTHORIZED
    token = auth.token_file(token_file)
    read = NixlKVConnector(token=token, peers=peers)
    via_nixl = read.pull(params, params.prompts[0], 1, list(range(n - 1)), params.compat_hash, 10)
    via_tcp = TcpKVConnector(token=token, peers=peers).pull(
        params, params.prompts[0], 1, list(range(n - 1)), params.compat_hash, 10
    )
    assert read.transfers == {"nixl": 1} and via_nixl.nbytes == via_tcp.nbytes == (n - 1) * BYTES_PER_BLOCK
    for a, b in zip(via_nixl.layers, via_tcp.layers):
        assert torch.equal(a["kv"], b["kv"])
    assert read.release(params, params.prompts[0], True, 10) is True
    wait_until(lambda: pool_whole(p), what="the lease released")
