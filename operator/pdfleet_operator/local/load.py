"""`pdfleet load`: open-loop load on an OpenAI endpoint (Poisson arrivals, a burst, or a CSV trace replayed) reporting
TTFT/ITL percentiles and tokens/s under the simulator's summary keys; `pdfleet up --load` runs it too."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

# Prompt token ids are drawn from here: inside any real vocabulary, clear of the special tokens that
# tokenizers put at the bottom. Random ids share no prefix, so prefix caching never shortens a prompt.
TOKEN_LO, TOKEN_HI = 10, 1000
# Log-normal spread of prompt and output lengths around their medians.
LENGTH_SIGMA = 0.4

OK, REJECTED, TOO_LONG, FAILED, UNFINISHED, DROPPED = "ok", "rejected", "too_long", "failed", "unfinished", "dropped"


@dataclass(frozen=True)
class Arrival:
    """One request of the schedule: when it is sent (seconds from the start) and its token counts."""

    t: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Burst:
    """Arrivals at `factor` x the base rate between `start` and `end` seconds."""

    factor: float
    start: float
    end: float

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"burst factor must be > 0, got {self.factor}")
        if not 0 <= self.start < self.end:
            raise ValueError(f"burst window must satisfy 0 <= start < end, got {self.start}-{self.end}")


def default_burst(factor: float, duration: float) -> Burst:
    """The demo's shape: base rate, then `factor` x from 20% to 55% of the run, then base rate again."""
    return Burst(factor, round(0.20 * duration, 3), round(0.55 * duration, 3))


def poisson(
    rate: float, duration: float, *, prompt_tokens: int, output_tokens: int, burst: Burst | None = None, seed: int = 0
) -> list[Arrival]:
    """Poisson arrivals at `rate`/s (x burst.factor inside the burst) for `duration` seconds."""
    if not rate > 0 or not duration > 0:
        raise ValueError(f"rate and duration must be > 0, got {rate} and {duration}")
    if prompt_tokens < 1 or output_tokens < 1:
        raise ValueError(f"prompt and output tokens must be >= 1, got {prompt_tokens} and {output_tokens}")
    rng = random.Random(seed)
    edges = sorted({0.0, duration} | ({min(burst.start, duration), min(burst.end, duration)} if burst else set()))
    out: list[Arrival] = []
    for lo, hi in zip(edges, edges[1:]):
        r = rate * (burst.factor if burst and burst.start <= lo < burst.end else 1.0)
        t = lo + rng.expovariate(r)
        while t < hi:
            out.append(Arrival(round(t, 6), _length(rng, prompt_tokens), _length(rng, output_tokens)))
            t += rng.expovariate(r)
    return out


def _length(rng: random.Random, median: int) -> int:
    return max(1, min(4 * median, round(rng.lognormvariate(math.log(median), LENGTH_SIGMA))))


def from_trace(path: str | Path, *, duration: float | None = None, speedup: float = 1.0) -> list[Arrival]:
    """A CSV trace (timestamp,prompt_tokens,output_tokens) as the simulator reads it, optionally cut and sped up."""
    try:
        from pdfleet_operator import trace as tr
    except ImportError as exc:
        raise ValueError(f"--trace needs {exc.name}, which is not installed (pip install 'pdfleet[sim]')") from None
    if not speedup > 0:
        raise ValueError(f"--speedup must be > 0, got {speedup}")
    got = tr.read_csv(path)  # TraceFileError (a ValueError) names the line and column
    out = [
        Arrival(float(t) / speedup, int(p), int(o))
        for t, p, o in zip(got.arrival.tolist(), got.prompt.tolist(), got.output.tolist())
    ]
    return [a for a in out if duration is None or a.t < duration]


@dataclass
class Result:
    """What happened to one request."""

    arrival: Arrival
    status: str = UNFINISHED
    http_status: int | None = None
    ttft: float | None = None  # scheduled arrival -> first token
    token_times: list[float] = field(default_factory=list)  # arrival-relative time of every streamed chunk
    completion_tokens: int = 0
    lag: float = 0.0  # how late the request left the client (its event loop was busy)
    error: str = ""

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def tpot(self) -> float | None:
        """Time per output token after the first (what the SLO's ITL is checked against per request).

        NOTE: counted in tokens (the usage chunk), not chunks: a token that ends inside a UTF-8
        character streams no text, so its time falls into the next chunk's gap.
        """
        tokens = max(self.completion_tokens, len(self.token_times))
        if len(self.token_times) < 2 or tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (tokens - 1)


