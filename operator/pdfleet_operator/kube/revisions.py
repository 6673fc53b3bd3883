"""Revisions and rollback in the operator: ControllerRevision bookkeeping and the analysis loop; called by `handlers`.

Every pod template a deployment has served is a revision. The one served now is recorded on the
ConfigMap (revision label, template hash, `rollback.revision_wire`); once another revision supersedes
it, it is stored as a ControllerRevision the deployment owns (data: the template and the partial
spec it came from), before the ConfigMap is overwritten (`superseded`, `record`). The analysis feeds
`rollback.analyze` with the router's 5xx ratio from Prometheus (`metrics`), on a timer and when
Alertmanager posts a firing alert, and turns its action into reconciler inputs: `set_template` to the
stable revision, conditions, Events. A new process rebuilds that memory from the status, the
ControllerRevisions and the ConfigMap (`resume`,
`health_for`), so a restart re-applies no failed revision and repeats no page. Writes go through `kube`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pdfleet_operator import prometheus
from pdfleet_operator.api import (
    Condition,
    InferenceDeployment,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    names,
)
from pdfleet_operator.decide import guardrails, rollback
from pdfleet_operator.kube import client, render
from pdfleet_operator.kube.options import OPTIONS

logger = logging.getLogger("pdfleet.revisions")
Key = tuple[str, str]
ANNOTATION_FINGERPRINT = "pdfleet.io/template-fingerprint"
ANNOTATION_ROLLBACK_TO = "pdfleet.io/rollback-to"
# Degraded's reason while the revision a rollback serves has no ControllerRevision left (the pools are held).
REASON_REVISION_MISSING = "RevisionMissing"
# Policy fields a rollback takes from the user's current spec rather than from the stored revision.
CURRENT_POLICIES = ("autoscaling", "rollback", "slo", "tier")


def revision_object(owner: render.Owner, number: int, wire: Mapping[str, Any], template_hash: str) -> dict[str, Any]:
    """The ControllerRevision of revision `number`: its template (`wire`, a `rollback.revision_wire`)."""
    template = rollback.template_of(dict(wire))
    return {
        "apiVersion": "apps/v1", "kind": "ControllerRevision",
        "metadata": {"name": names.child_name(owner.name, "rev", str(number)), "namespace": owner.namespace,
                     "labels": render.labels(owner, "revision", revision=number),
                     "annotations": {render.ANNOTATION_TEMPLATE_HASH: template_hash,
                                     ANNOTATION_FINGERPRINT: rollback.fingerprint(template)},
                     "ownerReferences": [owner.reference()]},
        "revision": number,
        "data": {"template": template, "spec": dict(wire)},
    }


def served_record(config_map: Mapping[str, Any] | None, owner: render.Owner) -> dict[str, Any] | None:
    """The revision the ConfigMap says is served, as the ControllerRevision it becomes once superseded;
    None when the ConfigMap records none (absent, written by an operator that stored every revision as
    it served, or edited by hand)."""
    number = served_number(config_map)
    if config_map is None or number is None:
        return None
    annotations = (config_map.get("metadata") or {}).get("annotations") or {}
    try:
        wire = json.loads(annotations[render.ANNOTATION_REVISION_SPEC])
    except (KeyError, ValueError):
        return None
    if not isinstance(wire, dict):
        return None
    return revision_object(owner, number, wire, annotations.get(render.ANNOTATION_TEMPLATE_HASH, ""))


def served_number(config_map: Mapping[str, Any] | None) -> int | None:
    """The revision the ConfigMap is labelled with (None: no ConfigMap, or no usable label)."""
    labels = ((config_map or {}).get("metadata") or {}).get("labels") or {}
    try:
        return int(labels[render.LABEL_REVISION])
    except (KeyError, ValueError):
        return None


def superseded(config_map: Mapping[str, Any] | None, owner: render.Owner, serving: int,
               stored: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ControllerRevision to store before the pools move to revision `serving`: the revision the
    ConfigMap says is served now, when it is another one and not stored yet; else None.

    The served revision lives in the spec (or a stored record), the pools and the ConfigMap; it
    becomes a record only once superseded, so a new deployment writes none (issue 5's write budget).
    Every revision that ever served still gets one, before the last copy of its template is overwritten.
    """
    number = served_number(config_map)  # (checked first: a steady reconcile parses no JSON)
    if number is None or number == serving or find(stored, number) is not None:
        return None
    return served_record(config_map, owner)


def number_of(obj: Mapping[str, Any]) -> int:
    return int(obj.get("revision") or 0)


