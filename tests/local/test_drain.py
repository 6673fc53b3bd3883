"""Issue 24, rule 5: `pdfleet up` scales a pool down without losing a request. The supervisor takes the replica out of
the router's workers file, SIGTERMs it once the router has let it go, and the worker lets its open streams finish (a
decode replica) and keeps serving KV pulls for its open leases until they are acked (a prefill replica), then exits 0.

Real processes under the real Supervisor, on a clock the test advances: the SIGTERM comes when the test says, while
the victim is frozen (SIGSTOP) mid-work, so that the drain always has work to let finish, at any machine speed."""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal

import httpx
import openai

from pdfleet_operator.decide.placement import FleetPlan, PlannedPool
from pdfleet_operator.local import machine
from pdfleet_operator.local import spec as specs
from pdfleet_operator.local import supervisor as sv
from tests.local.conftest import ROOT, run_token, write_spec
from tests.support.components import free_port

# NOTE: long enough that a stream outlives the moments between its first event and the victim's SIGSTOP on a fast
# host: at 160 tokens (~0.25 s for the tiny preset on an AVX-512 EPYC) one finished first once in a full suite.
MAX_TOKENS = 640


class Clock:
    """Real time plus what the test adds: the supervisor's deadlines (SIGTERM after leaving the router) on demand."""

    def __init__(self) -> None:
        self.skip = 0.0

    def __call__(self) -> float:
        return asyncio.get_event_loop().time() + self.skip


def plan(prefill: int, decode: int) -> FleetPlan:
    return FleetPlan((PlannedPool("prefill", "cpu", prefill), PlannedPool("decode", "cpu", decode)))


def stream(url: str, prompt: list[int], ids: dict, key: int) -> tuple[list[int], str | None]:
    """A greedy stream's token ids and finish reason; `ids[key]`: the decode and prefill worker ids that served it."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=300)
    raw = client.completions.with_raw_response.create(
        model="tiny",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ids[key] = (raw.headers["x-pdfleet-decode"], raw.headers["x-pdfleet-prefill"])
    tokens, reason = [], None
    for chunk in raw.parse():
        if chunk.choices:
            tokens += chunk.choices[0].model_extra.get("token_ids") or []
            reason = chunk.choices[0].finish_reason or reason
    return tokens, reason


def greedy(url: str, prompt: list[int]) -> list[int]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()["choices"][0]["token_ids"]


async def until(predicate, what: str, timeout: float = 120.0, sup: sv.Supervisor | None = None):
    loop = asyncio.get_event_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if sup is not None:
            await sup.tick()
        value = await asyncio.to_thread(predicate) if not asyncio.iscoroutinefunction(predicate) else await predicate()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what} not reached within {timeout}s")


def routed(router: str, run_dir, healthy_only: bool = False) -> dict[str, str]:
    """The router's worker ids -> URLs of the workers it has in its lists now (in rotation only, with healthy_only)."""
    answer = httpx.get(f"{router}/workers", headers=run_token(run_dir), timeout=5).json()
    return {w["id"]: w["url"] for w in answer["workers"] if w["healthy"] or not healthy_only}


async def scale_down_victim(
    sup: sv.Supervisor, clock: Clock, victim: sv.Replica, target: FleetPlan, frozen: sv.Replica, still_busy
) -> None:
    """With `frozen` stopped (SIGSTOP: its work cannot move on), shrink to `target` (the supervisor drains `victim`),
    wait until the router no longer lists the victim, check `still_busy()`, SIGTERM the victim on the supervisor's
    clock, and let `frozen` go on (SIGCONT) whatever happens."""
    try:
        sup.scale_to(target, why="test")
        assert victim.state == sv.DRAINING, [r.name for r in sup.workers if r.state == sv.DRAINING]
        await until(lambda: victim.url not in routed(sup.router.url, sup.run_dir).values(), "the router letting go")
        assert await asyncio.to_thread(still_busy), "the victim has work open when its SIGTERM comes"
        clock.skip += sv.LEAVE_ROUTER_S
        await sup.tick()
        assert victim.term_at is None and victim.kill_at is not None, "SIGTERM sent"
    finally:
        frozen.child.signal(signal.SIGCONT)


def test_scale_down_under_streaming_load_loses_no_request(tmp_path, model_dir):
    asyncio.run(_scale_down(tmp_path, model_dir))


