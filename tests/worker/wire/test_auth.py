"""Authentication of the data plane, each attack tried and refused: calls to workers without the deployment token (HTTP
and the KV endpoint: pulls and lease releases), kv_transfer_params from a client, a decode worker pointed at a KV
endpoint outside --kv-peers, a router with the wrong token, client API keys on the router (401 in OpenAI's shape,
counted), and a token rotated in place with no restart; plus the secret files, the peer set and the TCP connector on
their own."""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import time

import httpx
import openai
import pytest
import torch
from starlette.testclient import TestClient

from pdfleet_worker import metrics as m
from pdfleet_worker.kv_transfer import connector as c
from pdfleet_worker.kv_transfer.lease import LeaseTable
from pdfleet_worker.kv_transfer.params import KVTransferParams, RemotePrompt
from pdfleet_worker.kv_transfer.peers import KVPeers, parse
from pdfleet_worker.kv_transfer.tcp import TcpKVConnector
from pdfleet_worker.router.app import build_app
from pdfleet_worker.router.router_config import RouterConfig, TierConfig
from pdfleet_worker.wire import auth
from tests.worker.kv_transfer.test_kv_transfer import body, colocated_tokens, fresh_prompt, sample
from tests.worker.processes import AUTH, MODEL, TOKEN, authenticated, pool_whole, router, start_all, wait_until, worker
from tests.worker.server.test_limits import assert_error
from tests.worker.wire.test_hostile_input import codes

INVALID_KEY = {"type": "invalid_request_error", "code": "invalid_api_key", "param": None}


def assert_401(resp: httpx.Response) -> dict:
    err = assert_error(resp, 401)
    assert {k: err[k] for k in INVALID_KEY} == INVALID_KEY, err
    assert resp.headers["www-authenticate"] == "Bearer"
    return err


def frame(sock: socket.socket, obj: dict) -> dict:
    """One request/answer on the KV wire (4-byte length + JSON), as an attacker speaking it by hand."""
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)
    head = sock.recv(4)
    (size,) = struct.unpack(">I", head)
    got = b""
    while len(got) < size:
        got += sock.recv(size - len(got))
    return json.loads(got)


def kv_call(host: str, port: int, obj: dict) -> dict:
    with socket.create_connection((host, port), timeout=5) as sock:
        return frame(sock, obj)


