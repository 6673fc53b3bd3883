"""Rollback analysis: from the router's 5xx ratio, keep, stabilise, roll back or page; the operator calls it.

Pure: the operator (a timer or an Alertmanager webhook) measures a `RatioSample` and feeds it with
the revision's `RevisionHealth`; `analyze` returns the next state and one `RollbackAction`.

- failing (ratio above the threshold with at least minRequests in the window) for the whole `for`
  duration -> roll back to the stable revision, exactly once;
- healthy without a break for soakTime -> the revision becomes stable;
- too little traffic is inconclusive: neither healthy nor failing, and it breaks both clocks;
- a missing measurement (Prometheus down, no series, NaN) holds: no clock moves, nothing happens;
- a revision that is itself the result of a rollback, or that has no stable revision to go back
  to, pages instead of rolling back (a rollback never loops).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from pdfleet_operator.api.inference_deployment import InferenceDeploymentSpec, RollbackSpec
from pdfleet_operator.api.meta import parse_duration

Verdict = Literal["healthy", "failing", "inconclusive", "unknown"]
ActionKind = Literal["none", "mark_stable", "rollback", "page"]


@dataclass(frozen=True)
class RatioSample:
    """Requests and 5xx responses of one revision over the analysis window, measured at `time`."""

    time: float
    requests: float | None      # increase of pdfleet_router_requests_total over the window
    errors: float | None        # the same restricted to code=~"5.."
    error: str = ""             # why the measurement is missing, when it is

    @property
    def ratio(self) -> float | None:
        if self.requests is None or self.errors is None or not self.requests:
            return None
        return self.errors / self.requests


@dataclass(frozen=True)
class RevisionHealth:
    """What the analysis remembers about the revision being served (JSON-serializable)."""

    revision: int
    started_at: float
    rollback_target: bool = False      # this revision is being served because of a rollback
    failing_since: float | None = None
    healthy_since: float | None = None
    stable: bool = False
    done: bool = False                 # rolled back or paged: no further action for this revision

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RevisionHealth":
        return cls(**json.loads(text))


@dataclass(frozen=True)
class RollbackAction:
    kind: ActionKind
    reason: str                        # machine reason for conditions and events
    message: str
    ratio: float | None = None


def classify(sample: RatioSample, spec: RollbackSpec) -> Verdict:
    """The verdict of one measurement under the deployment's rollback policy."""
    if sample.requests is None or sample.errors is None:
        return "unknown"
    if any(math.isnan(v) or math.isinf(v) or v < 0 for v in (sample.requests, sample.errors)):
        return "unknown"
    if sample.requests < max(spec.min_requests, 1):
        return "inconclusive"
    return "failing" if sample.errors / sample.requests > spec.error_ratio_threshold else "healthy"


def analyze(health: RevisionHealth, sample: RatioSample, spec: RollbackSpec,
            stable_revision: int | None) -> tuple[RevisionHealth, RollbackAction]:
    """Advance the revision's health by one measurement and say what the operator must do."""
    verdict = classify(sample, spec)
    now, ratio = sample.time, sample.ratio
    shown = f"{ratio:.2%}" if ratio is not None else "n/a"
    if health.done or not spec.enabled:
        return health, RollbackAction("none", "AnalysisInactive", "no analysis for this revision", ratio)
    if verdict == "unknown":
        return health, RollbackAction("none", "MetricsUnavailable",
                                      f"5xx ratio not measurable ({sample.error or 'no data'}); holding", None)
    if verdict == "inconclusive":
        held = replace(health, failing_since=None, healthy_since=None)
        return held, RollbackAction("none", "Inconclusive",
                                    f"{sample.requests:.0f} requests in the window, fewer than minRequests "
                                    f"{spec.min_requests}: neither healthy nor failing", ratio)
    if verdict == "healthy":
        since = health.healthy_since if health.healthy_since is not None else now
        health = replace(health, failing_since=None, healthy_since=since)
        if not health.stable and now - since >= parse_duration(spec.soak_time):
            return replace(health, stable=True), RollbackAction(
                "mark_stable", "RevisionStable",
                f"revision {health.revision} healthy for {spec.soak_time} (5xx ratio {shown})", ratio)
        return health, RollbackAction("none", "Healthy", f"5xx ratio {shown}", ratio)

    since = health.failing_since if health.failing_since is not None else now
    health = replace(health, failing_since=since, healthy_since=None)
    if now - since < parse_duration(spec.for_):
        return health, RollbackAction(
            "none", "FailingPending",
            f"5xx ratio {shown} above {spec.error_ratio_threshold:.2%} for {now - since:.0f}s of {spec.for_}", ratio)
    health = replace(health, done=True)
    if health.rollback_target or stable_revision is None or stable_revision == health.revision:
        why = ("it is itself the result of a rollback" if health.rollback_target
               else "there is no earlier stable revision")
        return health, RollbackAction(
            "page", "RollbackFailed",
            f"revision {health.revision} has 5xx ratio {shown} above {spec.error_ratio_threshold:.2%} for "
            f"{spec.for_}, and {why}: not rolling back again, a human must look", ratio)
    return health, RollbackAction(
        "rollback", "HighErrorRatio",
        f"revision {health.revision} had 5xx ratio {shown} above {spec.error_ratio_threshold:.2%} for {spec.for_}; "
        f"rolling back to stable revision {stable_revision}", ratio)


