"""Rollback, the whole state machine: which revision a deployment serves, and when that changes (pure).

The operator calls it from two places: the reconcile chain (`decide.reconcile`, through `serve`: resume
after a restart, roll forward when the spec moves on, a rollback by hand, hold when the revision to
serve is gone) and the analysis loop (`kube.loops`: a timer or an Alertmanager webhook measures a
`RatioSample`, `analyze` advances the revision's `RevisionHealth` and returns one `RollbackAction`, `act`
turns it into the next `RollbackState`). Only `kube/` reads Prometheus, ControllerRevisions and writes.

Analysis rules:

- failing (ratio above the threshold with at least minRequests in the window) for the whole `for`
  duration -> roll back to the stable revision, exactly once;
- healthy without a break for soakTime -> the revision becomes stable;
- too little traffic is inconclusive: neither healthy nor failing, and it breaks both clocks;
- a missing measurement (Prometheus down, no series, NaN) holds: no clock moves, nothing happens;
- a revision that is itself the result of a rollback, or that has no stable revision to go back
  to, pages instead of rolling back (a rollback never loops).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from pdfleet_operator.api import Condition, InferenceDeployment, InferenceDeploymentStatus, names
from pdfleet_operator.api.inference_deployment import InferenceDeploymentSpec, RollbackSpec
from pdfleet_operator.api.meta import parse_duration

Verdict = Literal["healthy", "failing", "inconclusive", "unknown"]
ActionKind = Literal["none", "mark_stable", "rollback", "page"]


@dataclass(frozen=True)
class RatioSample:
    """Requests and 5xx responses of one revision over the analysis window, measured at `time`."""

    time: float
    requests: float | None  # increase of pdfleet_router_requests_total over the window
    errors: float | None  # the same restricted to code=~"5.."
    error: str = ""  # why the measurement is missing, when it is

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
    rollback_target: bool = False  # this revision is being served because of a rollback
    failing_since: float | None = None
    healthy_since: float | None = None
    stable: bool = False
    done: bool = False  # rolled back or paged: no further action for this revision

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RevisionHealth":
        return cls(**json.loads(text))


@dataclass(frozen=True)
class RollbackAction:
    kind: ActionKind
    reason: str  # machine reason for conditions and events
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


def analyze(
    health: RevisionHealth, sample: RatioSample, spec: RollbackSpec, stable_revision: int | None
) -> tuple[RevisionHealth, RollbackAction]:
    """Advance the revision's health by one measurement and say what the operator must do."""
    verdict = classify(sample, spec)
    now, ratio = sample.time, sample.ratio
    shown = f"{ratio:.2%}" if ratio is not None else "n/a"
    if health.done or not spec.enabled:
        return health, RollbackAction("none", "AnalysisInactive", "no analysis for this revision", ratio)
    if verdict == "unknown":
        return health, RollbackAction(
            "none", "MetricsUnavailable", f"5xx ratio not measurable ({sample.error or 'no data'}); holding", None
        )
    if verdict == "inconclusive":
        held = replace(health, failing_since=None, healthy_since=None)
        return held, RollbackAction(
            "none",
            "Inconclusive",
            f"{sample.requests:.0f} requests in the window, fewer than minRequests "
            f"{spec.min_requests}: neither healthy nor failing",
            ratio,
        )
    if verdict == "healthy":
        since = health.healthy_since if health.healthy_since is not None else now
        health = replace(health, failing_since=None, healthy_since=since)
        if not health.stable and now - since >= parse_duration(spec.soak_time):
            return replace(health, stable=True), RollbackAction(
                "mark_stable",
                "RevisionStable",
                f"revision {health.revision} healthy for {spec.soak_time} (5xx ratio {shown})",
                ratio,
            )
        return health, RollbackAction("none", "Healthy", f"5xx ratio {shown}", ratio)

    since = health.failing_since if health.failing_since is not None else now
    health = replace(health, failing_since=since, healthy_since=None)
    if now - since < parse_duration(spec.for_):
        return health, RollbackAction(
            "none",
            "FailingPending",
            f"5xx ratio {shown} above {spec.error_ratio_threshold:.2%} for {now - since:.0f}s of {spec.for_}",
            ratio,
        )
    health = replace(health, done=True)
    if health.rollback_target or stable_revision is None or stable_revision == health.revision:
        why = (
            "it is itself the result of a rollback" if health.rollback_target else "there is no earlier stable revision"
        )
        return health, RollbackAction(
            "page",
            "RollbackFailed",
            f"revision {health.revision} has 5xx ratio {shown} above {spec.error_ratio_threshold:.2%} for "
            f"{spec.for_}, and {why}: not rolling back again, a human must look",
            ratio,
        )
    return health, RollbackAction(
        "rollback",
        "HighErrorRatio",
        f"revision {health.revision} had 5xx ratio {shown} above {spec.error_ratio_threshold:.2%} for {spec.for_}; "
        f"rolling back to stable revision {stable_revision}",
        ratio,
    )


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
    roles = {
        role: {"acceleratorClasses": wire[role]["acceleratorClasses"], "resources": wire[role].get("resources", {})}
        for role in ("prefill", "decode", "colocated")
        if role in wire
    }
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