def find(revisions: list[dict[str, Any]], number: int) -> dict[str, Any] | None:
    return next((r for r in revisions if number_of(r) == number), None)


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


def number_for(spec: InferenceDeploymentSpec, revisions: list[dict[str, Any]], running: Mapping[str, int],
               fallback: int) -> int:
    """The revision number of this spec's pod template.

    `running`: template hash -> revision of what the pools and the ConfigMap run now; `fallback`: the
    number when nothing runs and nothing is stored (the status's, or 1). The template that runs keeps
    its number. Else the newest stored revision's, when it is this template and newer than anything
    running (the spec's revision while a rollback serves an older one); else one past every number
    used. As with a Deployment's rollout history, going back to an older template is a new revision;
    a number is never reused for another template.
    """
    wanted = render.template_hash(spec)
    if wanted in running:
        return running[wanted]
    numbers = [number_of(r) for r in revisions]
    newest = max(revisions, key=number_of, default=None)
    if newest is not None and _hash(newest) == wanted and number_of(newest) > max(running.values(), default=0):
        return number_of(newest)
    if not running:
        return max([fallback - 1] + numbers) + 1
    return max(list(running.values()) + numbers) + 1


def running_revisions(children: list[dict[str, Any]]) -> dict[str, int]:
    """Template hash -> revision of the worker Deployments and the ConfigMap (the router runs no template)."""
    out: dict[str, int] = {}
    for c in children:
        meta = c["metadata"]
        labels = meta.get("labels") or {}
        if c["kind"] not in ("Deployment", "ConfigMap") or labels.get(render.LABEL_ROLE) == render.ROUTER_ROLE:
            continue
        found = (meta.get("annotations") or {}).get(render.ANNOTATION_TEMPLATE_HASH)
        try:
            number = int(labels.get(render.LABEL_REVISION, ""))
        except ValueError:
            continue
        if found:
            out[found] = max(number, out.get(found, 0))
    return out


def fingerprint_of(obj: Mapping[str, Any]) -> str:
    """The template fingerprint of a stored revision (its annotation, else computed from its data)."""
    stored = (obj["metadata"].get("annotations") or {}).get(ANNOTATION_FINGERPRINT)
    return stored or rollback.fingerprint((obj.get("data") or {}).get("template") or {})


def _hash(obj: Mapping[str, Any]) -> str | None:
    return (obj["metadata"].get("annotations") or {}).get(render.ANNOTATION_TEMPLATE_HASH)


async def record(api: client.Api, revision: dict[str, Any] | None, stored: list[dict[str, Any]], limit: int,
                 keep: set[int]) -> list[str]:
    """Store a superseded revision (`superseded`), drop older copies of its template (not kept ones) and
    prune beyond the history limit (never one in `keep`: served, stable, failed); the keys written."""
    written = []
    if revision is not None:
        obj = await client.save_revision(api, revision)
        duplicates = [r for r in stored if _hash(r) == _hash(obj) and number_of(r) not in keep | {number_of(obj)}]
        await client.delete_revisions(api, duplicates)
        written += [client.key_of(obj)] + [client.key_of(r) for r in duplicates]
        stored = [r for r in stored if r not in duplicates] + [obj]
    prune = set(rollback.revisions_to_prune([number_of(r) for r in stored], limit, keep))
    gone = [r for r in stored if number_of(r) in prune]
    await client.delete_revisions(api, gone)
    return written + [client.key_of(r) for r in gone]


@dataclass
class Failed:
    """A rolled-back revision: not served again until a new generation brings a different template."""

    revision: int               # the spec's revision when it was rolled back (status.failedRevision)
    generation: int | None      # the generation rolled back (the RolledBack condition's observedGeneration)
    fingerprint: str | None     # the spec's template then; None: not known (its ControllerRevision is gone)


def moved_on(failed: Failed, generation: int | None, fingerprint: str) -> bool:
    """A rollback ends when the user changes the spec again to another template.

    NOTE: with the failed template unknown, any new generation ends it: the spec did change, and
    the analysis judges whatever it brings (the alternative, a rollback nothing can end, is worse).
    """
    if generation == failed.generation:
        return False
    return failed.fingerprint is None or fingerprint != failed.fingerprint


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


