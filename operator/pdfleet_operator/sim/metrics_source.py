"""A `MetricsSource` over simulated workers: what Prometheus would return, scraped at the simulated interval.

It has the `snapshot(deployment, namespace, roles)` method of `pdfleet_operator.metrics.MetricsSource`,
so the autoscaler reads the simulated fleet through the same interface as the real one: gauges summed
per role over the replicas that expose metrics (ready or draining; a starting pod has no endpoint yet),
sampled at the last scrape, with token rates over the last minute; a role with no replica reporting
is missing, and the autoscaler holds as it does for a real gap.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from pdfleet_operator.metrics_snapshot import MetricsSnapshot, RoleMetrics
from pdfleet_operator.sim.engine import Replica

RATE_WINDOW_S = 60.0


class SimulatedMetricsSource:
    """Scrapes simulated replicas on demand (`scrape(now)`) and answers the autoscaler's `snapshot`."""

    def __init__(self, deployment: str, replicas: Callable[[], Mapping[str, Sequence[Replica]]],
                 clock: Callable[[], float]) -> None:
        self.deployment = deployment
        self.replicas = replicas
        self.clock = clock
        self.last: dict[str, RoleMetrics] = {}
        self.counters: deque[tuple[float, dict[str, tuple[float, float]]]] = deque()

    @property
    def name(self) -> str:
        return f"simulated scrape of {self.deployment}"

    def scrape(self, now: float) -> None:
        """Read every exposed replica's gauges and counters, as one Prometheus scrape round."""
        latest: dict[str, RoleMetrics] = {}
        totals: dict[str, tuple[float, float]] = {}
        for role, reps in self.replicas().items():
            exposed = [r for r in reps if r.removed_at is None and now >= r.ready_at]
            prompt = sum(r.prompt_tokens for r in reps)
            gen = sum(r.gen_tokens for r in reps)
            totals[role] = (prompt, gen)
            if not exposed:
                continue
            latest[role] = RoleMetrics(
                waiting=float(sum(len(r.waiting) for r in exposed)),
                running=float(sum(r.num_running() for r in exposed)),
                replicas_reporting=len(exposed),
                sample_time=now,
                kv_usage=sum(r.kv_usage(now) for r in exposed) / len(exposed),
                prompt_tokens_waiting=float(sum(r.need_waiting for r in exposed)),
            )
        self.counters.append((now, totals))
        while len(self.counters) > 1 and now - self.counters[1][0] >= RATE_WINDOW_S:
            self.counters.popleft()
        t0, old = self.counters[0]
        if now > t0:
            for role, m in list(latest.items()):
                p0, g0 = old.get(role, (0.0, 0.0))
                p1, g1 = totals[role]
                latest[role] = RoleMetrics(**{**m.__dict__, "prompt_tokens_rate": max(0.0, (p1 - p0) / (now - t0)),
                                              "generation_tokens_rate": max(0.0, (g1 - g0) / (now - t0))})
        self.last = latest

    def snapshot(self, deployment: str, namespace: str, roles: Iterable[str]) -> MetricsSnapshot:
        now = self.clock()
        if deployment != self.deployment:
            return MetricsSnapshot.unavailable(now, f"no simulated deployment {deployment!r}", source=self.name)
        wanted = list(roles)
        return MetricsSnapshot(taken_at=now, source=self.name,
                               roles={role: self.last[role] for role in wanted if role in self.last})