# --- which revision is served: the state machine around the analysis ----------------------------------------

ANNOTATION_ROLLBACK_TO = "pdfleet.io/rollback-to"
ANNOTATION_FINGERPRINT = "pdfleet.io/template-fingerprint"
# Degraded's reason while the revision a rollback serves has no ControllerRevision left (the pools are held).
REASON_REVISION_MISSING = "RevisionMissing"
# Policy fields a rollback takes from the user's current spec rather than from the stored revision.
CURRENT_POLICIES = ("autoscaling", "rollback", "rollout", "slo", "tier")


@dataclass(frozen=True)
class Template:
    """Which revision's pod template to serve instead of the spec (set by a rollback); `spec` is that revision's."""

    revision: int
    spec: InferenceDeploymentSpec


@dataclass(frozen=True)
class Failed:
    """A rolled-back revision: not served again until a new generation brings a different template."""

    revision: int  # the spec's revision when it was rolled back (status.failedRevision)
    generation: int | None  # the generation rolled back (the RolledBack condition's observedGeneration)
    fingerprint: str | None  # the spec's template then; None: not known (its ControllerRevision is gone)


@dataclass(frozen=True)
class RollbackState:
    """What this process knows of one deployment's rollback (held in its `kube.memory.DeploymentMemory`).

    Every transition returns a new state: `serve` (each reconcile) and `act` (each analysis action)."""

    template: Template | None = None  # the stored revision served instead of the spec
    failed: Failed | None = None
    health: RevisionHealth | None = None
    manual: str | None = None  # resourceVersion whose rollback-to was acted on
    resumed: bool = False  # rebuilt from the cluster in this process (`resume`)
    held: str | None = None  # pools left as they are, with the page's message

    def spec_moved_on(self, dep: InferenceDeployment) -> bool:
        """A rollback ends when the user changes the spec again to another template."""
        if self.failed is None:
            return False
        return moved_on(self.failed, dep.metadata.generation, fingerprint(template_spec(dep.spec)))


def moved_on(failed: Failed, generation: int | None, fingerprint_now: str) -> bool:
    """A rollback ends when the user changes the spec again to another template.

    NOTE: with the failed template unknown, any new generation ends it: the spec did change, and
    the analysis judges whatever it brings (the alternative, a rollback nothing can end, is worse).
    """
    if generation == failed.generation:
        return False
    return failed.fingerprint is None or fingerprint_now != failed.fingerprint


def number_of(obj: Mapping[str, Any]) -> int:
    """A ControllerRevision's revision number."""
    return int(obj.get("revision") or 0)


def find(stored: Sequence[Mapping[str, Any]], number: int) -> Mapping[str, Any] | None:
    return next((r for r in stored if number_of(r) == number), None)


