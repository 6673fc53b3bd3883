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
from dataclasses import dataclass

from pdfleet_operator.decide.metrics_snapshot import ClassMetrics, MetricsSnapshot, RoleMetrics
from pdfleet_operator.sim.engine import Replica

RATE_WINDOW_S = 60.0


@dataclass(frozen=True)
class _Gauges:
    """One role's gauges as one scrape read them (summed over its exposed replicas)."""

    replicas: int
    waiting: float
    running: float
    kv_usage: float  # mean over the replicas
    prompt_tokens_waiting: float
    by_class: dict[str, tuple[int, float]]  # AcceleratorClass -> (replicas, requests waiting)


class SimulatedMetricsSource:
    """Scrapes simulated replicas on demand (`scrape(now)`) and answers the autoscaler's `snapshot`.

    NOTE: a scrape keeps the raw gauges and counters; the `RoleMetrics` are built from the last scrape when
    the autoscaler asks (once per interval, where scrapes come every few seconds for the rate window).
    """

    def __init__(
        self, deployment: str, replicas: Callable[[], Mapping[str, Sequence[Replica]]], clock: Callable[[], float]
    ) -> None:
        self.deployment = deployment
        self.replicas = replicas
        self.clock = clock
        # (time, (role, class) -> (prompt tokens, generated tokens) counted so far)
        self.counters: deque[tuple[float, dict[tuple[str, str], tuple[float, float]]]] = deque()
        self._scraped: tuple[float, dict[str, _Gauges], dict[tuple[str, str], tuple[float, float]]] | None = None
        self._last: dict[str, RoleMetrics] | None = None

    @property
    def name(self) -> str:
        return f"simulated scrape of {self.deployment}"

    @property
    def last(self) -> dict[str, RoleMetrics]:
        """Per role, what the last scrape read (roles with no replica exposing metrics are absent)."""
        if self._last is None:
            self._last = self._build()
        return self._last

    def scrape(self, now: float) -> None:
        """Read every exposed replica's gauges and counters, as one Prometheus scrape round."""
        totals: dict[tuple[str, str], tuple[float, float]] = {}
        gauges: dict[str, _Gauges] = {}
        for role, reps in self.replicas().items():
            shown = []
            for r in reps:
                key = (role, r.accelerator_class)
                p, g = totals.get(key, (0.0, 0.0))
                totals[key] = (p + r.prompt_tokens, g + r.generated(now))
                if r.removed_at is None and now >= r.ready_at:
                    shown.append(r)
            if shown:
                gauges[role] = _gauges(shown, now)
        self.counters.append((now, totals))
        while len(self.counters) > 1 and now - self.counters[1][0] >= RATE_WINDOW_S:
            self.counters.popleft()
        self._scraped = (now, gauges, totals)
        self._last = None

    def _build(self) -> dict[str, RoleMetrics]:
        """The `RoleMetrics` of the last scrape: its gauges, and the counters' rates since the rate window's start."""
        if self._scraped is None:
            return {}
        now, gauges, totals = self._scraped
        t0, old = self.counters[0]
        latest: dict[str, RoleMetrics] = {}
        for role, g in gauges.items():
            rates: dict[str, float] = {}
            classes = {}
            if now > t0:
                for cname, (count, waiting) in g.by_class.items():
                    prompt, gen = self._rates(old, totals, (role, cname), now - t0)
                    classes[cname] = ClassMetrics(
                        replicas_reporting=count, waiting=waiting, prompt_tokens_rate=prompt, generation_tokens_rate=gen
                    )
                keys = [k for k in totals if k[0] == role]
                rates = {
                    "prompt_tokens_rate": sum(self._rates(old, totals, k, now - t0)[0] for k in keys),
                    "generation_tokens_rate": sum(self._rates(old, totals, k, now - t0)[1] for k in keys),
                }
            latest[role] = RoleMetrics(
                waiting=g.waiting,
                running=g.running,
                replicas_reporting=g.replicas,
                sample_time=now,
                kv_usage=g.kv_usage,
                prompt_tokens_waiting=g.prompt_tokens_waiting,
                classes=classes,
                **rates,
            )
        return latest

    @staticmethod
    def _rates(
        old: Mapping[tuple[str, str], tuple[float, float]],
        new: Mapping[tuple[str, str], tuple[float, float]],
        key: tuple[str, str],
        span: float,
    ) -> tuple[float, float]:
        """(prompt, generated) tokens/s of one (role, class) over `span` seconds (a new series counts from 0)."""
        p0, g0 = old.get(key, (0.0, 0.0))
        p1, g1 = new.get(key, (0.0, 0.0))
        return max(0.0, (p1 - p0) / span), max(0.0, (g1 - g0) / span)

    def snapshot(self, deployment: str, namespace: str, roles: Iterable[str]) -> MetricsSnapshot:
        now = self.clock()
        if deployment != self.deployment:
            return MetricsSnapshot.unavailable(now, f"no simulated deployment {deployment!r}", source=self.name)
        wanted = list(roles)
        last = self.last
        return MetricsSnapshot(
            taken_at=now, source=self.name, roles={role: last[role] for role in wanted if role in last}
        )


def _gauges(shown: list[Replica], now: float) -> _Gauges:
    """One pass over the exposed replicas (a scrape every few seconds of a day); counts are whole numbers, and the
    KV usage is summed by sum() in replica order, as before."""
    counts: dict[str, list[int]] = {}  # class -> [replicas, requests waiting]
    waiting = running = prompt_tokens = 0
    for r in shown:
        queued = len(r.waiting)
        waiting += queued
        running += r.num_running()
        prompt_tokens += r.need_waiting
        got = counts.get(r.accelerator_class)
        if got is None:
            counts[r.accelerator_class] = [1, queued]
        else:
            got[0] += 1
            got[1] += queued
    return _Gauges(
        replicas=len(shown),
        waiting=float(waiting),
        running=float(running),
        kv_usage=sum([r.kv_usage(now) for r in shown]) / len(shown),
        prompt_tokens_waiting=float(prompt_tokens),
        by_class={cname: (n, float(q)) for cname, (n, q) in sorted(counts.items())},
    )
