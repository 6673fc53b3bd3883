"""The KV path at wire speed: block bytes sent straight from a pool's block tensors and received straight into another's
(exact bytes in wire order, contiguous, fragmented and gathered ranges, int8 scales, partial socket reads and writes), a
pull through the TCP connector written in place, and a decode worker that keeps an aborted request's blocks until its
pull has ended."""

from __future__ import annotations

import random
import signal
import socket
import threading

import httpx
import pytest
import torch

from pdfleet_worker.kv_transfer import blocks, wire
from pdfleet_worker.kv_transfer import connector as c
from pdfleet_worker.kv_transfer.blocks import KVPool
from pdfleet_worker.kv_transfer.lease import LeaseTable
from pdfleet_worker.kv_transfer.params import KVTransferParams, RemotePrompt
from pdfleet_worker.kv_transfer.peers import KVPeers
from pdfleet_worker.kv_transfer.tcp import TcpKVConnector
from tests.worker.processes import MODEL, pool_whole, start_all, wait_until, worker


def make_pool(num_blocks: int, *, int8: bool = False, layers: int = 3, seed: int = 0) -> KVPool:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        if int8:
            out.append(
                {
                    "kv": torch.randint(-127, 127, (2, 4, num_blocks, 16, 32), dtype=torch.int8, generator=g),
                    "scale": torch.rand(2, 4, num_blocks, generator=g),
                }
            )
        else:
            out.append({"kv": torch.randn(2, 4, num_blocks, 16, 32, generator=g)})
    return KVPool(out)


def blocks_of(pool: KVPool, ids: list[int]) -> list[dict[str, torch.Tensor]]:
    idx = torch.tensor(ids)
    return [{name: t.index_select(2, idx) for name, t in layer.items()} for layer in pool.layers]


RANGES = {
    "contiguous": (list(range(10, 60)), list(range(100, 150))),
    "fragmented": (random.Random(1).sample(range(200), 50), random.Random(2).sample(range(300), 50)),
    # 8 rows x 200 runs > MAX_SEGMENTS a layer: gathered on the way out, scattered on the way in
    "gathered": (random.Random(3).sample(range(200), 200), random.Random(4).sample(range(300), 200)),
}


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("kind", list(RANGES))
def test_views_carry_exactly_the_blocks_in_wire_order(kind, int8):
    src, dst = make_pool(200, int8=int8, seed=1), make_pool(300, int8=int8, seed=2)
    ids, dest = RANGES[kind]
    before = [{k: t.clone() for k, t in layer.items()} for layer in dst.layers]
    # The byte stream is what export_kv's tensors concatenated hold.
    sent = b"".join(bytes(v) for layer in src.send_layers(ids) for v in blocks.ready(layer))
    expected = b"".join(
        bytes(blocks.byte_view(t.contiguous())) for layer in blocks_of(src, ids) for t in layer.values()
    )
    assert sent == expected
    a, b = socket.socketpair()
    with a, b:
        sender = threading.Thread(target=lambda: [wire.send_views(a, blocks.ready(x)) for x in src.send_layers(ids)])
        sender.start()
        for views, scatter in dst.recv_layers(dest):
            wire.recv_views(b, views, None)
            if scatter is not None:
                scatter()
        sender.join()
    for got, want in zip(blocks_of(dst, dest), blocks_of(src, ids)):
        for name in want:
            assert torch.equal(got[name], want[name]), name
    untouched = sorted(set(range(300)) - set(dest))
    assert all(
        torch.equal(layer[k].index_select(2, torch.tensor(untouched)), old[k].index_select(2, torch.tensor(untouched)))
        for layer, old in zip(dst.layers, before)
        for k in layer
    ), "bytes landed outside the destination blocks"