def _template_hash(obj: Mapping[str, Any]) -> str | None:
    return (obj["metadata"].get("annotations") or {}).get(names.ANNOTATION_TEMPLATE_HASH)


def fingerprint_of(obj: Mapping[str, Any]) -> str:
    """The template fingerprint of a stored revision (its annotation, else computed from its data)."""
    stored = (obj["metadata"].get("annotations") or {}).get(ANNOTATION_FINGERPRINT)
    return stored or fingerprint((obj.get("data") or {}).get("template") or {})


def spec_for_rollback(stored: Mapping[str, Any], current: InferenceDeploymentSpec) -> InferenceDeploymentSpec:
    """The stored revision's spec with the user's current policies (sizes, autoscaling, rollback, SLO).

    NOTE: a record keeps each role's template only (classes, resources). A role the current spec does
    not have (a rollback across a colocated <-> PD switch) gets the default replica bounds (1..4).
    """
    wire = dict((stored.get("data") or {}).get("spec") or {})
    if not wire:
        raise ValueError(f"ControllerRevision {stored['metadata']['name']} holds no spec")
    now = current.wire()
    for name in CURRENT_POLICIES:
        if name in now:
            wire[name] = now[name]
    # Sizes are not part of a revision either: each role (and the router) keeps the stored template fields only.
    for role in ("prefill", "decode", "colocated", "router"):
        if isinstance(wire.get(role), dict) and isinstance(now.get(role), dict):
            kept = ("image", "resources") if role == "router" else ("acceleratorClasses", "resources")
            wire[role] = {**now[role], **{k: v for k, v in wire[role].items() if k in kept}}
    return InferenceDeploymentSpec.model_validate(wire)


