"""The only reader of worker metrics: Prometheus (prometheus-api-client) or worker /metrics scrapes, into
`MetricsSnapshot`s."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx
import requests
from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
from prometheus_client.parser import text_string_to_metric_families
from urllib3.util.retry import Retry

from pdfleet_operator.decide import metric_names as names
from pdfleet_operator.decide.metrics_snapshot import ClassMetrics, MetricsSnapshot, RoleMetrics

# Fields a snapshot cannot do without; the others are None when the engine does not export them.
REQUIRED = ("waiting", "running", "replicas", "sample_time")
# The worker series ScrapeSource reads, any engine (a NaN in any of them makes the snapshot unavailable).
SCRAPED = frozenset(name for fields in names.SCRAPED_SERIES.values() for series in fields.values() for name in series)


class MetricsError(Exception):
    """A metrics read that must not be acted on (turned into an `ok=False` snapshot)."""


class MetricsSource(Protocol):
    """Where the autoscaler's numbers come from."""

    def snapshot(self, deployment: str, namespace: str, roles: Iterable[str]) -> MetricsSnapshot:
        """Per-role queues of one deployment now; `ok=False` with the error instead of raising."""
        ...


def _finite(value: float, what: str) -> float:
    if not math.isfinite(value):
        raise MetricsError(f"{what} is {value}")
    return value


