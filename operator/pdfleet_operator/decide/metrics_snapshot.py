"""`MetricsSnapshot`: the queue metrics of one deployment at one moment, from `metrics` sources to the autoscaler."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ClassMetrics:
    """The replicas of one role on one AcceleratorClass (the `pdfleet_accelerator` label): what the
    autoscaler learns each class's per-replica throughput from."""

    replicas_reporting: int  # replicas of this class whose series were found
    waiting: float  # requests waiting on them (> 0: the class is saturated)
    prompt_tokens_rate: float | None = None  # prompt tokens they prefilled per second
    generation_tokens_rate: float | None = None  # tokens they generated per second

    def __post_init__(self) -> None:
        _check(self, ("waiting", "prompt_tokens_rate", "generation_tokens_rate"))
        if self.replicas_reporting < 1:
            raise ValueError(f"ClassMetrics needs at least one reporting replica, got {self.replicas_reporting}")


@dataclass(frozen=True)
class RoleMetrics:
    """One role's queues summed over its replicas (None: the engine does not export that signal)."""

    waiting: float  # requests waiting to be scheduled
    running: float  # requests in running batches
    replicas_reporting: int  # replicas whose series were found
    sample_time: float  # unix seconds of the oldest replica's sample
    kv_usage: float | None = None  # mean KV cache usage, 0..1
    prompt_tokens_waiting: float | None = None  # prompt tokens of the waiting requests
    prompt_tokens_rate: float | None = None  # prompt tokens prefilled per second
    generation_tokens_rate: float | None = None  # tokens generated per second
    # The same role split by AcceleratorClass; empty when the source cannot tell the classes apart
    # (series without the `pdfleet_accelerator` label): the role is then sized as one class.
    classes: Mapping[str, ClassMetrics] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(
            self,
            (
                "waiting",
                "running",
                "sample_time",
                "kv_usage",
                "prompt_tokens_waiting",
                "prompt_tokens_rate",
                "generation_tokens_rate",
            ),
        )
        if "" in self.classes:
            raise ValueError("RoleMetrics.classes has an empty class name")
        if self.replicas_reporting < 1:
            raise ValueError(f"RoleMetrics needs at least one reporting replica, got {self.replicas_reporting}")


def _check(metrics: object, fields: tuple[str, ...]) -> None:
    for name in fields:
        value = getattr(metrics, name)
        if value is not None and not math.isfinite(value):
            raise ValueError(
                f"{type(metrics).__name__}.{name} is {value}: a non-finite sample is missing data, "
                "build an unavailable snapshot instead"
            )
        if value is not None and value < 0:
            raise ValueError(f"{type(metrics).__name__}.{name} is negative ({value})")


@dataclass(frozen=True)
class MetricsSnapshot:
    """Per-role queue metrics of one deployment, or `ok=False` with the error that kept them from us.

    An unavailable snapshot carries no numbers at all, so nothing downstream can read an error as zero.
    """

    taken_at: float  # unix seconds when the source was asked
    roles: Mapping[str, RoleMetrics] = field(default_factory=dict)
    ok: bool = True
    error: str = ""
    source: str = ""  # e.g. "prometheus http://...", "scrape"

    def __post_init__(self) -> None:
        if self.ok and self.error:
            raise ValueError(f"an ok snapshot carries an error: {self.error!r}")
        if not self.ok and not self.error:
            raise ValueError("an unavailable snapshot must say why (error)")
        if not self.ok and self.roles:
            raise ValueError("an unavailable snapshot must not carry numbers")

    @classmethod
    def unavailable(cls, taken_at: float, error: str, source: str = "") -> "MetricsSnapshot":
        return cls(taken_at=taken_at, ok=False, error=error, source=source)

    def age(self, role: str, now: float) -> float:
        """Seconds since the role's oldest sample."""
        return now - self.roles[role].sample_time
