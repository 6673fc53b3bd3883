"""A `MetricsSource` over simulated workers: what Prometheus would return, scraped at the simulated interval.

It has the `snapshot(deployment, namespace, roles)` method of `pdfleet_operator.prometheus.MetricsSource`,
so the autoscaler reads the simulated fleet through the same interface as the real one: gauges summed
per role over the replicas that expose metrics (ready or draining; a starting pod has no endpoint yet),
sampled at the last scrape, with token rates over the last minute; a role with no replica reporting
is missing, and the autoscaler holds as it does for a real gap. Each role is also broken down by
its replicas' AcceleratorClass, as the `pdfleet_accelerator` label splits the Prometheus queries.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from pdfleet_operator.decide.metrics_snapshot import ClassMetrics, MetricsSnapshot, RoleMetrics
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
        # (time, (role, class) -> (prompt tokens, generated tokens) counted so far)
        self.counters: deque[tuple[float, dict[tuple[str, str], tuple[float, float]]]] = deque()

    @property
    def name(self) -> str:
        return f"simulated scrape of {self.deployment}"

    def scrape(self, now: float) -> None:
        """Read every exposed replica's gauges and counters, as one Prometheus scrape round."""
        latest: dict[str, RoleMetrics] = {}
        totals: dict[tuple[str, str], tuple[float, float]] = {}
        exposed: dict[str, list[Replica]] = {}
        for role, reps in self.replicas().items():
            for r in reps:
                p, g = totals.get((role, r.accelerator_class), (0.0, 0.0))
                totals[(role, r.accelerator_class)] = (p + r.prompt_tokens, g + r.generated(now))
            shown = exposed[role] = [r for r in reps if r.removed_at is None and now >= r.ready_at]
            if not shown:
                continue
            latest[role] = RoleMetrics(
                waiting=float(sum(len(r.waiting) for r in shown)),
                running=float(sum(r.num_running() for r in shown)),
                replicas_reporting=len(shown),
                sample_time=now,
                kv_usage=sum(r.kv_usage(now) for r in shown) / len(shown),
                prompt_tokens_waiting=float(sum(r.need_waiting for r in shown)),
            )
        self.counters.append((now, totals))
        while len(self.counters) > 1 and now - self.counters[1][0] >= RATE_WINDOW_S:
            self.counters.popleft()
        t0, old = self.counters[0]
        if now > t0:
            for role, m in list(latest.items()):
                classes = {}
                for cname in sorted({r.accelerator_class for r in exposed[role]}):
                    shown = [r for r in exposed[role] if r.accelerator_class == cname]
                    prompt, gen = self._rates(old, totals, (role, cname), now - t0)
                    classes[cname] = ClassMetrics(replicas_reporting=len(shown),
                                                  waiting=float(sum(len(r.waiting) for r in shown)),
                                                  prompt_tokens_rate=prompt, generation_tokens_rate=gen)
                keys = [k for k in totals if k[0] == role]
                prompt = sum(self._rates(old, totals, k, now - t0)[0] for k in keys)
                gen = sum(self._rates(old, totals, k, now - t0)[1] for k in keys)
                latest[role] = RoleMetrics(**{**m.__dict__, "prompt_tokens_rate": prompt,
                                              "generation_tokens_rate": gen, "classes": classes})
        self.last = latest

    @staticmethod
    def _rates(old: Mapping[tuple[str, str], tuple[float, float]], new: Mapping[tuple[str, str], tuple[float, float]],
               key: tuple[str, str], span: float) -> tuple[float, float]:
        """(prompt, generated) tokens/s of one (role, class) over `span` seconds (a new series counts from 0)."""
        p0, g0 = old.get(key, (0.0, 0.0))
        p1, g1 = new.get(key, (0.0, 0.0))
        return max(0.0, (p1 - p0) / span), max(0.0, (g1 - g0) / span)

    def snapshot(self, deployment: str, namespace: str, roles: Iterable[str]) -> MetricsSnapshot:
        now = self.clock()
        if deployment != self.deployment:
            return MetricsSnapshot.unavailable(now, f"no simulated deployment {deployment!r}", source=self.name)
        wanted = list(roles)
        return MetricsSnapshot(taken_at=now, source=self.name,
                               roles={role: self.last[role] for role in wanted if role in self.last})
