"""The router's checks of a request against the strictest limits its tier's workers report (Router._validate): every
pool of a PD tier counts, the limits are computed once per set of probe answers and again as soon as a probe brings a
new one, and a tier with a vLLM worker or with no report is left to its workers."""

from __future__ import annotations

import httpx
import pytest

from pdfleet_worker.router import engines, proxy
from pdfleet_worker.router.router_config import RouterConfig, TierConfig
from pdfleet_worker.router.router_metrics import RouterMetrics
from pdfleet_worker.router.upstreams import Upstream, Upstreams
from pdfleet_worker.wire.errors import RequestError

PREFILL, DECODE = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
CLIENT = httpx.AsyncClient()  # never called: validation happens before any worker is


def pd_router(prefill_limits: dict | None, decode_limits: dict | None, decode_engine: str = engines.PDFLEET):
    """A PD tier whose workers' probes reported these limits (None: a load without any, as before a first probe)."""
    tier = TierConfig("default", prefill=[PREFILL], decode=[DECODE])
    cfg = RouterConfig(tiers={"default": tier}, default_tier="default")
    ups = Upstreams(cfg, CLIENT)
    ups.all[("default", "prefill", PREFILL)] = Upstream(
        PREFILL, "default", "prefill", load={} if prefill_limits is None else {"limits": prefill_limits}
    )
    ups.all[("default", "decode", DECODE)] = Upstream(
        DECODE, "default", "decode", decode_engine, load={} if decode_limits is None else {"limits": decode_limits}
    )
    return proxy.Router(cfg, ups, RouterMetrics(["default"], lambda: []), CLIENT), ups


def body(max_tokens: int) -> dict:
    return {"model": "m", "prompt": [5, 6, 7], "max_tokens": max_tokens, "stream": True}


def test_the_strictest_pool_decides_and_a_new_probe_answer_counts_at_once():
    router, ups = pd_router({"max_model_len": 4096}, {"max_model_len": 64})
    assert router._validate("default", body(32), chat=False) is True
    with pytest.raises(RequestError) as e:
        router._validate("default", body(100), chat=False)  # 3 + 100 tokens > the decode worker's 64
    assert e.value.status == 400
    kept = router._tier_limits("default")
    assert router._tier_limits("default") is kept, "unchanged loads: the same limits, not computed again"
    # a probe replaces the decode worker's load (a new dict): the next request sees its new limit
    ups.all[("default", "decode", DECODE)].load = {"limits": {"max_model_len": 4096}}
    assert router._validate("default", body(100), chat=False) is True
    assert router._tier_limits("default") is not kept
    # so does a worker that leaves the tier (discovery): the prefill pool's limit alone remains
    del ups.all[("default", "decode", DECODE)]
    ups.all[("default", "prefill", PREFILL)].load = {"limits": {"max_model_len": 16}}
    with pytest.raises(RequestError):
        router._validate("default", body(100), chat=False)


def test_a_tier_with_a_vllm_worker_or_no_report_is_left_to_its_workers():
    router, _ = pd_router({"max_model_len": 64}, {"max_model_len": 64}, decode_engine=engines.VLLM)
    assert router._validate("default", body(1000), chat=False) is True  # vLLM accepts what it accepts
    router, _ = pd_router(None, None)
    assert router._tier_limits("default") is None
    assert router._validate("default", {"model": "m", "prompt": "x"}, chat=False) is False