class LoadGenerator:
    """Sends each arrival at its time whatever the server is doing (open loop) and records its fate.

    NOTE: arrivals beyond `max_concurrency` open requests are dropped by the client and counted, not
    delayed: delaying them would turn the open loop into a closed one and hide the overload.
    """

    def __init__(
        self,
        url: str,
        arrivals: Sequence[Arrival],
        *,
        model: str | None = None,
        max_concurrency: int = 256,
        timeout: float = 300.0,
        on_result: Callable[[Result], None] | None = None,
        api_key: str | None = None,
    ):
        self.base = base_url(url)
        self.api_key = api_key  # sent as `Authorization: Bearer` (a router with --api-key-file needs one)
        self.arrivals = list(arrivals)
        self.model = model
        self.max_concurrency = max_concurrency
        self.timeout = timeout
        self.on_result = on_result or (lambda r: None)
        self.results: list[Result] = []  # one per arrival that came due (sent or dropped)
        self.inflight = 0
        self.sent = 0
        self.started_at: float | None = None
        self.finished_at: float | None = None

    async def discover_model(self, client: httpx.AsyncClient) -> str:
        resp = await client.get(f"{self.base}/v1/models", timeout=10.0)
        resp.raise_for_status()
        data = resp.json().get("data") or []
        if not data:
            raise ValueError(f"{self.base}/v1/models lists no model; pass --model")
        return data[0]["id"]

    async def run(self, stop: asyncio.Event | None = None) -> list[Result]:
        """Send the whole schedule (or until `stop` is set), wait for the answers, return every result."""
        stop = stop or asyncio.Event()
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(self.timeout, connect=10.0), limits=limits, headers=headers
        ) as client:
            if self.model is None:
                self.model = await self.discover_model(client)
            tasks: set[asyncio.Task] = set()
            self.started_at = start = time.monotonic()
            for arrival in self.arrivals:
                delay = start + arrival.t - time.monotonic()
                if delay > 0:
                    try:
                        await asyncio.wait_for(stop.wait(), timeout=delay)
                    except asyncio.TimeoutError:
                        pass
                if stop.is_set():
                    break
                result = Result(arrival)
                self.results.append(result)
                if self.inflight >= self.max_concurrency:
                    result.status, result.error = DROPPED, f"{self.max_concurrency} requests already open"
                    self.on_result(result)
                    continue
                task = asyncio.create_task(self._one(client, result, start))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            stopper = asyncio.create_task(stop.wait())
            while tasks and not stop.is_set():
                await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            stopper.cancel()
            self.finished_at = time.monotonic()
        return self.results

    async def _one(self, client: httpx.AsyncClient, r: Result, start: float) -> None:
        self.inflight += 1
        self.sent += 1
        due = start + r.arrival.t
        r.lag = max(0.0, time.monotonic() - due)
        body = {
            "model": self.model,
            "prompt": prompt_ids(r.arrival),
            "max_tokens": r.arrival.output_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "temperature": 0.0,
        }
        try:
            async with client.stream("POST", f"{self.base}/v1/completions", json=body) as resp:
                r.http_status = resp.status_code
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    r.status, r.error = _classify(resp.status_code, text)
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[6:].strip()
                    if payload == "[DONE]":
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        r.status, r.error = FAILED, str(chunk["error"].get("message", chunk["error"]))[:300]
                        return
                    if chunk.get("choices"):
                        r.token_times.append(time.monotonic() - due)
                        if r.ttft is None:
                            r.ttft = r.token_times[0]
                    usage = chunk.get("usage")
                    if usage:
                        r.completion_tokens = int(usage.get("completion_tokens", 0))
            if not r.completion_tokens:
                r.completion_tokens = len(r.token_times)
            r.status = OK if r.ttft is not None else FAILED
            if r.status == FAILED:
                r.error = "stream ended without a token"
        except asyncio.CancelledError:
            r.status, r.error = UNFINISHED, "still open when the load stopped"
            raise
        except (httpx.HTTPError, ValueError) as exc:
            r.status, r.error = FAILED, f"{type(exc).__name__}: {exc}"[:300]
        finally:
            self.inflight -= 1
            self.on_result(r)