async def _scale_down(tmp_path, model_dir):
    local = specs.load(write_spec(tmp_path, model_dir), ROOT / "examples" / "acceleratorclasses.yaml")
    clock = Clock()
    # a drain window long enough for any machine: the test is about what a drain keeps, not how fast it is
    sup = sv.Supervisor(
        local, tmp_path / "run", free_port(), threads=1, machine=machine.Machine(2, 0), clock=clock, drain_s=600.0
    )
    pool = concurrent.futures.ThreadPoolExecutor(8)
    try:
        sup.start(plan(2, 2))
        await sup.wait_ready(180)
        url, loop = sup.router.url, asyncio.get_event_loop()
        prompts = [[7 + i, 8, 9, 10 + i] for i in range(8)]
        # /ready needs one worker per role; the streams below need the router to route to every one of them (with
        # no decode worker in rotation a prefill worker decodes the request itself: `x-pdfleet-decode: local`)
        everyone = {r.url for r in sup.active()}
        await until(lambda: set(routed(url, sup.run_dir, healthy_only=True).values()) >= everyone, "all in rotation")

        # --- a decode replica: its streams finish, all their tokens, then it exits 0 ----------------------------
        victim = sorted(sup.active("decode"), key=sup.workers.index)[-1]  # the supervisor drains the newest
        ids: dict = {}
        streams = {i: loop.run_in_executor(pool, stream, url, prompts[i], ids, i) for i in range(4)}
        await until(lambda: len(ids) == 4, "four streams started")
        names = routed(url, sup.run_dir)
        # NOTE: .get: a stream the router could place on no decode worker (a health check missed on a loaded
        # machine) was decoded by its prefill worker ("local"), which is not the victim
        on_victim = [i for i, (d, _) in ids.items() if names.get(d) == victim.url]
        if not on_victim:  # the picker put them elsewhere: one more, and the victim is the only decode worker idle
            extra = loop.run_in_executor(pool, stream, url, prompts[4], ids, 4)
            streams[4] = extra
            await until(lambda: 4 in ids, "a fifth stream started")
            on_victim = [4] if names.get(ids[4][0]) == victim.url else []
        assert on_victim, f"no stream on {victim.name}: {ids}"
        victim.child.signal(signal.SIGSTOP)
        await scale_down_victim(
            sup,
            clock,
            victim,
            plan(2, 1),
            frozen=victim,
            still_busy=lambda: not any(streams[i].done() for i in on_victim),
        )
        await until(lambda: victim not in sup.workers, "the drained decode replica gone", sup=sup)
        assert any(
            e.subject == victim.name and e.kind == "stopped" and e.message == "drained and exited" for e in sup.events
        ), [e for e in sup.events if e.subject == victim.name]
        for i, fut in streams.items():
            tokens, reason = await fut
            assert (len(tokens), reason) == (MAX_TOKENS, "length"), (i, len(tokens), reason)
            assert tokens == await loop.run_in_executor(pool, greedy, url, prompts[i]), i

        # --- a prefill replica with open leases: it serves their pulls, then exits 0 ---------------------------
        victim = sorted(sup.active("prefill"), key=sup.workers.index)[-1]
        (decode,) = sup.active("decode")
        # both prefill workers in rotation again before the streams (a probe late on a loaded machine takes a worker
        # out for a while; with the victim out, no lease could open on it)
        everyone = {r.url for r in sup.active()}
        await until(lambda: set(routed(url, sup.run_dir, healthy_only=True).values()) >= everyone, "all in rotation")
        # the decode worker frozen, the prefill answers land but nothing pulls them: leases stay open
        decode.child.signal(signal.SIGSTOP)
        ids = {}

        def leases_on_victim() -> int:
            return httpx.get(f"{victim.url}/load", headers=run_token(sup.run_dir), timeout=5).json().get("leases", 0)

        try:
            streams = {i: loop.run_in_executor(pool, stream, url, prompts[i], ids, i) for i in range(4, 8)}
            await until(leases_on_victim, "a lease open on the prefill victim")
        except BaseException:
            decode.child.signal(signal.SIGCONT)
            raise
        await scale_down_victim(sup, clock, victim, plan(1, 1), frozen=decode, still_busy=leases_on_victim)
        await until(lambda: victim not in sup.workers, "the drained prefill replica gone", sup=sup)
        assert any(
            e.subject == victim.name and e.kind == "stopped" and e.message == "drained and exited" for e in sup.events
        ), [e for e in sup.events if e.subject == victim.name]
        for i, fut in streams.items():
            tokens, reason = await fut
            assert (len(tokens), reason) == (MAX_TOKENS, "length"), (i, len(tokens), reason)
            assert tokens == await loop.run_in_executor(pool, greedy, url, prompts[i]), i
        metrics = httpx.get(f"{decode.url}/metrics", timeout=5).text
        assert "pdfleet_kv_transfer_failures_total{" in metrics
        failures = [
            line
            for line in metrics.splitlines()
            if line.startswith("pdfleet_kv_transfer_failures_total{") and not line.endswith(" 0.0")
        ]
        assert not failures, f"every pull from the draining prefill replica succeeded: {failures}"
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        await sup.shutdown(timeout=30)
