"""The engines the router fronts (a worker entry `[TIER=][ENGINE@]URL`) and how each is probed for health, served models
and load; the upstream set calls probe(). No torch.

pdfleet: `GET /load` answers readiness, the served model and the scheduler's queue in one JSON object.
vllm (vLLM and the vendors' vLLM builds): `GET /health` for liveness, `GET /v1/models` for the served
names, and `GET /metrics` (vllm:num_requests_waiting, vllm:num_requests_running,
vllm:kv_cache_usage_perc) for the picker's load score.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
from typing import Any

import httpx

PDFLEET = "pdfleet"
VLLM = "vllm"
ENGINES = (PDFLEET, VLLM)

# vLLM series -> the load keys the picker reads (pdfleet's /load names).
_VLLM_LOAD = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
}
# One sample line of the text format: name, optional {labels}, value (a timestamp may follow).
_SAMPLE = re.compile(r"^(?P<name>vllm:[A-Za-z0-9_:]+)(?:\{.*\})?[ \t]+(?P<value>\S+)", re.MULTILINE)


def split_engine(value: str, default: str = PDFLEET) -> tuple[str, str]:
    """'vllm@http://x:8000' -> ('vllm', 'http://x:8000'); a bare URL -> (default, url)."""
    head, sep, rest = value.partition("@")
    if not sep or "://" in head:  # no engine named (an `@` after the scheme is a URL's user info)
        return check(default), value
    if not head:
        raise ValueError(f"{value!r}: empty engine name before '@'")
    return check(head), rest


def check(engine: str) -> str:
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    return engine


def mixed_pd_error(tier: str, first: tuple[str, str], other: tuple[str, str]) -> str:
    """A disaggregated tier whose prefill and decode workers run different engines: the KV moves only through one
    engine's own connector (router/handoff.py)."""
    return (
        f"tier {tier!r}: prefill and decode workers must run one engine (the KV moves through that engine's "
        f"own connector), got {first[0]}@{first[1]} and {other[0]}@{other[1]}"
    )


@dataclasses.dataclass(frozen=True)
class Probe:
    """One health/load probe of a worker: in rotation or not (and why), and its load in pdfleet's /load
    vocabulary (`model`, `models`, `waiting`, `running`, `kv_usage`, ...)."""

    ok: bool
    error: str | None = None
    load: dict[str, Any] = dataclasses.field(default_factory=dict)
    timed_out: bool = False  # no answer in time: a busy worker, not (yet) a dead one (Upstreams.probe)


async def probe(
    client: httpx.AsyncClient, engine: str, url: str, timeout: float, auth: httpx.Auth | None = None
) -> Probe:
    """`auth`: the deployment token, for pdfleet workers (their /load needs it once they have one)."""
    try:
        if engine == VLLM:
            return await _probe_vllm(client, url, timeout)
        return await _probe_pdfleet(client, url, timeout, auth)
    except httpx.TimeoutException as e:
        return Probe(False, f"{type(e).__name__}: no answer within {timeout:g}s", timed_out=True)
    except (httpx.HTTPError, ValueError) as e:
        return Probe(False, f"{type(e).__name__}: {e}")


async def _probe_pdfleet(client: httpx.AsyncClient, url: str, timeout: float, auth: httpx.Auth | None) -> Probe:
    resp = await client.get(f"{url}/load", timeout=timeout, auth=auth)
    body = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else {}
    if not isinstance(body, dict):
        raise ValueError(f"/load answered {type(body).__name__}, not an object")
    if resp.status_code == 200 and body.get("ready") is True:
        return Probe(True, load=body)
    if resp.status_code == 401:
        return Probe(False, "401: the worker refused this router's deployment token (--auth-token-file)")
    return Probe(False, f"not ready ({resp.status_code}: {body.get('error') or 'loading or draining'})", body)


async def _probe_vllm(client: httpx.AsyncClient, url: str, timeout: float) -> Probe:
    health = await client.get(f"{url}/health", timeout=timeout)
    if health.status_code != 200:
        return Probe(False, f"not healthy (/health answered {health.status_code})")
    models, metrics = await asyncio.gather(
        client.get(f"{url}/v1/models", timeout=timeout), client.get(f"{url}/metrics", timeout=timeout)
    )
    if models.status_code != 200:
        return Probe(False, f"/v1/models answered {models.status_code}")
    names = served_models(models.json())
    if not names:
        return Probe(False, "/v1/models lists no model")
    load: dict[str, Any] = {"ready": True, "engine": VLLM, "model": names[0], "models": names}
    if metrics.status_code == 200:
        load.update(vllm_load(metrics.text))
    else:
        # NOTE: liveness is /health's; without metrics the picker falls back to the router's own in-flight count.
        load["load_error"] = f"/metrics answered {metrics.status_code}"
    return Probe(True, load=load)


def served_models(body: Any) -> list[str]:
    """Model ids of an OpenAI `/v1/models` list, in its order."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ValueError("/v1/models answered no `data` list")
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


def vllm_load(text: str) -> dict[str, Any]:
    """waiting / running (summed over the server's engines) and kv_usage (the fullest engine's) from vLLM's
    Prometheus text; a series the text lacks is left out."""
    sums: dict[str, float] = {}
    peaks: dict[str, float] = {}
    for m in _SAMPLE.finditer(text):
        key = _VLLM_LOAD.get(m["name"])
        if key is None:
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        if math.isfinite(value):
            sums[key] = sums.get(key, 0.0) + value
            peaks[key] = max(peaks.get(key, 0.0), value)
    out: dict[str, Any] = {key: int(sums[key]) for key in ("waiting", "running") if key in sums}
    if "kv_usage" in peaks:
        out["kv_usage"] = peaks["kv_usage"]
    return out