def resume(status: InferenceDeploymentStatus | None, generation: int | None, spec: InferenceDeploymentSpec,
           stored: list[dict[str, Any]], serving: dict[str, Any] | None = None) -> Resumed:
    """The rollback state a previous process left in the cluster: `RolledBack=True` (its observedGeneration
    is the generation rolled back), status.currentRevision (the revision served instead of the spec),
    status.failedRevision and its ControllerRevision (the template not to re-apply). `serving`: the
    record of what the ConfigMap says is served (`served_record`), used when the served revision's
    ControllerRevision is gone."""
    rolled = condition(status, "RolledBack")
    if status is None or rolled is None or rolled.status != "True" or status.current_revision is None:
        return Resumed("spec")
    served = status.current_revision
    number = status.failed_revision if status.failed_revision is not None else served
    record = find(stored, number) if status.failed_revision is not None else None
    failed = Failed(number, rolled.observed_generation, fingerprint_of(record) if record is not None else None)
    if moved_on(failed, generation, rollback.fingerprint(rollback.template_spec(spec))):
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
    return Resumed("hold", failed, message=(
        f"revision {served}, served since revision {failed.revision} was rolled back, cannot be rendered: {why}. "
        f"The pools are left as they are; change the spec, or annotate {ANNOTATION_ROLLBACK_TO}=N with a stored "
        f"revision ({', '.join(str(number_of(r)) for r in stored) or 'none'})"))


def condition(status: InferenceDeploymentStatus | None, type_: str) -> Condition | None:
    return next((c for c in (status.conditions if status else []) if c.type == type_), None)


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


def health_for(revision: int, now: float, rollback_target: bool, stable: int | None,
               status: InferenceDeploymentStatus | None) -> rollback.RevisionHealth:
    """The analysis state of a revision this process starts watching: what the status already says (it is
    the stable revision, it has paged) is not said again by a new process."""
    return rollback.RevisionHealth(revision, now, rollback_target=rollback_target, stable=stable == revision,
                                   done=paged_revision(status) == revision)


@dataclass
class RollbackMemory:
    """What this process knows of one deployment's rollback (part of its `kube.memory.DeploymentMemory`)."""

    health: rollback.RevisionHealth | None = None
    failed: Failed | None = None
    manual: str | None = None    # resourceVersion whose rollback-to was acted on
    resumed: bool = False        # rebuilt from the cluster in this process (`resume`)
    held: str | None = None      # pools left as they are, with the page's message

    def spec_moved_on(self, dep: InferenceDeployment) -> bool:
        """A rollback ends when the user changes the spec again to another template."""
        if self.failed is None:
            return False
        return moved_on(self.failed, dep.metadata.generation, rollback.fingerprint(rollback.template_spec(dep.spec)))


@dataclass
class AnalysisLog:
    """What the rollback analysis of this process received and did, across deployments (tests and logs)."""

    triggers: list[tuple[float, Any]] = field(default_factory=list)  # (monotonic time, RollbackTrigger) received
    actions: list[tuple[float, Key, str, rollback.RollbackAction]] = field(default_factory=list)  # (time, key, source, action)


async def sample(dep: InferenceDeployment, default_url: str | None, profile: str, revision: int | None = None
                 ) -> rollback.RatioSample:
    """The 5xx ratio of the deployment's router over the rollback window (missing -> held, never healthy):
    of `revision` (its workers' answers and those no worker gave, shedding excluded) where the router says."""
    now = time.time()
    url = dep.spec.autoscaling.prometheus_url or default_url
    if not url:
        return rollback.RatioSample(now, None, None, "no Prometheus URL (spec.autoscaling.prometheusUrl / --prometheus-url)")
    refused = guardrails.prometheus_url_problem(url, default_url, OPTIONS.prometheus_allowed)
    if refused:
        return rollback.RatioSample(now, None, None, refused)
    source = prometheus.prometheus_for(url, profile, OPTIONS.prometheus_verify)
    assert dep.metadata.name and dep.metadata.namespace
    requests, errors, why = await asyncio.to_thread(source.router_requests, dep.metadata.name, dep.metadata.namespace,
                                                    dep.spec.rollback.window, revision)
    return rollback.RatioSample(now, requests, errors, why)


def conditions_for(action: rollback.RollbackAction, failed: int, stable: int | None, generation: int | None
                   ) -> list[Condition]:
    at = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    ratio = f"{action.ratio:.2%}" if action.ratio is not None else "n/a"
    if action.kind == "rollback":
        message = f"revision {failed} rolled back to {stable}: 5xx ratio {ratio}. {action.message}"
        return [Condition(type="RolledBack", status="True", reason=action.reason, message=message,
                          last_transition_time=at, observed_generation=generation),
                Condition(type="Degraded", status="True", reason="RolledBack", message=message,
                          last_transition_time=at, observed_generation=generation)]
    message = f"revision {failed}: 5xx ratio {ratio}. {action.message}"
    return [Condition(type="Degraded", status="True", reason=action.reason, message=message,
                      last_transition_time=at, observed_generation=generation)]
