"""The router's engine kinds (`[TIER=][ENGINE@]URL`, --engine, the workers file) and vLLM's load from its metrics text;
pure, no processes (tests/worker/router/test_vllm_router.py runs a real vLLM)."""

from __future__ import annotations

import argparse

import pytest

from pdfleet_worker.router import engines, router_config, workers_file


def parse(*argv: str) -> router_config.RouterConfig:
    p = argparse.ArgumentParser()
    router_config.add_arguments(p)
    return router_config.from_args(p.parse_args(list(argv)))


def test_entries_name_their_engine_and_bare_urls_take_the_default():
    assert engines.split_engine("vllm@http://v:8000") == ("vllm", "http://v:8000")
    assert engines.split_engine("http://v:8000") == ("pdfleet", "http://v:8000")
    assert engines.split_engine("http://v:8000", default="vllm") == ("vllm", "http://v:8000")
    assert engines.split_engine("http://user@v:8000") == ("pdfleet", "http://user@v:8000"), "user info is no engine"
    with pytest.raises(ValueError, match="unknown engine 'sglang'; known: pdfleet, vllm"):
        engines.split_engine("sglang@http://v:8000")
    with pytest.raises(ValueError, match="empty engine"):
        engines.split_engine("@http://v:8000")


def test_flags_build_per_url_engines():
    cfg = parse("--workers", "vllm@http://v:1/", "http://p:2", "fast=vllm@http://f:3")
    default, fast = cfg.tiers["default"], cfg.tiers["fast"]
    assert default.workers == ["http://v:1", "http://p:2"] and fast.workers == ["http://f:3"]
    assert (default.engine_of("http://v:1"), default.engine_of("http://p:2"), fast.engine_of("http://f:3")) == (
        "vllm",
        "pdfleet",
        "vllm",
    )
    cfg = parse("--engine", "vllm", "--workers", "http://v:1", "pdfleet@http://p:2")
    assert cfg.engine == "vllm"
    assert cfg.tiers["default"].engines == {"http://v:1": "vllm", "http://p:2": "pdfleet"}
    assert parse("--workers", "http://p:2").tiers["default"].engine_of("http://p:2") == "pdfleet", (
        "pdfleet stays the default"
    )


def test_flags_build_pd_tiers_of_one_engine():
    cfg = parse(
        "--engine",
        "vllm",
        "--prefill",
        "http://p:1",
        "fast=pdfleet@http://q:3",
        "--decode",
        "vllm@http://d:2",
        "fast=pdfleet@http://e:4",
        "--workers",
        "colo=http://c:5",
    )
    default, fast = cfg.tiers["default"], cfg.tiers["fast"]
    assert (default.pd_engine, default.prefill, default.decode) == ("vllm", ["http://p:1"], ["http://d:2"])
    assert (fast.pd_engine, fast.prefill, fast.decode) == ("pdfleet", ["http://q:3"], ["http://e:4"])
    assert cfg.tiers["colo"].engine_of("http://c:5") == "vllm"
    assert parse("--prefill", "http://p:1", "--decode", "http://d:2").tiers["default"].pd_engine == "pdfleet"


def test_flags_refuse_what_the_router_cannot_drive():
    with pytest.raises(
        ValueError,
        match=r"prefill and decode workers must run one engine .*"
        r"got vllm@http://v:1 and pdfleet@http://d:2",
    ):
        parse("--prefill", "vllm@http://v:1", "--decode", "http://d:2")
    with pytest.raises(ValueError, match="must run one engine"):
        parse("--engine", "vllm", "--prefill", "http://p:1", "pdfleet@http://p:2", "--decode", "http://d:2")
    with pytest.raises(ValueError, match="listed as both vllm and pdfleet"):
        parse("--workers", "vllm@http://v:1", "http://v:1")
    with pytest.raises(ValueError, match="unknown engine"):
        parse("--workers", "tgi@http://v:1")
    with pytest.raises(SystemExit):  # argparse: --engine choices
        parse("--engine", "tgi", "--workers", "http://v:1")


def test_workers_file_entries_and_sources_per_engine(tmp_path):
    assert workers_file.entry("http://v:1", engine="vllm") == "vllm@http://v:1"
    assert workers_file.entry("http://v:1", tier="fast", engine="vllm") == "fast=vllm@http://v:1"
    assert workers_file.entry("http://p:1") == "http://p:1"
    path = tmp_path / "workers.json"
    workers_file.write(
        path, {"workers": ["vllm@http://127.0.0.1:1", "http://127.0.0.1:2", "gold=vllm@http://127.0.0.1:3"]}
    )
    cfg = parse("--workers-file", str(path))
    assert cfg.tiers["default"].engines == {"http://127.0.0.1:1": "vllm", "http://127.0.0.1:2": "pdfleet"}

    def source(tier: str, engine: str, default: str = "pdfleet") -> set[str]:
        return workers_file.WorkersFile(str(path), tier, "both", "static", engine, default).resolve()

    assert source("default", "vllm") == {"http://127.0.0.1:1"}
    assert source("default", "pdfleet") == {"http://127.0.0.1:2"}
    assert source("default", "vllm", default="vllm") == {"http://127.0.0.1:1", "http://127.0.0.1:2"}
    assert source("gold", "vllm") == {"http://127.0.0.1:3"}

    path.write_text('{"workers": ["tgi@http://127.0.0.1:1"]}')
    with pytest.raises(ValueError, match="workers: unknown engine 'tgi'"):
        workers_file.read(path)
    with pytest.raises(OSError, match="unknown engine"):  # a running router keeps its last list
        source("default", "pdfleet")
    workers_file.write(path, {"prefill": ["http://127.0.0.1:1"], "decode": ["vllm@http://127.0.0.1:2"]})
    with pytest.raises(ValueError, match="must run one engine"):  # at start
        parse("--workers-file", str(path))
    with pytest.raises(OSError, match=r"decode: tier 'default'.*run pdfleet .*vllm@http://127.0.0.1:2 cannot join"):
        workers_file.WorkersFile(str(path), "default", "decode").resolve()  # later: the last list is kept
    workers_file.write(path, {"prefill": ["vllm@http://127.0.0.1:1"], "decode": ["vllm@http://127.0.0.1:2"]})
    assert parse("--workers-file", str(path)).tiers["default"].pd_engine == "vllm"
    assert workers_file.WorkersFile(str(path), "default", "decode", "static", "vllm").resolve() == {
        "http://127.0.0.1:2"
    }


# What vLLM 0.32's /metrics says (abridged): one engine per data-parallel rank, labels engine and model_name.
METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="my model"} 3.0
vllm:num_requests_running{engine="1",model_name="my model"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="my model"} 4.0
vllm:num_requests_waiting{engine="1",model_name="my model"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="my model",reason="capacity"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="my model"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="my model"} 0.5
vllm:prompt_tokens_total{engine="0",model_name="my model"} 123.0
"""


def test_vllm_load_sums_queues_and_takes_the_fullest_cache():
    assert engines.vllm_load(METRICS) == {"waiting": 5, "running": 5, "kv_usage": 0.5}
    assert engines.vllm_load("vllm:num_requests_waiting 2\nvllm:kv_cache_usage_perc NaN\n") == {"waiting": 2}
    assert engines.vllm_load("") == {}
    assert engines.served_models({"object": "list", "data": [{"id": "a"}, {"id": "b"}]}) == ["a", "b"]
    with pytest.raises(ValueError, match="no `data` list"):
        engines.served_models({"error": "x"})
