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


def test_each_pool_takes_its_own_turns_between_tied_workers():
    """A PD request picks a prefill worker, then a decode worker. With one round-robin counter for both, the prefill
    pool saw only even turns: with two tied prefill workers (a lightly loaded fleet), every request went to the same
    one and the other idled. Each pool keeps its own turns."""
    prefill, decode = ["http://p:1", "http://p:2"], ["http://d:1", "http://d:2"]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"ready": True, "model": "m", "waiting": 0, "running": 0})

    async def run() -> list[tuple[str, str]]:
        cfg = RouterConfig(
            tiers={"default": TierConfig("default", prefill=prefill, decode=decode)},
            default_tier="default",
            discovery="static",
        )
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            ups = upstreams_mod.Upstreams(cfg, client)
            await ups.refresh()
            await ups.probe_all()
            picks = []
            for _ in range(4):  # four requests one after another: every worker tied at zero load
                p = ups.pick("default", "prefill", set())
                d = ups.pick("default", "decode", set())
                picks.append((p.url, d.url))
            return picks

    picks = asyncio.run(run())
    assert [p for p, _ in picks] == prefill * 2, picks
    assert [d for _, d in picks] == decode * 2, picks


def retried(failures: list[Exception | None], workers: int = 1):
    """router._with_retries over `workers` decode workers whose calls fail in turn as `failures` says (None: they
    answer): the answer's worker (or the error raised), the workers' health after, the calls' workers in order."""
    from pdfleet_worker.router import proxy
    from pdfleet_worker.router.router_metrics import RouterMetrics

    urls = [f"http://d:{i}" for i in range(1, workers + 1)]
    cfg = RouterConfig(
        tiers={"default": TierConfig("default", prefill=["http://p:1"], decode=urls)},
        default_tier="default",
        discovery="static",
    )
    client = httpx.AsyncClient()
    ups = upstreams_mod.Upstreams(cfg, client)
    for url in urls:
        ups.all[("default", "decode", url)] = upstreams_mod.Upstream(url, "default", "decode", healthy=True)
    router = proxy.Router(cfg, ups, RouterMetrics(["default"], lambda: []), client)
    it, calls = iter(failures), []

    async def attempt(up):  # noqa: ANN001, ANN202
        calls.append(up.url)
        error = next(it)
        if error is not None:
            raise error
        return proxy.Answer(up, 200, {}, b"{}")

    async def run():  # noqa: ANN202
        try:
            return (await router._with_retries("default", "decode", attempt)).upstream.url
        except proxy.RequestError as e:
            return e
        finally:
            await client.aclose()

    got = asyncio.run(run())
    return got, [ups.all[("default", "decode", u)].healthy for u in urls], calls


def test_a_connect_that_times_out_is_tried_once_more_and_leaves_the_worker_in_rotation():
    late = httpx.ConnectTimeout("timed out")
    got, healthy, calls = retried([late, None])
    assert (got, healthy, calls) == ("http://d:1", [True], ["http://d:1", "http://d:1"])
    # twice in a row: out of rotation, and the client gets the router's 503
    got, healthy, calls = retried([late, late])
    assert isinstance(got, Exception) and got.status == 503 and (healthy, len(calls)) == ([False], 2)
    # a refused connect is no busy host: out at once, no second try on it
    got, healthy, calls = retried([httpx.ConnectError("refused")])
    assert isinstance(got, Exception) and (healthy, calls) == ([False], ["http://d:1"])
    # another worker left: it is tried first, and the late one stays in rotation
    got, healthy, calls = retried([late, None], workers=2)
    assert got == calls[1] != calls[0] and healthy == [True, True]
