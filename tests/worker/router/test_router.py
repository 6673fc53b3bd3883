"""The router's parts: picking policies, flags and tiers, and discovery by DNS (loopback) and by EndpointSlices (the
Kubernetes API emulator)."""

from __future__ import annotations

import argparse
import sys

import httpx
import pytest

from pdfleet_worker.router import discovery, picker, router_config
from tests.worker.processes import MODEL, Proc, wait_until, worker_urls


def parse(*argv: str) -> router_config.RouterConfig:
    p = argparse.ArgumentParser()
    router_config.add_arguments(p)
    return router_config.from_args(p.parse_args(list(argv)))


def test_picker_prefers_short_queues_low_kv_and_round_robins_ties():
    C = picker.Candidate
    assert (
        picker.pick("prefill", [C("a", waiting=3), C("b", waiting=1, running=9), C("c", waiting=1, inflight=1)]).url
        == "b"
    )
    assert (
        picker.pick(
            "prefill", [C("a", waiting=1, prompt_tokens_waiting=900), C("b", waiting=1, prompt_tokens_waiting=10)]
        ).url
        == "b"
    )
    assert (
        picker.pick("decode", [C("a", kv_usage=0.50), C("b", kv_usage=0.20, running=30), C("c", kv_usage=0.9)]).url
        == "b"
    )
    assert picker.pick("both", [C("a", running=3), C("b", waiting=1, running=1)]).url == "b"
    tied = [C("a"), C("b"), C("c")]
    assert [picker.pick("decode", tied, turn=t).url for t in range(4)] == ["a", "b", "c", "a"]
    assert picker.pick("decode", []) is None


def test_flags_define_tiers_aliases_and_reject_nonsense():
    cfg = parse(
        "--prefill",
        "http://p:8000",
        "latency=http://p2:8000",
        "--decode",
        "http://d:8000",
        "latency=http://d2:8000",
        "--workers",
        "batch=http://c:8000",
        "--model-alias",
        "fast=latency",
    )
    assert set(cfg.tiers) == {"default", "latency", "batch"} and cfg.default_tier == "default"
    assert cfg.tiers["latency"].pools() == {"prefill": ["http://p2:8000"], "decode": ["http://d2:8000"]}
    assert cfg.tiers["batch"].pools() == {"both": ["http://c:8000"]} and not cfg.tiers["batch"].disaggregated
    assert cfg.aliases == {"fast": "latency"}
    for argv, msg in [
        (("--prefill", "http://p:1"), "go together"),
        (("--workers", "http://c:1", "--prefill", "http://p:1", "--decode", "http://d:1"), "not both"),
        (("--workers", "c:8000"), "not an http"),
        ((), "no workers"),
        (("--workers", "http://c:1", "--model-alias", "x=gold"), "no workers"),
        (("--workers", "http://c:1", "--default-tier", "gold"), "default tier"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse(*argv)


def test_dns_discovery_resolves_every_address_and_static_keeps_the_url():
    found = discovery.Dns("http://localhost:8123").resolve()
    assert "http://127.0.0.1:8123" in found and all(u.endswith(":8123") for u in found)
    assert discovery.Static("http://localhost:8123/").resolve() == {"http://localhost:8123"}
    assert isinstance(discovery.make_source("http://10.1.2.3:80", "auto"), discovery.Static)
    assert isinstance(discovery.make_source("http://svc.ns.svc:80", "auto"), discovery.Dns)
    with pytest.raises(OSError):
        discovery.Dns("http://no-such-host.invalid:80").resolve()


def test_endpoint_slices_ready_addresses_and_port():
    slices = [
        {
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8000}, {"name": "kv", "port": 9000}],
            "endpoints": [
                {"addresses": ["10.0.0.1"], "conditions": {"ready": True}},
                {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                {"addresses": ["10.0.0.3"]},
            ],
        },
        {"addressType": "IPv6", "ports": [{"port": 8001}], "endpoints": [{"addresses": ["fd00::5"]}]},
    ]
    assert discovery.endpoints_from_slices(slices, 80) == {
        "http://10.0.0.1:8000",
        "http://10.0.0.3:8000",
        "http://[fd00::5]:8001",
    }


def test_endpoint_slices_without_the_kubernetes_client_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "kubernetes", None)
    with pytest.raises(ValueError, match="needs the kubernetes Python client"):
        discovery.EndpointSlices("http://svc.ns.svc:8000")


def test_router_discovers_workers_by_dns_of_a_hostname(pipeline, logdir):
    port = pipeline.colo.port
    r = Proc(
        "router-dns",
        [
            "router",
            "--workers",
            f"http://localhost:{port}",
            "--discovery",
            "dns",
            "--health-interval",
            "0.25",
            "--log-level",
            "warning",
        ],
        logdir,
    ).start()
    try:
        r.wait_ready()
        urls = {w["url"]: w["healthy"] for w in httpx.get(f"{r.url}/workers").json()["workers"]}
        assert urls.get(f"http://127.0.0.1:{port}") is True, urls
        resp = httpx.post(f"{r.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert (
            resp.status_code == 200 and worker_urls(r)[resp.headers["x-pdfleet-worker"]] == f"http://127.0.0.1:{port}"
        )
    finally:
        assert r.stop() == 0


def endpoint_slice(name: str, service: str, addresses: list[tuple[str, bool]], port: int) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "serving", "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [a], "conditions": {"ready": ready}} for a, ready in addresses],
    }


def test_router_discovers_workers_from_endpoint_slices(pipeline, logdir, kube):
    port = pipeline.colo.port
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "serving"}})
    kube.create(endpoint_slice("colo-abc", "colo", [("127.0.0.1", True), ("127.0.0.2", False)], port))
    kube.create(endpoint_slice("other-xyz", "other", [("127.0.0.3", True)], port))
    r = Proc(
        "router-eps",
        [
            "router",
            "--workers",
            "http://colo.serving.svc:8000",
            "--discovery",
            "endpointslices",
            "--health-interval",
            "0.25",
            "--discovery-interval",
            "0.5",
            "--log-level",
            "warning",
        ],
        logdir,
    )
    r.env = {"KUBECONFIG": kube.env["KUBECONFIG"]}
    r.start()
    try:
        r.wait_ready()
        workers = httpx.get(f"{r.url}/workers").json()["workers"]
        assert [w["url"] for w in workers] == [f"http://127.0.0.1:{port}"], "ready endpoints of this Service only"
        resp = httpx.post(f"{r.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert resp.status_code == 200
        kube.delete("endpointslices.discovery.k8s.io", "colo-abc", namespace="serving")
        wait_until(
            lambda: httpx.get(f"{r.url}/ready").status_code == 503,
            timeout=10,
            what="the router dropping a worker that left the EndpointSlice",
        )
        assert (
            httpx.post(
                f"{r.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30
            ).status_code
            == 503
        )
    finally:
        assert r.stop() == 0


def test_router_and_cli_import_no_torch():
    """The router runs in a small image: nothing on its import path may pull torch in."""
    import subprocess

    code = (
        "import sys; import pdfleet_worker.cli, pdfleet_worker.router.app, pdfleet_worker.router.runner, "
        "pdfleet_worker.router.picker, pdfleet_worker.server.worker_config, pdfleet_worker.metrics; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'safetensors')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out