class Trickle:
    """A socket stand-in that moves at most `step` bytes per call, into and out of a shared bytearray."""

    def __init__(self, step: int):
        self.step, self.data, self.pos = step, bytearray(), 0

    def sendmsg(self, views) -> int:
        left = self.step
        for v in views:
            take = bytes(v[:left])
            self.data += take
            left -= len(take)
            if not left:
                break
        return self.step - left

    def settimeout(self, _):
        pass

    def setsockopt(self, *_):
        pass

    def recvmsg_into(self, views, _ancbufsize=0, _flags=0):
        n = 0
        for v in views:
            take = min(len(v), self.step - n, len(self.data) - self.pos)
            v[:take] = self.data[self.pos : self.pos + take]
            self.pos += take
            n += take
            if n == self.step or self.pos == len(self.data):
                break
        return n, 0, 0, None


def test_partial_sends_and_receives_resume_mid_buffer():
    rng = random.Random(5)
    chunks = [bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40))) for _ in range(30)]
    sock = Trickle(step=7)
    assert wire.send_views(sock, [memoryview(x) for x in chunks]) == sum(map(len, chunks))
    assert bytes(sock.data) == b"".join(chunks)
    out = [bytearray(len(x)) for x in chunks]
    assert wire.recv_views(sock, [memoryview(x) for x in out], None) == sum(map(len, chunks))
    assert [bytes(x) for x in out] == chunks


def _serving(pool: KVPool, held: list[int]) -> tuple[TcpKVConnector, LeaseTable, list[str], KVTransferParams]:
    freed: list[str] = []
    leases = LeaseTable(30.0, freed.append)
    leases.add("req-1", held, len(held) * 16)
    server = TcpKVConnector("127.0.0.1", 0, peers=KVPeers.from_spec("127.0.0.1"))
    host, port = server.serve(leases, pool, "hash")
    params = KVTransferParams(
        "e", host, port, "tcp", "hash", 16, 30.0, [RemotePrompt("req-1", held, len(held) * 16, "h")]
    )
    return server, leases, freed, params


def test_pull_writes_into_the_destination_blocks_and_staged_pulls_match():
    src, dst = make_pool(64, int8=True, seed=3), make_pool(96, int8=True, seed=4)
    held = [40, 41, 42, 7, 8, 30]
    server, leases, freed, params = _serving(src, held)
    puller = TcpKVConnector(peers=KVPeers.from_spec("127.0.0.1"))
    try:
        pulled = puller.pull(params, params.prompts[0], 1, [90, 91, 3, 4], "hash", 5, into=dst)
        assert pulled.in_place and pulled.layers is None
        want = blocks_of(src, held[1:5])
        assert pulled.nbytes == sum(t.numel() * t.element_size() for layer in want for t in layer.values())
        for got, exp in zip(blocks_of(dst, [90, 91, 3, 4]), want):
            assert all(torch.equal(got[k], exp[k]) for k in exp)
        staged = puller.pull(params, params.prompts[0], 0, list(range(6)), "hash", 5)
        assert not staged.in_place
        for got, exp in zip(staged.layers, blocks_of(src, held)):
            assert all(torch.equal(got[k], exp[k]) for k in exp)
        # A pool whose layout differs is refused before a byte lands.
        other = make_pool(96, seed=5)
        before = other.layers[0]["kv"].clone()
        with pytest.raises(c.KVTransferError) as err:
            puller.pull(params, params.prompts[0], 0, [0], "hash", 5, into=other)
        assert err.value.reason == c.BAD_RESPONSE and torch.equal(other.layers[0]["kv"], before)
        assert puller.release(params, params.prompts[0], True, 5) and freed == ["req-1"] and len(leases) == 0
    finally:
        server.close()


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("kind", list(RANGES))
def test_a_pull_lands_every_kind_of_range_in_its_blocks(kind, int8):
    """Through the connector: one coalesced send of header and layers, one scatter read per run of in-place
    layers (gathered layers sent and scattered one by one)."""
    src, dst = make_pool(200, int8=int8, seed=1), make_pool(300, int8=int8, seed=2)
    held, dest = RANGES[kind]
    before = [{k: t.clone() for k, t in layer.items()} for layer in dst.layers]
    server, leases, freed, params = _serving(src, held)
    puller = TcpKVConnector(peers=KVPeers.from_spec("127.0.0.1"))
    try:
        pulled = puller.pull(params, params.prompts[0], 0, dest, "hash", 5, into=dst)
        assert pulled.in_place and pulled.nbytes == sum(
            t.numel() * t.element_size() for layer in blocks_of(src, held) for t in layer.values()
        )
        for got, want in zip(blocks_of(dst, dest), blocks_of(src, held)):
            assert all(torch.equal(got[k], want[k]) for k in want)
        others = torch.tensor(sorted(set(range(300)) - set(dest)))
        for layer, old in zip(dst.layers, before):
            assert all(torch.equal(layer[k].index_select(2, others), old[k].index_select(2, others)) for k in layer)
        # The connection went back to the idle pool at a message boundary: the ack on it is answered.
        assert puller.release(params, params.prompts[0], True, 5) and freed == ["req-1"]
    finally:
        server.close()
        puller.close()


