"""Revision records in the cluster: ControllerRevisions and the ConfigMap's served revision, and the 5xx sample the
rollback analysis reads from Prometheus; the reconciler and `kube.loops` call it.

Every pod template a deployment has served is a revision. The one served now is recorded on the
ConfigMap (revision label, template hash, `rollback.revision_wire`); once another revision supersedes
it, it is stored as a ControllerRevision the deployment owns (data: the template and the partial
spec it came from), before the ConfigMap is overwritten (`superseded`, `record`). Which revision is
served, and when that changes, is the state machine in `decide.rollback`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdfleet_operator import prometheus
from pdfleet_operator.api import InferenceDeployment, names
from pdfleet_operator.decide import guardrails, reconcile, rollback
from pdfleet_operator.decide.rollback import ANNOTATION_FINGERPRINT, find, number_of
from pdfleet_operator.kube import client, render
from pdfleet_operator.kube.indexes import Key
from pdfleet_operator.kube.options import OPTIONS

logger = logging.getLogger("pdfleet.revisions")


def revision_object(owner: render.Owner, number: int, wire: Mapping[str, Any], template_hash: str) -> dict[str, Any]:
    """The ControllerRevision of revision `number`: its template (`wire`, a `rollback.revision_wire`)."""
    template = rollback.template_of(dict(wire))
    return {
        "apiVersion": "apps/v1",
        "kind": "ControllerRevision",
        "metadata": {
            "name": names.child_name(owner.name, "rev", str(number)),
            "namespace": owner.namespace,
            "labels": render.labels(owner, "revision", revision=number),
            "annotations": {
                render.ANNOTATION_TEMPLATE_HASH: template_hash,
                ANNOTATION_FINGERPRINT: rollback.fingerprint(template),
            },
            "ownerReferences": [owner.reference()],
        },
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


def superseded(
    config_map: Mapping[str, Any] | None, owner: render.Owner, serving: int, stored: list[dict[str, Any]]
) -> dict[str, Any] | None:
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


async def record(
    api: client.Api, revision: dict[str, Any] | None, stored: list[dict[str, Any]], limit: int, keep: set[int]
) -> list[str]:
    """Store a superseded revision (`superseded`), drop older copies of its template (not kept ones) and
    prune beyond the history limit (never one in `keep`: served, stable, failed); the keys written."""
    written = []
    if revision is not None:
        obj = await client.save_revision(api, revision)
        duplicates = [
            r
            for r in stored
            if _template_hash(r) == _template_hash(obj) and number_of(r) not in keep | {number_of(obj)}
        ]
        await client.delete_revisions(api, duplicates)
        written += [client.key_of(obj)] + [client.key_of(r) for r in duplicates]
        stored = [r for r in stored if r not in duplicates] + [obj]
    prune = set(rollback.revisions_to_prune([number_of(r) for r in stored], limit, keep))
    gone = [r for r in stored if number_of(r) in prune]
    await client.delete_revisions(api, gone)
    return written + [client.key_of(r) for r in gone]


async def record_superseded(
    api: client.Api,
    owner: render.Owner,
    obs: reconcile.Observed,
    serving: int,
    stable: int | None,
    failed: rollback.Failed | None,
) -> list[str]:
    """Before a reconcile applies revision `serving`: store the revision served until now (the ConfigMap stops
    describing it) and prune the history. Kept: the served revision, the stable one, and the failed one (after a
    restart it is how the rollback is recognised)."""
    config = next((c for c in obs.children if c["kind"] == "ConfigMap"), None)
    keep = {n for n in (serving, stable, failed.revision if failed is not None else None) if n}
    return await record(
        api,
        superseded(config, owner, serving, list(obs.stored)),
        list(obs.stored),
        obs.dep.spec.rollback.revision_history_limit,
        keep,
    )


def _template_hash(obj: Mapping[str, Any]) -> str | None:
    return (obj["metadata"].get("annotations") or {}).get(names.ANNOTATION_TEMPLATE_HASH)


@dataclass
class AnalysisLog:
    """What the rollback analysis of this process received and did, across deployments (tests and logs)."""

    triggers: list[tuple[float, Any]] = field(default_factory=list)  # (monotonic time, RollbackTrigger) received
    actions: list[tuple[float, Key, str, rollback.RollbackAction]] = field(
        default_factory=list
    )  # (time, key, source, action)


async def sample(
    dep: InferenceDeployment, default_url: str | None, profile: str, revision: int | None = None
) -> rollback.RatioSample:
    """The 5xx ratio of the deployment's router over the rollback window (missing -> held, never healthy):
    of `revision` (its workers' answers and those no worker gave, shedding excluded) where the router says."""
    now = time.time()
    url = dep.spec.autoscaling.prometheus_url or default_url
    if not url:
        return rollback.RatioSample(
            now, None, None, "no Prometheus URL (spec.autoscaling.prometheusUrl / --prometheus-url)"
        )
    refused = guardrails.prometheus_url_problem(url, default_url, OPTIONS.prometheus_allowed)
    if refused:
        return rollback.RatioSample(now, None, None, refused)
    source = prometheus.prometheus_for(url, profile, OPTIONS.prometheus_verify)
    assert dep.metadata.name and dep.metadata.namespace
    requests, errors, why = await asyncio.to_thread(
        source.router_requests, dep.metadata.name, dep.metadata.namespace, dep.spec.rollback.window, revision
    )
    return rollback.RatioSample(now, requests, errors, why)