def health_from_alert(health: RevisionHealth, starts_at: float, spec: RollbackSpec) -> RevisionHealth:
    """Fold a firing Alertmanager alert in: Prometheus fires only after the ratio held for `for`.

    The alert's startsAt is when it went from pending to firing, so the ratio has been above the
    threshold since startsAt - for; the next failing sample then confirms it and rolls back.
    """
    began = starts_at - parse_duration(spec.for_)
    if health.failing_since is None or began < health.failing_since:
        return replace(health, failing_since=max(began, health.started_at), healthy_since=None)
    return health


# --- revisions ---------------------------------------------------------------------------------------

def template_spec(spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """The part of a spec that decides what the pods run: a change here is a new revision.

    Replica counts, autoscaling, SLO, tier and rollback policy are not in it; neither is anything
    the operator decides itself (replicas per class).
    """
    return template_of(spec.wire())


def template_of(wire: dict[str, Any]) -> dict[str, Any]:
    """`template_spec` of a spec's wire form, or of its `revision_wire`."""
    roles = {role: {"acceleratorClasses": wire[role]["acceleratorClasses"], "resources": wire[role].get("resources", {})}
             for role in ("prefill", "decode", "colocated") if role in wire}
    return {
        "model": wire["model"],
        "engine": wire["engine"],
        "disaggregation": wire["disaggregation"],
        "roles": roles,
        "router": {"image": wire["router"].get("image"), "resources": wire["router"].get("resources", {})},
    }


def revision_wire(spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """The template part of a spec in the spec's own shape (a partial spec): what a revision record keeps.

    `template_of(revision_wire(s)) == template_spec(s)`; a rollback fills the rest (sizes, policies)
    from the user's current spec.
    """
    wire = spec.wire()
    out = {name: wire[name] for name in ("model", "engine", "disaggregation")}
    for role in ("prefill", "decode", "colocated"):
        if role in wire:
            out[role] = {k: wire[role][k] for k in ("acceleratorClasses", "resources") if k in wire[role]}
    out["router"] = {k: wire["router"][k] for k in ("image", "resources") if k in wire["router"]}
    return out


def fingerprint(template: dict[str, Any]) -> str:
    """A stable short hash of a template spec (the ControllerRevision's identity)."""
    return hashlib.sha256(json.dumps(template, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def revisions_to_prune(revisions: list[int], limit: int, keep: set[int]) -> list[int]:
    """Oldest revisions beyond the history limit, never one in `keep` (current, stable)."""
    if limit < 1:
        raise ValueError(f"revision history limit must be >= 1, got {limit}")
    ordered = sorted(set(revisions))
    excess = len(ordered) - limit
    out = []
    for rev in ordered:
        if excess <= 0:
            break
        if rev in keep:
            continue
        out.append(rev)
        excess -= 1
    return out
