"""The router's health probes: a worker that answers late stays in rotation for a few probes (it is busy, not
dead), one that refuses or errors leaves at once; pure, with httpx's mock transport, no processes."""

from __future__ import annotations

import asyncio

import httpx

from pdfleet_worker.router import upstreams as upstreams_mod
from pdfleet_worker.router.router_config import RouterConfig, TierConfig

URL = "http://w:1"


def probe_sequence(answers: list[str]) -> list[bool]:
    """healthy after each probe, the worker answering 'ok', 'timeout', 'refused' or '503' in turn."""
    it = iter(answers)

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/load":
            return httpx.Response(404)
        what = next(it)
        if what == "timeout":
            raise httpx.ReadTimeout("timed out", request=request)
        if what == "refused":
            raise httpx.ConnectError("connection refused", request=request)
        if what == "503":
            return httpx.Response(503, json={"ready": False, "error": "draining"})
        return httpx.Response(200, json={"ready": True, "model": "m", "waiting": 0, "running": 1})

    async def run() -> list[bool]:
        cfg = RouterConfig(
            tiers={"default": TierConfig("default", workers=[URL])}, default_tier="default", discovery="static"
        )
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            ups = upstreams_mod.Upstreams(cfg, client)
            await ups.refresh()
            (up,) = ups.all.values()
            seen = []
            for _ in answers:
                await ups.probe(up)
                seen.append(up.healthy)
            return seen

    return asyncio.run(run())


def test_late_answers_keep_a_busy_worker_in_rotation_until_the_limit():
    n = upstreams_mod.PROBE_TIMEOUTS_TO_EJECT
    assert n >= 2
    seen = probe_sequence(["ok"] + ["timeout"] * n + ["ok"])
    assert seen == [True] + [True] * (n - 1) + [False, True], "out after N silent probes in a row, back on an answer"
    assert probe_sequence(["ok", "timeout", "ok", "timeout", "ok"]) == [True] * 5, "the count is of probes in a row"


def test_refusals_and_error_answers_take_a_worker_out_at_once():
    assert probe_sequence(["ok", "refused", "ok"]) == [True, False, True]
    assert probe_sequence(["ok", "503"]) == [True, False]
    assert probe_sequence(["timeout", "ok"]) == [False, True], "a worker not yet in rotation enters on an answer only"
