"""`pdfleet router --workers-file`: the file's format and errors, and a running router following rewrites of it (what
`pdfleet up` does when it scales)."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest

from pdfleet_worker.router import router_config, workers_file
from tests.support.components import free_port
from tests.worker.processes import Proc, wait_until


def parse(*argv: str) -> router_config.RouterConfig:
    p = argparse.ArgumentParser()
    router_config.add_arguments(p)
    return router_config.from_args(p.parse_args(list(argv)))


def test_file_defines_pools_like_the_flags_and_rejects_nonsense(tmp_path):
    path = tmp_path / "workers.json"
    workers_file.write(path, {"prefill": ["http://127.0.0.1:1"], "decode": ["http://127.0.0.1:2/"], "workers": []})
    assert workers_file.read(path) == {
        "prefill": ["http://127.0.0.1:1"],
        "decode": ["http://127.0.0.1:2/"],
        "workers": [],
    }
    assert not [p for p in tmp_path.iterdir() if p.name != "workers.json"], "no temporary file left behind"
    cfg = parse("--workers-file", str(path))
    assert cfg.workers_file == str(path)
    assert cfg.tiers["default"].pools() == {"prefill": ["http://127.0.0.1:1"], "decode": ["http://127.0.0.1:2"]}
    workers_file.write(
        path, {"prefill": ["http://127.0.0.1:1"], "decode": ["http://127.0.0.1:2", "gold=http://127.0.0.1:3"]}
    )
    with pytest.raises(ValueError, match="go together"):  # tier gold has decode only: the flags' own rule
        parse("--workers-file", str(path))
    workers_file.write(path, {"workers": ["http://127.0.0.1:1"]})
    with pytest.raises(ValueError, match="one or the other"):
        parse("--workers-file", str(path), "--workers", "http://127.0.0.1:2")
    for text, msg in [
        ("{", "not JSON"),
        ("[]", "expected an object"),
        ('{"gpus": []}', "unknown keys"),
        ('{"decode": "http://x:1"}', "must be a list"),
    ]:
        path.write_text(text)
        with pytest.raises(ValueError, match=msg):
            workers_file.read(path)
    with pytest.raises(ValueError, match="No such file"):
        workers_file.read(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="unknown keys"):
        workers_file.write(path, {"gpus": []})


def test_file_source_resolves_one_tier_and_role_and_raises_oserror_when_unreadable(tmp_path):
    path = tmp_path / "w.json"
    workers_file.write(
        path,
        {
            "prefill": ["http://127.0.0.1:1"],
            "decode": ["http://127.0.0.1:2", "http://localhost:4", "gold=http://127.0.0.1:3"],
        },
    )
    src = workers_file.WorkersFile(str(path), "default", "decode")
    assert {"http://127.0.0.1:2", "http://127.0.0.1:4"} <= src.resolve()
    assert "http://127.0.0.1:3" not in src.resolve()
    assert workers_file.WorkersFile(str(path), "gold", "decode").resolve() == {"http://127.0.0.1:3"}
    assert workers_file.WorkersFile(str(path), "default", "both").resolve() == set()
    path.write_text("not json")
    with pytest.raises(OSError, match="not JSON"):
        src.resolve()


def test_running_router_follows_rewrites_and_keeps_the_last_list_on_a_bad_file(tmp_path):
    # Nothing listens on these ports: discovery is what is checked (the workers show up unhealthy).
    p1, d1, d2 = (f"http://127.0.0.1:{free_port()}" for _ in range(3))
    path = tmp_path / "workers.json"
    workers_file.write(path, {"prefill": [p1], "decode": [d1]})
    r = Proc(
        "router-file",
        [
            "router",
            "--workers-file",
            str(path),
            "--discovery-interval",
            "0.2",
            "--health-interval",
            "0.5",
            "--log-level",
            "warning",
        ],
        tmp_path,
    ).start()

    def listed() -> set[tuple[str, str]]:
        try:
            return {(w["role"], w["url"]) for w in httpx.get(f"{r.url}/workers", timeout=2).json()["workers"]}
        except httpx.HTTPError:
            return set()

    try:
        wait_until(lambda: listed() == {("prefill", p1), ("decode", d1)}, timeout=30, what="the file's first list")
        workers_file.write(path, {"prefill": [p1], "decode": [d1, d2]})
        wait_until(lambda: ("decode", d2) in listed(), timeout=10, what="a decode worker added to the file")
        path.write_text(json.dumps({"decode": 3}))
        wait_until(lambda: "discovery of" in r.log(), timeout=10, what="the bad file logged")
        assert listed() == {("prefill", p1), ("decode", d1), ("decode", d2)}, "a bad file keeps the last list"
        workers_file.write(path, {"prefill": [p1], "decode": [d2]})
        wait_until(lambda: listed() == {("prefill", p1), ("decode", d2)}, timeout=10, what="a decode worker removed")
        assert httpx.get(f"{r.url}/ready", timeout=2).status_code == 503, "no worker answers: not ready"
    finally:
        assert r.stop() == 0