def prefill_params(pipeline, prompt) -> dict:
    r = httpx.post(
        f"{pipeline.prefill.url}/v1/completions",
        json=body(prompt, kv_transfer_params={"do_remote_decode": True}),
        headers=AUTH,
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


# -- the worker's HTTP endpoints ----------------------------------------------------------------------
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_with_a_token_refuses_every_call_without_it_but_the_probes(pipeline, role):
    w = getattr(pipeline, role)
    prompt = fresh_prompt(20, seed=70)
    prefilled = sample(pipeline.prefill.metrics_text(), m.PROMPT_TOKENS_TOTAL.name)
    kv = {"do_remote_decode": True} if role == "prefill" else {"do_remote_prefill": True, "prompts": []}
    for headers in ({}, {"Authorization": "Bearer " + secrets.token_urlsafe(24)}, {"Authorization": f"Basic {TOKEN}"}):
        for method, path, payload in (
            ("POST", "/v1/completions", body(prompt, kv_transfer_params=kv)),
            ("POST", "/v1/chat/completions", {"model": MODEL, "messages": []}),
            ("GET", "/v1/models", None),
            ("GET", f"/v1/models/{MODEL}", None),
            ("GET", "/load", None),
        ):
            err = assert_401(httpx.request(method, f"{w.url}{path}", json=payload, headers=headers, timeout=10))
            assert ("didn't provide" in err["message"]) == (not headers.get("Authorization", "").startswith("Bearer"))
    assert sample(pipeline.prefill.metrics_text(), m.PROMPT_TOKENS_TOTAL.name) == prefilled, "no prefill ran"
    assert pipeline.prefill.load()["leases"] == 0
    # Probes and Prometheus stay open; /ready then says whether, not what (no KV endpoint, no limits).
    assert httpx.get(f"{w.url}/health").status_code == 200
    assert httpx.get(f"{w.url}/metrics").status_code == 200
    ready = httpx.get(f"{w.url}/ready")
    assert ready.status_code == 200 and set(ready.json()) == {"ready", "alive", "loaded", "draining"}
    assert httpx.get(f"{w.url}/load", headers=AUTH).json()["ready"] is True


def test_a_client_cannot_hand_the_router_kv_transfer_params(pipeline):
    """The confused deputy through the router: the router refuses (400) a client's own kv_transfer_params
    before any worker sees them, whatever they name."""
    prefilled = sample(pipeline.prefill.metrics_text(), m.PROMPT_TOKENS_TOTAL.name)
    before = codes(pipeline.router.metrics_text())
    forged = {"do_remote_prefill": True, "remote_host": "10.66.0.1", "remote_port": 8001, "prompts": []}
    for kv in (forged, {"do_remote_decode": True}):
        assert_error(
            httpx.post(
                f"{pipeline.router.url}/v1/completions", json=body([5, 6, 7], kv_transfer_params=kv), timeout=10
            ),
            400,
            "kv_transfer_params",
            "set by the router",
        )
    assert codes(pipeline.router.metrics_text()).get("400", 0) == before.get("400", 0) + 2
    assert sample(pipeline.prefill.metrics_text(), m.PROMPT_TOKENS_TOTAL.name) == prefilled


# -- the KV endpoint ------------------------------------------------------------------------------------
def test_the_kv_endpoint_refuses_pulls_and_releases_without_the_token(pipeline):
    """Today's attack: anyone on the pod network `release`s another request's lease (or reads its KV)."""
    p = pipeline.prefill
    params = prefill_params(pipeline, fresh_prompt(40, seed=71))
    host, port = params["remote_host"], params["remote_port"]
    rid, compat = params["prompts"][0]["remote_request_id"], params["compat_hash"]
    refused0 = sample(p.metrics_text(), m.KV_TRANSFER_FAILURES_TOTAL.name, reason=c.UNAUTHORIZED)
    pull = {"op": "pull", "request_id": rid, "compat_hash": compat, "first_block": 0, "num_blocks": 1}
    release = {"op": "release", "request_id": rid, "ok": False}
    attempts = [
        pull,
        release,
        {**pull, "token": "x" * 32},
        # one character off (the token is random: its last character may itself be "A")
        {**release, "token": TOKEN[:-1] + ("B" if TOKEN.endswith("A") else "A")},
        {**release, "token": None},
        {**release, "token": [TOKEN]},
    ]
    for attempt in attempts:
        answer = kv_call(host, port, attempt)
        assert answer["ok"] is False and answer["reason"] == c.UNAUTHORIZED, (attempt, answer)
        assert "tensors" not in answer and "released" not in answer
    assert p.load()["leases"] == 1, "the lease survived every unauthenticated release"
    assert sample(p.metrics_text(), m.KV_TRANSFER_FAILURES_TOTAL.name, reason=c.UNAUTHORIZED) == refused0 + len(
        attempts
    )
    # The token in the frame: the pull is answered, the release frees the blocks.
    head = kv_call(host, port, {**pull, "token": TOKEN})
    assert head["ok"] is True and head["nbytes"] > 0
    assert kv_call(host, port, {**release, "token": TOKEN}) == {"ok": True, "released": True}
    wait_until(lambda: pool_whole(p), what="the released blocks free")


def test_the_decode_worker_never_contacts_a_kv_endpoint_outside_its_peers(pipeline):
    """Params that name another host (here 127.0.0.2, also this machine, and `localhost`, a name the
    peers do not list) are refused before any connection: the listener there sees nobody, so no token
    went to it; the decode worker recomputes (its policy) and the refusal is counted."""
    d = pipeline.decode
    listener = socket.socket()
    listener.bind(("127.0.0.2", 0))
    listener.listen(8)
    listener.settimeout(0.5)
    try:
        prompt = fresh_prompt(40, seed=72)
        genuine = prefill_params(pipeline, prompt)
        for host in ("127.0.0.2", "localhost"):
            forged = dict(genuine, remote_host=host, remote_port=listener.getsockname()[1])
            failed0 = sample(d.metrics_text(), m.KV_TRANSFER_FAILURES_TOTAL.name, reason=c.UNTRUSTED_PEER)
            recv0 = sample(d.metrics_text(), m.KV_TRANSFER_BYTES_TOTAL.name, direction="received")
            r = httpx.post(
                f"{d.url}/v1/completions", json=body(prompt, kv_transfer_params=forged), headers=AUTH, timeout=30
            )
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == colocated_tokens(pipeline, prompt)
            text = d.metrics_text()
            assert sample(text, m.KV_TRANSFER_FAILURES_TOTAL.name, reason=c.UNTRUSTED_PEER) == failed0 + 1
            assert sample(text, m.KV_TRANSFER_BYTES_TOTAL.name, direction="received") == recv0
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()
    # The genuine lease was never acked (its host was not the one named): it expires on its own (3 s).
    wait_until(lambda: pool_whole(pipeline.prefill), timeout=10, what="the unclaimed lease expiring")


# -- the router -------------------------------------------------------------------------------------------
def test_a_router_without_the_token_gets_nothing_from_the_workers(pipeline, logdir, tmp_path):
    wrong = tmp_path / "wrong-token"
    wrong.write_text(secrets.token_urlsafe(24))
    r = router(
        logdir,
        "--prefill",
        pipeline.prefill.url,
        "--decode",
        pipeline.decode.url,
        "--auth-token-file",
        str(wrong),
        name="router-wrong-token",
    ).start()
    try:

        def up() -> bool:
            assert r.alive(), r.log()
            try:
                return httpx.get(f"{r.url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout=30, what="the router up")
        time.sleep(1.0)  # a few probe rounds
        assert httpx.get(f"{r.url}/ready").status_code == 503
        workers = httpx.get(f"{r.url}/workers", headers={"Authorization": f"Bearer {wrong.read_text()}"}).json()
        assert {w["healthy"] for w in workers["workers"]} == {False}
        assert all("401" in w["last_error"] for w in workers["workers"]), workers
        assert_error(httpx.post(f"{r.url}/v1/completions", json=body([5, 6, 7]), timeout=10), 503)
    finally:
        r.stop()


@pytest.fixture(scope="module")
def keyed_router(pipeline, logdir, token_file, tmp_path_factory):
    """A second router in front of the pipeline's workers, with client API keys."""
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    first, second = "sk-" + secrets.token_urlsafe(16), "sk-" + secrets.token_urlsafe(16)
    keys.write_text(f"# client keys\n{first}\n\n{second}\n")
    r = authenticated(
        router(
            logdir,
            "--prefill",
            pipeline.prefill.url,
            "--decode",
            pipeline.decode.url,
            "--api-key-file",
            str(keys),
            name="router-keys",
        ),
        token_file,
    )
    start_all(r)
    try:
        yield r, keys, first, second
    finally:
        r.stop()


def test_client_api_keys_on_the_router_are_401_in_openai_shape_and_counted(keyed_router):
    r, keys, first, second = keyed_router
    before = codes(r.metrics_text())
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Bearer {TOKEN}"}):
        assert_401(httpx.post(f"{r.url}/v1/completions", json=body([5, 6, 7]), headers=headers, timeout=10))
        assert_401(httpx.get(f"{r.url}/v1/models", headers=headers))
    with openai.OpenAI(base_url=f"{r.url}/v1", api_key="sk-wrong", max_retries=0, timeout=30) as client:
        with pytest.raises(openai.AuthenticationError) as raised:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
        assert raised.value.status_code == 401 and raised.value.code == "invalid_api_key"
    after = codes(r.metrics_text())
    assert after.get("401", 0) - before.get("401", 0) == 7, "every 401 counted in pdfleet_router_requests_total"
    for key in (first, second):
        with openai.OpenAI(base_url=f"{r.url}/v1", api_key=key, max_retries=0, timeout=60) as client:
            assert [x.id for x in client.models.list().data] == [MODEL]
            done = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
            assert done.usage.completion_tokens == 4
    # Probes and scrapes stay open; /workers (worker addresses) needs the deployment token, not a client key.
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{r.url}{path}").status_code == 200, path
    assert_401(httpx.get(f"{r.url}/workers", headers={"Authorization": f"Bearer {first}"}))
    assert httpx.get(f"{r.url}/workers", headers=AUTH).status_code == 200
    # A key added to the file works at once, a removed one no more: no restart.
    third = "sk-" + secrets.token_urlsafe(16)
    replace(keys, f"{first}\n{third}\n")
    wait_until(
        lambda: httpx.get(f"{r.url}/v1/models", headers={"Authorization": f"Bearer {third}"}).status_code == 200,
        timeout=5,
        what="the new key accepted",
    )
    assert_401(httpx.get(f"{r.url}/v1/models", headers={"Authorization": f"Bearer {second}"}))


def replace(path, text: str) -> None:
    """As kubelet updates a Secret volume: a new file swapped in (a new inode), never a partial write."""
    tmp = path.with_name(f".{path.name}.new")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_optional_api_key_file_requires_keys_once_it_appears(tmp_path):
    keys = tmp_path / "api-keys"
    cfg = RouterConfig(
        tiers={"default": TierConfig("default", workers=["http://127.0.0.1:9"])},
        default_tier="default",
        api_key_file=str(keys),
        api_key_file_optional=True,
    )
    with TestClient(build_app(cfg), raise_server_exceptions=False) as client:
        assert client.get("/v1/models").status_code == 200
        replace(keys, "sk-one\n")
        time.sleep(auth.RECHECK_S + 0.1)
        assert_401(client.get("/v1/models"))
        assert client.get("/v1/models", headers={"Authorization": "Bearer sk-one"}).status_code == 200
        keys.unlink()  # a Secret volume caught mid-update: the last keys stay required
        time.sleep(auth.RECHECK_S + 0.1)
        assert_401(client.get("/v1/models"))
    with pytest.raises(ValueError, match="does not exist"):
        build_app(RouterConfig(tiers=cfg.tiers, default_tier="default", api_key_file=str(tmp_path / "missing")))
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ValueError, match="too short"):
        build_app(RouterConfig(tiers=cfg.tiers, default_tier="default", auth_token_file=str(short)))


# -- rotation with no restart --------------------------------------------------------------------------------
def test_a_rotated_token_is_taken_up_without_a_restart(logdir, model_dir, tmp_path):
    """Each process reads its own copy of the Secret, as pods do; kubelet updates them at different moments.
    The router sees the new token first: workers still on the old one get it retried with the old one; then
    the workers see it: the old one stays valid for the grace period, a token never issued never is."""
    old, new = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    files = {name: tmp_path / f"{name}-token" for name in ("prefill", "decode", "router")}
    for f in files.values():
        f.write_text(old + "\n")
    p = worker(logdir, model_dir, "prefill", "--auth-token-file", str(files["prefill"]), name="rot-prefill")
    d = worker(
        logdir,
        model_dir,
        "decode",
        "--auth-token-file",
        str(files["decode"]),
        "--kv-on-failure",
        "fail",
        name="rot-decode",
    )
    start_all(p, d)
    r = router(
        logdir, "--prefill", p.url, "--decode", d.url, "--auth-token-file", str(files["router"]), name="rot-router"
    )
    try:
        start_all(r)

        def through_router() -> int:
            resp = httpx.post(f"{r.url}/v1/completions", json=body(fresh_prompt(40, seed=80)), timeout=30)
            assert resp.status_code == 200, resp.text
            return sample(p.metrics_text(), m.KV_TRANSFER_BYTES_TOTAL.name, direction="sent")

        sent = through_router()
        replace(files["router"], new + "\n")
        time.sleep(auth.RECHECK_S + 0.2)
        assert through_router() > sent, "router on the new token, workers on the old: still served, KV pulled"
        sent = through_router()
        replace(files["prefill"], new + "\n")  # the prefill worker next, the decode worker (the puller) last
        time.sleep(auth.RECHECK_S + 0.2)
        assert through_router() > sent, "the decode worker pulls with the old token: still accepted"
        replace(files["decode"], new + "\n")
        time.sleep(auth.RECHECK_S + 0.2)
        sent = through_router()
        assert through_router() > sent
        for token in (new, old):
            assert httpx.get(f"{p.url}/load", headers={"Authorization": f"Bearer {token}"}).status_code == 200
        assert_401(httpx.get(f"{p.url}/load", headers={"Authorization": f"Bearer {secrets.token_urlsafe(24)}"}))
        assert r.alive() and p.alive() and d.alive()
    finally:
        for proc in (r, p, d):
            proc.stop()


def test_secret_file_rotation_grace_and_constant_time_match(tmp_path):
    now = [100.0]
    path = tmp_path / "token"
    a, b = "a" * 20, "b" * 20
    path.write_text(f"{a}\n")
    token = auth.SecretFile(str(path), "token", min_chars=16, grace_s=60, recheck_s=0, clock=lambda: now[0])
    assert token.for_sending() == [a] and token.accepts(a) and not token.accepts(b) and not token.accepts(None)
    replace(path, f"{b}\n")
    assert token.for_sending() == [b, a] and token.accepts(a) and token.accepts(b)
    now[0] += 61
    assert token.for_sending() == [b] and not token.accepts(a) and token.accepts(b)
    replace(path, "\n# nothing\n")  # unusable: keep what was read
    assert token.for_sending() == [b]
    replace(path, f"{a}\n{b}\n")  # manual rotation: send the first, accept both
    assert token.for_sending() == [a] and token.accepts(b)
    assert auth.matches("x", ["y", "x"]) and not auth.matches("x", []) and not auth.matches("\udcff", ["x"])
    assert auth.bearer("Bearer  abc ") == "abc" and auth.bearer("bearer abc") == "abc"
    assert auth.bearer("Basic abc") is None and auth.bearer("Bearer") is None and auth.bearer(None) is None


# -- the peer set and the connector on their own ---------------------------------------------------------------
def test_kv_peers_match_addresses_cidrs_and_names_and_never_resolve_the_params_host():
    asked: list[str] = []

    def resolver(name: str) -> set[str]:
        asked.append(name)
        return {"10.1.0.5", "10.1.0.6"}

    peers = KVPeers.from_spec(
        "chat-prefill.team-a.svc:8001, 127.0.0.1, [::1]:9, 192.168.0.0/16:8001", resolver=resolver
    )
    assert peers.allows("10.1.0.5", 8001) and peers.allows("10.1.0.6", 8001)
    assert not peers.allows("10.1.0.5", 8002), "the port is part of the peer"
    assert peers.allows("127.0.0.1", 40000) and peers.allows("::1", 9) and not peers.allows("::1", 10)
    assert peers.allows("192.168.7.7", 8001) and not peers.allows("192.168.7.7", 80)
    assert peers.allows("::ffff:10.1.0.5", 8001), "an IPv4-mapped address is that address"
    assert peers.allows("CHAT-PREFILL.team-a.svc.", 8001), "the peer's own name"
    asked.clear()
    for host in ("evil.example.com", "10.1.0.5.nip.io", "chat-prefill.team-b.svc", "10.1.0.7", "169.254.169.254"):
        assert not peers.allows(host, 8001), host
    assert "evil.example.com" not in asked and "10.1.0.5.nip.io" not in asked, "a name in the params is never resolved"
    with pytest.raises(ValueError, match="port"):
        parse("host:99999")
    with pytest.raises(ValueError, match="no peer"):
        parse(" , ")


def _lease_server(token) -> tuple[TcpKVConnector, LeaseTable, list[str], KVTransferParams]:
    """A KV endpoint holding one lease (req-1, blocks 3 and 4) and the params that name it."""
    freed: list[str] = []
    leases = LeaseTable(30.0, freed.append)
    leases.add("req-1", [3, 4], 20)
    server = TcpKVConnector("127.0.0.1", 0, token=token, peers=KVPeers.from_spec("127.0.0.1"))
    host, port = server.serve(leases, lambda ids: [{"kv": torch.zeros(2, 1, len(ids), 16, 4)}], "hash")
    params = KVTransferParams("e", host, port, "tcp", "hash", 16, 30.0, [RemotePrompt("req-1", [3, 4], 20, "h")])
    return server, leases, freed, params


def test_tcp_connector_token_in_the_frame_and_peers_on_connect(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    token = auth.token_file(str(path))
    server, leases, freed, params = _lease_server(token)
    try:
        refused: list[str] = []
        server.on_refused = refused.append
        anonymous = TcpKVConnector(peers=KVPeers.from_spec("127.0.0.1"))
        for call in (
            lambda: anonymous.pull(params, params.prompts[0], 0, [0], "hash", 5),
            lambda: anonymous.release(params, params.prompts[0], True, 5),
        ):
            with pytest.raises(c.KVTransferError) as err:
                call()
            assert err.value.reason == c.UNAUTHORIZED
        assert len(leases) == 1 and not freed and refused == [c.UNAUTHORIZED] * 2
        # A puller whose peers do not include the endpoint never connects: not even with the right token.
        elsewhere = TcpKVConnector(token=token, peers=KVPeers.from_spec("10.0.0.1"))
        with pytest.raises(c.KVTransferError) as err:
            elsewhere.pull(params, params.prompts[0], 0, [0], "hash", 5)
        assert err.value.reason == c.UNTRUSTED_PEER and refused == [c.UNAUTHORIZED] * 2
        puller = TcpKVConnector(token=token, peers=KVPeers.from_spec("127.0.0.1"))
        pulled = puller.pull(params, params.prompts[0], 0, [0, 1], "hash", 5)
        assert pulled.layers[0]["kv"].shape == (2, 1, 2, 16, 4)
        assert puller.release(params, params.prompts[0], True, 5) is True and freed == ["req-1"]
    finally:
        server.close()


def test_tcp_connector_retries_once_with_the_rotated_out_token(tmp_path):
    old, new = "o" * 20, "n" * 20
    server_file, puller_file = tmp_path / "server", tmp_path / "puller"
    server_file.write_text(old)
    puller_file.write_text(old)
    server, leases, freed, params = _lease_server(auth.token_file(str(server_file)))
    try:
        puller_token = auth.token_file(str(puller_file))
        replace(puller_file, new)
        time.sleep(auth.RECHECK_S + 0.1)
        assert puller_token.for_sending() == [new, old]
        connections = []
        accept = server._serve_conn
        server._serve_conn = lambda conn: (connections.append(conn), accept(conn))  # count connections
        puller = TcpKVConnector(token=puller_token, peers=KVPeers.from_spec("127.0.0.1"))
        assert puller.release(params, params.prompts[0], True, 5) is True and freed == ["req-1"]
        assert len(connections) == 2, "the new token refused, then the old one accepted"
    finally:
        server.close()