class PrometheusSource:
    """Queries Prometheus with the PromQL of an engine profile (`metric_names.PROFILES`): `profile` for
    every role, or per role from the engines its pools run (`snapshot(..., engines=)`)."""

    def __init__(
        self,
        url: str,
        profile: str | names.QueryProfile = "pdfleet",
        timeout: float = 5.0,
        clock: Callable[[], float] = time.time,
        verify: bool | str = True,
    ) -> None:
        """`verify`: TLS verification of an https URL: True (the system's CAs), a CA bundle file, or False."""
        if isinstance(profile, str):
            if profile not in names.PROFILES:
                raise ValueError(f"unknown metrics profile {profile!r}; known: {', '.join(names.PROFILES)}")
            profile = names.PROFILES[profile]
        self.url = url.rstrip("/")
        self.profile = profile
        self.timeout = timeout
        self.clock = clock
        # NOTE: one quick retry, not the client's default backoff: the autoscaler asks again next interval,
        # and a Prometheus outage must turn into a held size within that interval.
        retry = Retry(total=1, backoff_factor=0.1, status_forcelist=(502, 503, 504), allowed_methods=("GET",))
        session = requests.Session()
        session.verify = verify
        self.client = PrometheusConnect(
            url=self.url, disable_ssl=verify is False, retry=retry, timeout=timeout, session=session
        )

    @property
    def name(self) -> str:
        return f"prometheus {self.url} ({self.profile.name})"

    def snapshot(
        self, deployment: str, namespace: str, roles: Iterable[str], engines: Mapping[str, Iterable[str]] | None = None
    ) -> MetricsSnapshot:
        """`engines`: role -> the engines its pools run (`decide.runtimes`); a role it does not name is
        read with this source's profile. Each distinct profile's queries run once."""
        taken_at = self.clock()
        roles = list(roles)
        groups: dict[str, tuple[names.QueryProfile, list[str]]] = {}
        for role in roles:
            mine = list((engines or {}).get(role, ()))
            profile = names.profile_for(mine) if mine else self.profile
            groups.setdefault(profile.name, (profile, []))[1].append(role)
        try:
            out: dict[str, RoleMetrics] = {}
            for profile, members in groups.values():
                queries = profile.queries(deployment, namespace)
                values = {
                    field: self._by_role(profile, promql)
                    for field, promql in queries.items()
                    if field not in names.CLASS_FIELDS
                }
                by_class = {
                    field.removeprefix("class_"): self._by_role_class(profile, promql)
                    for field, promql in queries.items()
                    if field in names.CLASS_FIELDS
                }
                for role in members:
                    out[role] = self._role(profile, role, values, deployment, namespace, _classes(role, by_class))
            return MetricsSnapshot(taken_at=taken_at, source=self.name, roles={role: out[role] for role in roles})
        except MetricsError as exc:
            return MetricsSnapshot.unavailable(taken_at, str(exc), source=self.name)
        except (requests.RequestException, PrometheusApiClientException) as exc:
            return MetricsSnapshot.unavailable(taken_at, f"{type(exc).__name__}: {exc}", source=self.name)

    def router_requests(
        self, deployment: str, namespace: str, window: str, revision: int | None = None
    ) -> tuple[float | None, float | None, str]:
        """(requests, 5xx responses) through the deployment's router over `window`, for rollback analysis;
        (None, None, why) when unknown (no series, NaN, Prometheus down). No 5xx series means no 5xx.

        With `revision`: the answers of that revision's workers and of none (no worker answered: an outage while
        it serves is its own until shown otherwise), without the router's load shedding (503s every busy worker
        gave: a traffic burst, not a fault). A router that exports no per-revision series is read whole.
        """
        sel = self.profile.selector(deployment, namespace)
        if revision is not None:
            own = f'{sel},revision=~"{int(revision)}|{names.NO_REVISION}",shed!="true"'
            got = self._requests_and_errors(names.ROUTER_REVISION_REQUESTS_TOTAL, own, window)
            if got[0] is not None or not got[2].startswith("no series"):
                return got
        got = self._requests_and_errors(names.ROUTER_REQUESTS_TOTAL, sel, window)
        if got[0] is None and got[2].startswith("no series"):
            return None, None, f"no {names.ROUTER_REQUESTS_TOTAL} series for {namespace}/{deployment}"
        return got

    def _requests_and_errors(self, metric: str, sel: str, window: str) -> tuple[float | None, float | None, str]:
        total = f"sum(increase({metric}{{{sel}}}[{window}]))"
        errors = f'sum(increase({metric}{{{sel},{names.LABEL_CODE}=~"5.."}}[{window}]))'
        try:
            values = []
            for promql in (total, errors):
                result = self.client.custom_query(promql)
                values.append(_finite(float(result[0]["value"][1]), promql) if result else None)
        except (MetricsError, KeyError, IndexError, TypeError, ValueError) as exc:
            return None, None, f"{type(exc).__name__}: {exc}"
        except (requests.RequestException, PrometheusApiClientException) as exc:
            return None, None, f"Prometheus {self.url}: {type(exc).__name__}: {exc}"
        if values[0] is None:
            return None, None, f"no series of {metric}"
        return values[0], values[1] if values[1] is not None else 0.0, ""

    def _by_role(self, profile: names.QueryProfile, promql: str) -> dict[str, float]:
        """An instant vector by role label; MetricsError on a malformed answer or NaN."""
        try:
            result = self.client.custom_query(promql)
            out: dict[str, float] = {}
            for series in result:
                role = series["metric"].get(profile.role_label)
                if role is None:
                    raise MetricsError(f"series without {profile.role_label} label from {promql}")
                out[role] = _finite(float(series["value"][1]), f"{promql} for {role}")
            return out
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise MetricsError(f"unexpected answer to {promql}: {type(exc).__name__}: {exc}") from exc

    def _by_role_class(self, profile: names.QueryProfile, promql: str) -> dict[str, dict[str | None, float]]:
        """An instant vector by role and accelerator label (None: a series without the accelerator label)."""
        try:
            out: dict[str, dict[str | None, float]] = {}
            for series in self.client.custom_query(promql):
                role = series["metric"].get(profile.role_label)
                if role is None:
                    raise MetricsError(f"series without {profile.role_label} label from {promql}")
                cls = series["metric"].get(profile.accelerator_label) or None
                out.setdefault(role, {})[cls] = _finite(float(series["value"][1]), f"{promql} for {role}/{cls}")
            return out
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise MetricsError(f"unexpected answer to {promql}: {type(exc).__name__}: {exc}") from exc

    def _role(
        self,
        profile: names.QueryProfile,
        role: str,
        values: Mapping[str, Mapping[str, float]],
        deployment: str,
        namespace: str,
        classes: Mapping[str, ClassMetrics],
    ) -> RoleMetrics:
        missing = [f for f in REQUIRED if role not in values[f]]
        if missing:
            raise MetricsError(
                f"no series for role {role} of {namespace}/{deployment} "
                f"({profile.render(getattr(profile, missing[0]), deployment, namespace)})"
            )

        def optional(field: str) -> float | None:
            return values.get(field, {}).get(role)

        return RoleMetrics(
            waiting=values["waiting"][role],
            running=values["running"][role],
            replicas_reporting=int(values["replicas"][role]),
            sample_time=values["sample_time"][role],
            kv_usage=optional("kv_usage"),
            prompt_tokens_waiting=optional("prompt_tokens_waiting"),
            prompt_tokens_rate=optional("prompt_tokens_rate"),
            generation_tokens_rate=optional("generation_tokens_rate"),
            classes=classes,
        )


