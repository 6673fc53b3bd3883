"""The workers the router knows: discovered per tier and role, probed for health and load as their engine answers them,
taken out of rotation on failure; the proxy asks it for candidates."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx

from pdfleet_worker.router import engines, picker
from pdfleet_worker.router.discovery import Source, make_source
from pdfleet_worker.router.router_config import RouterConfig
from pdfleet_worker.router.workers_file import WorkersFile
from pdfleet_worker.wire.auth import SecretFile

log = logging.getLogger("pdfleet.router")

# Consecutive probe timeouts before a worker in rotation is taken out. One late answer (a loaded machine, a long
# batch step) is not an outage; three in a row (3 health intervals) is. Request failures still eject at once.
PROBE_TIMEOUTS_TO_EJECT = 3


@dataclasses.dataclass
class Upstream:
    url: str
    tier: str
    role: str  # prefill | decode | both
    engine: str = engines.PDFLEET
    healthy: bool = False  # in rotation; a worker enters after its first good probe
    load: dict[str, Any] = dataclasses.field(default_factory=dict)
    inflight: int = 0
    last_error: str | None = None
    checked_at: float = 0.0
    probe_timeouts: int = 0  # consecutive probes that got no answer in time

    def candidate(self) -> picker.Candidate:
        ld = self.load
        return picker.Candidate(
            self.url,
            waiting=int(ld.get("waiting", 0)),
            running=int(ld.get("running", 0)),
            kv_usage=float(ld.get("kv_usage", 0.0)),
            prompt_tokens_waiting=int(ld.get("prompt_tokens_waiting", 0)),
            inflight=self.inflight,
        )

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "tier": self.tier,
            "role": self.role,
            "engine": self.engine,
            "healthy": self.healthy,
            "inflight": self.inflight,
            "last_error": self.last_error,
            "load": self.load,
        }


class TokenAuth(httpx.Auth):
    """`Authorization: Bearer <deployment token>`; refused (401) mid-rotation, once more with the token the
    file held before (a worker whose Secret volume has not caught up yet)."""

    def __init__(self, token: SecretFile):
        self.token = token

    def auth_flow(self, request: httpx.Request):
        tokens = self.token.for_sending()
        for i, value in enumerate(tokens):
            request.headers["Authorization"] = f"Bearer {value}"
            response = yield request
            if response.status_code != 401 or i + 1 == len(tokens):
                return


class Upstreams:
    def __init__(self, cfg: RouterConfig, client: httpx.AsyncClient, token: SecretFile | None = None):
        self.cfg = cfg
        self.client = client
        self._auth = TokenAuth(token) if token is not None else None
        self.sources: list[tuple[str, str, Source]] = [
            (tier.name, role, make_source(url, cfg.discovery, cfg.namespace, tier.engine_of(url)))
            for tier in cfg.tiers.values()
            for role, urls in tier.pools().items()
            for url in urls
        ]
        if cfg.workers_file:
            # One source per pool and engine: the file's current list for it (the URLs above were its first read).
            self.sources = [
                (tier.name, role, WorkersFile(cfg.workers_file, tier.name, role, cfg.discovery, engine, cfg.engine))
                for tier in cfg.tiers.values()
                for role in tier.pools()
                for engine in (engines.ENGINES if role == "both" else (tier.pd_engine,))
            ]
        self._resolved: dict[int, set[str]] = {}
        self._turns: dict[tuple[str, str], itertools.count] = {}  # (tier, role) -> its picks' round-robin turns
        self.all: dict[tuple[str, str, str], Upstream] = {}
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.refresh()
        await self.probe_all()
        self._tasks = [
            asyncio.create_task(self._every(self.cfg.discovery_interval_s, self.refresh)),
            asyncio.create_task(self._every(self.cfg.health_interval_s, self.probe_all)),
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _every(self, interval: float, fn) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await fn()
            except Exception:
                log.exception("%s failed", fn.__name__)

    # -- discovery ------------------------------------------------------------------------------
    async def refresh(self) -> None:
        results = await asyncio.gather(
            *(asyncio.to_thread(src.resolve) for _, _, src in self.sources), return_exceptions=True
        )
        wanted: dict[tuple[str, str, str], str] = {}  # (tier, role, url) -> engine
        for i, ((tier, role, src), res) in enumerate(zip(self.sources, results)):
            if isinstance(res, BaseException):
                # Keep the last known set: a DNS hiccup must not empty the pool.
                log.warning("discovery of %s failed: %s", src.url, res)
                res = self._resolved.get(i, set())
            self._resolved[i] = res
            wanted.update({(tier, role, url): src.engine for url in res})
        for key, engine in wanted.items():
            if key in self.all and self.all[key].engine == engine:
                continue
            self.all[key] = Upstream(key[2], key[0], key[1], engine)
            log.info("discovered %s worker %s@%s (tier %s)", key[1], engine, key[2], key[0])
        for key in set(self.all) - set(wanted):
            log.info("%s worker %s (tier %s) is gone from discovery", key[1], key[2], key[0])
            del self.all[key]

    # -- health ---------------------------------------------------------------------------------
    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(up) for up in list(self.all.values())))

    async def probe(self, up: Upstream) -> None:
        timeout = max(0.5, min(2.0, 2 * self.cfg.health_interval_s))
        result = await engines.probe(self.client, up.engine, up.url, timeout, self.auth(up))
        up.probe_timeouts = up.probe_timeouts + 1 if result.timed_out else 0
        if up.healthy and result.timed_out and up.probe_timeouts < PROBE_TIMEOUTS_TO_EJECT:
            # A worker busy on a long step (a CPU vLLM server computing a batch) answers its probe late; it is
            # still serving. Refused connections and error answers take it out at once; silence, after a few.
            up.last_error, up.checked_at = result.error, time.monotonic()
            return
        if result.ok != up.healthy:
            log.info(
                "%s worker %s@%s is %s",
                up.role,
                up.engine,
                up.url,
                "healthy" if result.ok else f"out of rotation: {result.error}",
            )
        up.healthy, up.last_error, up.checked_at = result.ok, result.error, time.monotonic()
        if result.load:
            up.load = result.load

    def mark_down(self, up: Upstream, error: str) -> None:
        """Out of rotation until a probe finds it healthy again."""
        if up.healthy:
            log.warning("%s worker %s out of rotation: %s", up.role, up.url, error)
        up.healthy, up.last_error = False, error

    # -- queries --------------------------------------------------------------------------------
    def auth(self, up: Upstream) -> httpx.Auth | None:
        """The deployment token for a pdfleet worker; none for vLLM (it has no use for it: least privilege)."""
        return self._auth if up.engine == engines.PDFLEET else None

    def pool(self, tier: str, role: str) -> list[Upstream]:
        return [up for (t, r, _), up in self.all.items() if t == tier and r == role]

    def of_tier(self, tier: str) -> list[Upstream]:
        """Every worker of the tier, whatever its role (every one of them comes from one of the tier's pools)."""
        return [up for up in self.all.values() if up.tier == tier]

    def healthy(self, tier: str, role: str) -> list[Upstream]:
        return [up for up in self.pool(tier, role) if up.healthy]

    def pick(
        self, tier: str, role: str, exclude: set[str], match: Callable[[Upstream], bool] | None = None
    ) -> Upstream | None:
        """The best healthy worker of the pool not in `exclude` (and, given `match`, for which it holds)."""
        healthy = {
            up.url: up
            for up in self.pool(tier, role)
            if up.healthy and up.url not in exclude and (match is None or match(up))
        }
        turn = next(self._turns.setdefault((tier, role), itertools.count()))
        chosen = picker.pick(role, [up.candidate() for up in healthy.values()], turn=turn)
        return None if chosen is None else healthy[chosen.url]

    def served_model(self, tier: str) -> str | None:
        for up in self.all.values():
            if up.tier == tier and up.healthy and up.load.get("model"):
                return up.load["model"]
        return None

    def models(self) -> dict[str, str]:
        """Served model name -> tier, from healthy workers (the first tier listed wins a tie); a vLLM worker
        may serve several names (its /v1/models list)."""
        out: dict[str, str] = {}
        for tier in self.cfg.tiers:
            model = self.served_model(tier)
            if model is not None:
                out.setdefault(model, tier)
            for up in self.all.values():
                if up.tier == tier and up.healthy:
                    for name in up.load.get("models") or ():
                        out.setdefault(name, tier)
        return out

    def servable(self, tier: str) -> bool:
        """A request can be served: every role has a healthy worker, or (PD) one role serves whole requests: decode
        workers prefill locally, pdfleet prefill workers decode locally."""
        t = self.cfg.tiers[tier]
        healthy = {role for role in t.pools() if self.has_healthy(tier, role)}
        if healthy == set(t.pools()) or "decode" in healthy:
            return True
        return "prefill" in healthy and t.pd_engine == engines.PDFLEET

    def has_healthy(self, tier: str, role: str) -> bool:
        # NOTE: one pass and no list: a short prompt's PD route asks this on every request
        return any(up.healthy and up.tier == tier and up.role == role for up in self.all.values())