@pytest.fixture(scope="module")
def frozen_pair(logdir, model_dir):
    """A prefill worker this module may SIGSTOP, and a decode worker pulling from it with a long timeout."""
    p = worker(logdir, model_dir, "prefill", "--kv-lease", "60s", name="wire-prefill")
    d = worker(logdir, model_dir, "decode", "--kv-transfer-timeout", "60s", name="wire-decode")
    start_all(p, d)
    try:
        yield p, d
    finally:
        p.signal(signal.SIGCONT)
        for proc in (p, d):
            proc.stop()


def test_an_aborted_request_keeps_its_blocks_until_its_pull_ends(frozen_pair):
    p, d = frozen_pair
    prompt = [random.Random(6).randrange(4, 4096) for _ in range(80)]
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    params = httpx.post(
        f"{p.url}/v1/completions",
        json=dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
        timeout=30,
    ).json()["kv_transfer_params"]
    total = d.load()["total_blocks"]
    p.signal(signal.SIGSTOP)  # its kernel still accepts: the pull starts and waits for the answer
    try:
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", f"{d.url}/v1/completions", json=dict(body, stream=True, kv_transfer_params=params)),
        ):
            wait_until(lambda: d.load()["waiting_for_remote_kv"] == 1, what="the pull in progress")
        # The client left: its request is aborted and answered, but the pull still owns the blocks it writes into.
        wait_until(lambda: d.load()["inflight"] == 0, what="the aborted request's handler done")
        # One more request through the engine thread, after the abort in its queue: the abort has been handled.
        r = httpx.post(f"{d.url}/v1/completions", json={"model": MODEL, "prompt": [5], "max_tokens": 1}, timeout=30)
        assert r.status_code == 200, r.text
        held = d.load()
        assert held["waiting_for_remote_kv"] == 1 and held["free_blocks"] < total, held
    finally:
        p.signal(signal.SIGCONT)
    # The pull ends (its bytes land in blocks nobody else holds), then the abort frees them and acks the lease.
    wait_until(lambda: pool_whole(d), timeout=30, what="decode blocks freed once the pull ended")
    wait_until(lambda: pool_whole(p), timeout=30, what="the lease acked")
    again = dict(body, prompt=prompt[:-1] + [5])
    params = httpx.post(
        f"{p.url}/v1/completions",
        json=dict(again, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
        timeout=30,
    ).json()["kv_transfer_params"]
    pd = httpx.post(f"{d.url}/v1/completions", json=dict(again, kv_transfer_params=params), timeout=30).json()
    colo = httpx.post(f"{p.url}/v1/completions", json=again, timeout=30).json()
    assert pd["choices"][0]["token_ids"] == colo["choices"][0]["token_ids"]