def running_revisions(children: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Template hash -> revision of the worker Deployments and the ConfigMap (the router runs no template)."""
    out: dict[str, int] = {}
    for c in children:
        meta = c["metadata"]
        labels = meta.get("labels") or {}
        if c["kind"] not in ("Deployment", "ConfigMap") or labels.get(names.LABEL_ROLE) == names.ROUTER_ROLE:
            continue
        found = (meta.get("annotations") or {}).get(names.ANNOTATION_TEMPLATE_HASH)
        try:
            number = int(labels.get(names.LABEL_REVISION, ""))
        except ValueError:
            continue
        if found:
            out[found] = max(number, out.get(found, 0))
    return out


def number_for(
    spec: InferenceDeploymentSpec, stored: Sequence[Mapping[str, Any]], running: Mapping[str, int], fallback: int
) -> int:
    """The revision number of this spec's pod template.

    `running`: template hash -> revision of what the pools and the ConfigMap run now; `fallback`: the
    number when nothing runs and nothing is stored (the status's, or 1). The template that runs keeps
    its number. Else the newest stored revision's, when it is this template and newer than anything
    running (the spec's revision while a rollback serves an older one); else one past every number
    used. As with a Deployment's rollout history, going back to an older template is a new revision;
    a number is never reused for another template.
    """
    wanted = fingerprint(template_spec(spec))
    if wanted in running:
        return running[wanted]
    numbers = [number_of(r) for r in stored]
    newest = max(stored, key=number_of, default=None)
    if newest is not None and _template_hash(newest) == wanted and number_of(newest) > max(running.values(), default=0):
        return number_of(newest)
    if not running:
        return max([fallback - 1] + numbers) + 1
    return max(list(running.values()) + numbers) + 1


@dataclass(frozen=True)
class Resumed:
    """What a new process serves for a deployment, rebuilt from its status and ControllerRevisions.

    kind: "spec" (no rollback in force), "stored" (keep serving stored revision `template` with
    `spec`), "roll_forward" (the spec changed to another template while no process watched: end
    the rollback of `failed`), "hold" (the revision to keep serving is not stored: leave the pools
    as they are and page with `message` until the spec changes).
    """

    kind: Literal["spec", "stored", "roll_forward", "hold"]
    failed: Failed | None = None
    template: int | None = None
    spec: InferenceDeploymentSpec | None = None
    message: str = ""


def condition(status: InferenceDeploymentStatus | None, type_: str) -> Condition | None:
    return next((c for c in (status.conditions if status else []) if c.type == type_), None)


def resume(
    status: InferenceDeploymentStatus | None,
    generation: int | None,
    spec: InferenceDeploymentSpec,
    stored: Sequence[Mapping[str, Any]],
    serving: Mapping[str, Any] | None = None,
) -> Resumed:
    """The rollback state a previous process left in the cluster: `RolledBack=True` (its observedGeneration
    is the generation rolled back), status.currentRevision (the revision served instead of the spec),
    status.failedRevision and its ControllerRevision (the template not to re-apply). `serving`: the
    record of what the ConfigMap says is served (`kube.revisions.served_record`), used when the served
    revision's ControllerRevision is gone."""
    rolled = condition(status, "RolledBack")
    if status is None or rolled is None or rolled.status != "True" or status.current_revision is None:
        return Resumed("spec")
    served = status.current_revision
    number = status.failed_revision if status.failed_revision is not None else served
    record = find(stored, number) if status.failed_revision is not None else None
    failed = Failed(number, rolled.observed_generation, fingerprint_of(record) if record is not None else None)
    if moved_on(failed, generation, fingerprint(template_spec(spec))):
        return Resumed("roll_forward", failed)
    kept = find(stored, served)
    if kept is None and serving is not None and number_of(serving) == served:
        kept = serving  # its record was deleted, but the ConfigMap still holds what the pools run
    try:
        if kept is not None:
            return Resumed("stored", failed, served, spec_for_rollback(kept, spec))
        why = "its ControllerRevision is gone (deleted by hand?)"
    except ValueError as exc:
        why = f"its ControllerRevision is unusable ({exc})"
    return Resumed(
        "hold",
        failed,
        message=(
            f"revision {served}, served since revision {failed.revision} was rolled back, cannot be rendered: {why}. "
            f"The pools are left as they are; change the spec, or annotate {ANNOTATION_ROLLBACK_TO}=N with a stored "
            f"revision ({', '.join(str(number_of(r)) for r in stored) or 'none'})"
        ),
    )


def paged_revision(status: InferenceDeploymentStatus | None) -> int | None:
    """The revision a standing page (Degraded=True, RollbackFailed) is about, so that no process pages twice.

    NOTE: read back from the message `conditions_for` writes ("revision N: ..."); the status has no
    field of its own for it.
    """
    degraded = condition(status, "Degraded")
    if degraded is None or degraded.status != "True" or degraded.reason != "RollbackFailed":
        return None
    found = re.match(r"revision (\d+): ", degraded.message or "")
    return int(found.group(1)) if found else None


def health_for(
    revision: int, now: float, rollback_target: bool, stable: int | None, status: InferenceDeploymentStatus | None
) -> RevisionHealth:
    """The analysis state of a revision this process starts watching: what the status already says (it is
    the stable revision, it has paged) is not said again by a new process."""
    return RevisionHealth(
        revision,
        now,
        rollback_target=rollback_target,
        stable=stable == revision,
        done=paged_revision(status) == revision,
    )


def conditions_for(
    action: RollbackAction, failed: int, stable: int | None, generation: int | None, at: dt.datetime
) -> list[Condition]:
    """RolledBack and Degraded for a rollback; Degraded for a page."""
    ratio = f"{action.ratio:.2%}" if action.ratio is not None else "n/a"
    if action.kind == "rollback":
        message = f"revision {failed} rolled back to {stable}: 5xx ratio {ratio}. {action.message}"
        return [
            Condition(
                type="RolledBack",
                status="True",
                reason=action.reason,
                message=message,
                last_transition_time=at,
                observed_generation=generation,
            ),
            Condition(
                type="Degraded",
                status="True",
                reason="RolledBack",
                message=message,
                last_transition_time=at,
                observed_generation=generation,
            ),
        ]
    message = f"revision {failed}: 5xx ratio {ratio}. {action.message}"
    return [
        Condition(
            type="Degraded",
            status="True",
            reason=action.reason,
            message=message,
            last_transition_time=at,
            observed_generation=generation,
        )
    ]


@dataclass(frozen=True)
class Notice:
    """An Event to post about the InferenceDeployment."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class Serving:
    """What one reconcile serves, and what the rollback state machine says about it."""

    spec: InferenceDeploymentSpec
    revision: int
    spec_revision: int  # the revision of the user's spec (what a roll forward serves)
    state: RollbackState
    conditions: tuple[Condition, ...] = ()  # set on the status (and kept set) from now on
    cleared: tuple[str, ...] = ()  # condition types no longer set by rollback
    fields: Mapping[str, Any] = field(default_factory=dict)  # status fields (failed_revision)
    notices: tuple[Notice, ...] = ()
    remove_annotation: bool = False  # the one-shot rollback-to annotation was acted on
    held: str | None = None  # the pools are left as they are; page with this message

    @property
    def template(self) -> Template | None:
        return self.state.template


def serve(
    state: RollbackState,
    dep: InferenceDeployment,
    *,
    stored: Sequence[Mapping[str, Any]],
    served_record: Mapping[str, Any] | None,
    children: Sequence[Mapping[str, Any]],
    annotation: str | None,
    resource_version: str | None,
    now: dt.datetime,
) -> Serving:
    """One reconcile's step of the state machine: resume (once per process), roll forward when the spec moved on,
    a rollback by hand (`pdfleet.io/rollback-to=N`, once per version of the object), hold when the revision
    to serve cannot be rendered."""
    conditions: list[Condition] = []
    cleared: list[str] = []
    fields: dict[str, Any] = {}
    notices: list[Notice] = []
    generation = dep.metadata.generation
    if not state.resumed:
        state = _resumed(state, resume(dep.status, generation, dep.spec, stored, served_record))
    if state.spec_moved_on(dep):
        assert state.failed is not None
        conditions.append(
            Condition(
                type="RolledBack",
                status="False",
                reason="RolledForward",
                message=f"the spec changed after revision {state.failed.revision} was rolled back",
                last_transition_time=now,
                observed_generation=generation,
            )
        )
        cleared.append("Degraded")
        state = replace(state, template=None, held=None, failed=None)
    fallback = dep.status.current_revision if dep.status and dep.status.current_revision else 1
    spec_revision = number_for(dep.spec, stored, running_revisions(children), fallback)
    remove = False
    if annotation is not None and state.manual != resource_version:
        # (once per version of the object: the index may still show the annotation we just removed)
        state = replace(state, manual=resource_version)
        remove = True
        state, said = _by_hand(state, dep, annotation, stored, spec_revision, now, conditions, fields)
        notices.append(said)
    if state.held is not None:
        if state.template is None:
            return Serving(
                dep.spec,
                spec_revision,
                spec_revision,
                state,
                tuple(conditions),
                tuple(cleared),
                fields,
                tuple(notices),
                remove,
                held=state.held,
            )
        state = replace(state, held=None)  # a rollback by hand named a stored revision
    template = state.template
    return Serving(
        template.spec if template else dep.spec,
        template.revision if template else spec_revision,
        spec_revision,
        state,
        tuple(conditions),
        tuple(cleared),
        fields,
        tuple(notices),
        remove,
    )


def _resumed(state: RollbackState, resumed: Resumed) -> RollbackState:
    """Take over a rollback a previous process left in force, so that a restart never re-applies the failed
    revision while the spec is unchanged."""
    state = replace(state, resumed=True)
    if resumed.kind == "spec":
        return state
    assert resumed.failed is not None, resumed
    state = replace(state, failed=resumed.failed)
    if resumed.kind == "stored":
        assert resumed.template is not None and resumed.spec is not None, resumed
        return replace(state, template=Template(resumed.template, resumed.spec))
    if resumed.kind == "hold":
        return replace(state, held=resumed.message)
    return state  # "roll_forward": the failed revision is remembered only for spec_moved_on to end the rollback


def _by_hand(
    state: RollbackState,
    dep: InferenceDeployment,
    wanted: str,
    stored: Sequence[Mapping[str, Any]],
    spec_revision: int,
    now: dt.datetime,
    conditions: list[Condition],
    fields: dict[str, Any],
) -> tuple[RollbackState, Notice]:
    """`kubectl annotate infdep X pdfleet.io/rollback-to=N`: serve revision N until the spec changes again.
    The annotation is a one-shot command, removed once acted on (or rejected with a Warning Event)."""
    target = find(stored, int(wanted)) if wanted.isdigit() else None
    current = state.template.revision if state.template is not None else spec_revision
    if target is None:
        known = ", ".join(str(number_of(r)) for r in stored) or "none"
        return state, Notice(
            "Warning",
            "RollbackRejected",
            f"{ANNOTATION_ROLLBACK_TO}={wanted!r} names no stored revision (stored: {known}; serving: {current})",
        )
    number = number_of(target)
    # What is not re-applied until the spec changes is the spec's own revision (status.failedRevision, which
    # a restart reads back), whichever revision was being served.
    state = replace(
        state,
        template=Template(number, spec_for_rollback(target, dep.spec)),
        failed=Failed(spec_revision, dep.metadata.generation, fingerprint(template_spec(dep.spec))),
    )
    fields["failed_revision"] = spec_revision
    message = f"revision {current} rolled back to {number} by hand ({ANNOTATION_ROLLBACK_TO})"
    conditions.append(
        Condition(
            type="RolledBack",
            status="True",
            reason="ManualRollback",
            message=message,
            last_transition_time=now,
            observed_generation=dep.metadata.generation,
        )
    )
    return state, Notice("Normal", "RolledBack", message)


@dataclass(frozen=True)
class Acted:
    """What one analysis action changes: the next state, status conditions and fields, and an Event."""

    state: RollbackState
    conditions: tuple[Condition, ...] = ()
    fields: Mapping[str, Any] = field(default_factory=dict)
    notice: Notice | None = None
    template_changed: bool = False


def act(
    state: RollbackState,
    action: RollbackAction,
    dep: InferenceDeployment,
    served: int,
    stable: int | None,
    stable_record: Mapping[str, Any] | None,
    source: str,
    now: dt.datetime,
) -> Acted:
    """The analysis said `action` about revision `served`: mark it stable, roll back to `stable` (whose stored
    record is `stable_record`, None when it is gone: then page instead), or page."""
    generation = dep.metadata.generation
    if action.kind == "mark_stable":
        return Acted(state, fields={"stable_revision": served}, notice=Notice("Normal", action.reason, action.message))
    if action.kind == "rollback":
        assert stable is not None, "a rollback needs a stable revision"
        if stable_record is None:
            action = RollbackAction(
                "page",
                "RollbackFailed",
                f"stable revision {stable} is not stored (pruned or deleted); {action.message}",
                action.ratio,
            )
        else:
            state = replace(
                state,
                failed=Failed(served, generation, fingerprint(template_spec(dep.spec))),
                template=Template(stable, spec_for_rollback(stable_record, dep.spec)),
            )
            return Acted(
                state,
                tuple(conditions_for(action, served, stable, generation, now)),
                {"failed_revision": served},
                Notice(
                    "Warning", "RolledBack", f"revision {served} rolled back to {stable} ({source}): {action.message}"
                ),
                template_changed=True,
            )
    if action.kind == "page":
        return Acted(
            state,
            tuple(conditions_for(action, served, stable, generation, now)),
            notice=Notice("Warning", action.reason, action.message),
        )
    return Acted(state)