def _classify(status: int, text: str) -> tuple[str, str]:
    try:
        message = str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = text
    if status == 503:
        return REJECTED, message[:300]
    if status == 400 and any(w in message.lower() for w in ("length", "too long", "context")):
        return TOO_LONG, message[:300]
    return FAILED, f"HTTP {status}: {message}"[:300]


def prompt_ids(a: Arrival) -> list[int]:
    rng = random.Random(f"{a.t}/{a.prompt_tokens}")
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(a.prompt_tokens)]


def base_url(url: str) -> str:
    """http://host:port from http://host:port, .../ or .../v1 (what the openai SDK calls base_url)."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


# --- the summary -------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """q-th percentile (0..100) with linear interpolation, as numpy's default (the simulator's)."""
    v = sorted(x for x in values if x is not None and math.isfinite(x))
    if not v:
        return None
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _round(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def summarize(
    results: Sequence[Result], duration: float, *, slo_ttft: float | None = None, slo_itl: float | None = None
) -> dict[str, Any]:
    """The run's numbers under the keys `pdfleet simulate` writes to report.json (`sim.report.summarize`).

    `duration` is the measured span (first arrival to the last answer); tokens/s divides by it.
    """
    sent = [r for r in results if r.status != DROPPED]
    done = [r for r in results if r.status == OK]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    gaps = [g for r in done for g in r.gaps()]
    tpots = [t for r in done if (t := r.tpot()) is not None]
    generated = sum(r.completion_tokens for r in done)
    counted = [r for r in results if r.status != TOO_LONG]
    met = None
    if slo_ttft is not None and slo_itl is not None and counted:
        ok = sum(1 for r in done if r.ttft is not None and r.ttft <= slo_ttft and (r.tpot() or 0.0) <= slo_itl)
        met = ok / len(counted)

    def count(status: str) -> int:
        return sum(1 for r in results if r.status == status)

    return {
        "requests": len(results),
        "sent": len(sent),
        "completed": len(done),
        "rejected": count(REJECTED),
        "too_long": count(TOO_LONG),
        "failed": count(FAILED),
        "unfinished": count(UNFINISHED),
        "dropped": count(DROPPED),
        "ttft_p50_s": _round(percentile(ttfts, 50)),
        "ttft_p99_s": _round(percentile(ttfts, 99)),
        "itl_p50_s": _round(percentile(gaps, 50)),
        "itl_p99_s": _round(percentile(gaps, 99)),
        "tpot_p50_s": _round(percentile(tpots, 50)),
        "tpot_p99_s": _round(percentile(tpots, 99)),
        "slo_attainment": _round(met),
        "prompt_tokens": sum(r.arrival.prompt_tokens for r in done),
        "generated_tokens": generated,
        "duration_s": _round(duration, 2),
        "generated_tokens_per_s": _round(generated / duration if duration > 0 else None, 2),
        "requests_per_s": _round(len(sent) / duration if duration > 0 else None, 3),
        "client_lag_p99_s": _round(percentile([r.lag for r in sent], 99)),
        "errors": sorted({r.error for r in results if r.status in (FAILED, REJECTED) and r.error})[:5],
    }


def summary_lines(s: dict[str, Any]) -> list[str]:
    """The summary for a terminal: requests, latency percentiles, tokens/s."""

    def sec(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}s"

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.1f}ms"

    lines = [
        f"requests  {s['requests']} scheduled, {s['completed']} completed, {s['rejected']} rejected (503), "
        f"{s['failed']} failed, {s['too_long']} too long, {s['dropped']} dropped by the client, "
        f"{s['unfinished']} unfinished",
        f"TTFT      p50 {sec(s['ttft_p50_s'])}  p99 {sec(s['ttft_p99_s'])}",
        f"ITL       p50 {ms(s['itl_p50_s'])}  p99 {ms(s['itl_p99_s'])}   (time per output token p50 "
        f"{ms(s['tpot_p50_s'])}, p99 {ms(s['tpot_p99_s'])})",
        f"tokens    {s['generated_tokens']:,} generated over {s['duration_s']}s = "
        f"{s['generated_tokens_per_s'] or 0:,.1f} tokens/s ({s['prompt_tokens']:,} prompt tokens)",
    ]
    if s.get("slo_attainment") is not None:
        lines.append(f"SLO       {s['slo_attainment']:.1%} of requests met TTFT and time per output token targets")
    for err in s.get("errors") or []:
        lines.append(f"error     {err}")
    return lines