def _classes(role: str, by_class: Mapping[str, Mapping[str, Mapping[str | None, float]]]) -> dict[str, ClassMetrics]:
    """The role's per-AcceleratorClass breakdown from the `class_` queries (ClassMetrics field -> role ->
    class -> value); empty, the role then seen as one class, when a replica has no accelerator label or
    the replica count and the queue do not name the same classes."""
    counts = by_class.get("replicas", {}).get(role, {})
    waiting = by_class.get("waiting", {}).get(role, {})
    if not counts or None in counts or set(counts) != set(waiting) or min(counts.values()) < 1:
        return {}

    def rate(field: str, cls: str) -> float | None:
        return by_class.get(field, {}).get(role, {}).get(cls)

    return {
        cls: ClassMetrics(
            replicas_reporting=int(n),
            waiting=waiting[cls],
            prompt_tokens_rate=rate("prompt_tokens_rate", cls),
            generation_tokens_rate=rate("generation_tokens_rate", cls),
        )
        for cls, n in counts.items()
        if cls is not None
    }


@dataclass(frozen=True)
class ScrapeTarget:
    """One replica's /metrics, the target labels Prometheus would attach to its series
    (`metric_names.target_labels`), and the engine whose series names it is read with."""

    url: str
    labels: Mapping[str, str]
    engine: str = "pdfleet"  # a key of metric_names.SCRAPED_SERIES (and PROFILES)

    def __post_init__(self) -> None:
        if self.engine not in names.SCRAPED_SERIES:
            raise ValueError(f"{self.url}: unknown engine {self.engine!r}; known: {', '.join(names.SCRAPED_SERIES)}")


Targets = Sequence[ScrapeTarget]


class ScrapeSource:
    """Scrapes worker `/metrics` directly (`pdfleet up`, clusters without Prometheus).

    `targets` is a list of ScrapeTarget, or a function of (deployment, namespace) returning one. Each
    target's series are read with its target labels, as Prometheus attaches them: the deployment's
    replicas are those whose `namespace` and `pdfleet_deployment` labels match, grouped into roles by
    `pdfleet_role` and split by class by `pdfleet_accelerator` (what the PromQL profiles select on), so
    one label vocabulary serves both sources and every engine. Each target is read with its engine's
    series (`metric_names.SCRAPED_SERIES`). Every replica must answer: one unreachable replica makes
    the snapshot unavailable (its queue is unknown, not zero). Token rates come from the counters'
    change between two snapshots.
    """

    def __init__(
        self,
        targets: Targets | Callable[[str, str], Targets],
        timeout: float = 2.0,
        clock: Callable[[], float] = time.time,
        client: httpx.Client | None = None,
    ) -> None:
        self.targets = targets
        self.timeout = timeout
        self.clock = clock
        self.client = client or httpx.Client(timeout=timeout)
        self._counters: dict[
            tuple[str, ...], tuple[float, float]
        ] = {}  # (ns, deployment, role, counter[, class]) -> (time, total)

    name = "scrape"

    def snapshot(self, deployment: str, namespace: str, roles: Iterable[str]) -> MetricsSnapshot:
        taken_at = self.clock()
        targets = self.targets(deployment, namespace) if callable(self.targets) else self.targets
        mine = [
            t
            for t in targets
            if t.labels.get(names.LABEL_NAMESPACE) == namespace and t.labels.get(names.LABEL_DEPLOYMENT) == deployment
        ]
        try:
            return MetricsSnapshot(
                taken_at=taken_at,
                source=self.name,
                roles={
                    role: self._role(
                        namespace,
                        deployment,
                        role,
                        [t for t in mine if t.labels.get(names.LABEL_ROLE) == role],
                        taken_at,
                    )
                    for role in roles
                },
            )
        except MetricsError as exc:
            return MetricsSnapshot.unavailable(taken_at, str(exc), source=self.name)

    def _role(
        self, namespace: str, deployment: str, role: str, targets: Sequence[ScrapeTarget], now: float
    ) -> RoleMetrics:
        if not targets:
            raise MetricsError(f"no /metrics targets for role {role} of {namespace}/{deployment}")
        replicas = [(t, self._scrape(t)) for t in targets]

        def total(field: str, of: Sequence[tuple[ScrapeTarget, Mapping[str, float]]] = replicas) -> float | None:
            """The sum over replicas; None when one of them does not export it (the sum is unknown)."""
            values = [got.get(field) for _, got in of]
            return None if None in values else math.fsum(v for v in values if v is not None)

        def queue(field: str, of: Sequence[tuple[ScrapeTarget, Mapping[str, float]]] = replicas) -> float:
            return math.fsum(got[field] for _, got in of)  # `_scrape` made sure every replica has it

        classes = {}
        by_class: dict[str | None, list[tuple[ScrapeTarget, Mapping[str, float]]]] = {}
        for t, got in replicas:
            by_class.setdefault(t.labels.get(names.LABEL_ACCELERATOR) or None, []).append((t, got))
        if None not in by_class:  # a replica without its class leaves the role without the breakdown
            for cls, of in sorted(by_class.items()):
                assert cls is not None
                classes[cls] = ClassMetrics(
                    replicas_reporting=len(of),
                    waiting=queue("waiting", of),
                    prompt_tokens_rate=self._rate(
                        (namespace, deployment, role, "prompt", cls), total("prompt_tokens_total", of), now
                    ),
                    generation_tokens_rate=self._rate(
                        (namespace, deployment, role, "generation", cls), total("generation_tokens_total", of), now
                    ),
                )
        kv = total("kv_usage")
        return RoleMetrics(
            waiting=queue("waiting"),
            running=queue("running"),
            replicas_reporting=len(targets),
            sample_time=now,
            kv_usage=None if kv is None else kv / len(targets),
            prompt_tokens_waiting=total("prompt_tokens_waiting"),
            prompt_tokens_rate=self._rate((namespace, deployment, role, "prompt"), total("prompt_tokens_total"), now),
            generation_tokens_rate=self._rate(
                (namespace, deployment, role, "generation"), total("generation_tokens_total"), now
            ),
            classes=classes,
        )

    def _scrape(self, target: ScrapeTarget) -> dict[str, float]:
        """Snapshot field -> the replica's value: its engine's first series name it exports, summed over
        label sets (one replica serves one model). MetricsError without the queue gauges, or on a NaN."""
        url = target.url
        try:
            resp = self.client.get(url, headers={"Accept": "text/plain; version=0.0.4"})
            resp.raise_for_status()
            sums: dict[str, float] = {}
            for family in text_string_to_metric_families(resp.text):
                for sample in family.samples:
                    if sample.name in SCRAPED:
                        value = _finite(float(sample.value), f"{sample.name} at {url}")
                        sums[sample.name] = sums.get(sample.name, 0.0) + value
        except httpx.HTTPError as exc:
            raise MetricsError(f"scraping {url}: {type(exc).__name__}: {exc}") from exc
        except ValueError as exc:
            raise MetricsError(f"parsing {url}: {exc}") from exc
        out = {}
        for field, series in names.SCRAPED_SERIES[target.engine].items():
            found = [sums[s] for s in series if s in sums]
            if found:
                out[field] = found[0]
        for field in ("waiting", "running"):
            if field not in out:
                raise MetricsError(
                    f"{url} ({target.engine}) does not export {' or '.join(names.SCRAPED_SERIES[target.engine][field])}"
                )
        return out

    def _rate(self, key: tuple[str, ...], total: float | None, now: float) -> float | None:
        """Per-second increase of a counter since the previous snapshot (None on the first or after a reset)."""
        if total is None:
            self._counters.pop(key, None)
            return None
        previous = self._counters.get(key)
        self._counters[key] = (now, total)
        if previous is None or now <= previous[0] or total < previous[1]:
            return None
        return (total - previous[1]) / (now - previous[0])


_SOURCES: dict[tuple[str, str], PrometheusSource] = {}


def prometheus_for(url: str, profile: str = "pdfleet", verify: bool | str = True) -> PrometheusSource:
    """The PrometheusSource for a URL and profile, made once per process (it holds an HTTP session)."""
    key = (url.rstrip("/"), profile, verify)
    if key not in _SOURCES:
        _SOURCES[key] = PrometheusSource(url, profile=profile, verify=verify)
    return _SOURCES[key]
