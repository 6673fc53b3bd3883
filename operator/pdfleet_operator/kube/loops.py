"""Each InferenceDeployment's two background loops: the autoscaler tick and the rollback analysis.

Both run as tasks of the reconciler's memory of the deployment (`DeploymentMemory.autoscaler` /
`.analyzer`), started by the handlers after its first plan and cancelled when it is deleted. Neither writes to
the API itself except Events: what they decide goes through the reconciler's inputs
(`set_desired`, `set_template`, `set_status`), so the reconcile path stays the one writer.

NOTE: tasks of our own rather than @kopf.daemon/@kopf.timer: kopf puts a finalizer on every object a
daemon or timer serves, which costs a write per CR and blocks deleting a CR while the operator is down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import time
from typing import TYPE_CHECKING

import pydantic

from pdfleet_operator.api import InferenceDeployment, parse_duration
from pdfleet_operator.decide import rollback
from pdfleet_operator.kube import alertmanager, client, revisions
from pdfleet_operator.kube.memory import DeploymentMemory
from pdfleet_operator.kube.options import OPTIONS

if TYPE_CHECKING:
    from pdfleet_operator.kube.reconciler import Key, Reconciler

logger = logging.getLogger("pdfleet.operator")


def start(rec: Reconciler, key: Key, m: DeploymentMemory) -> None:
    """Start whichever of the deployment's loops is switched on and not running."""
    loop = asyncio.get_running_loop()
    if rec.autoscaling and (m.autoscaler is None or m.autoscaler.done()):
        m.autoscaler = loop.create_task(autoscale(rec, key))
    if rec.analysis and (m.analyzer is None or m.analyzer.done()):
        m.analyzer = loop.create_task(analyze_periodically(rec, key))


# --- the autoscaler --------------------------------------------------------------------------------------


async def autoscale(rec: Reconciler, key: Key) -> None:
    """One `scaling` tick per spec.autoscaling.interval while the deployment exists."""
    while True:
        body = rec.body(key)
        m = rec.known(key)
        if body is None or m is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            if m is not None:
                m.autoscaler = None
                m.scaler.forget(key)
            return
        delay = 5.0
        try:
            dep = rec.parse(key, body)
        except (pydantic.ValidationError, ValueError):
            dep = None  # the reconcile reports an invalid spec; nothing to scale
        if dep is not None:
            delay = dep.spec.interval_seconds()
            if dep.spec.autoscaling.enabled and (m.scaler.started or not starting(dep)):
                try:
                    await m.scaler.tick(
                        rec, key, dep, body, default_url=OPTIONS.prometheus_url, profile=OPTIONS.metrics_profile
                    )
                except client.ApiError as exc:
                    logger.warning("autoscaler tick of %s/%s failed: %s; next in %ss", *key, exc, delay)
                except Exception:  # NOTE: a bug in one tick must not end the deployment's autoscaling
                    logger.exception("autoscaler tick of %s/%s failed; next in %ss", *key, delay)
        await asyncio.sleep(delay)


def starting(dep: InferenceDeployment) -> bool:
    """A new deployment whose pools have replicas but none ready yet: no worker reports queue metrics.

    NOTE: the autoscaler's first tick waits for that to end; reading metrics earlier finds none and
    would post a MetricsUnavailable warning (and a status write) for every deployment it creates.
    """
    pools = dep.status.pools if dep.status else []
    return not pools or (sum(p.desired for p in pools) > 0 and sum(p.ready for p in pools) == 0)


# --- rollback analysis -------------------------------------------------------------------------------------


async def analyze_periodically(rec: Reconciler, key: Key) -> None:
    """Rollback analysis from Prometheus every OPTIONS.analysis_interval while the deployment exists."""
    while rec.body(key) is not None:
        try:
            await analyze(rec, key, "timer")
        except client.ApiError as exc:
            logger.warning("rollback analysis of %s/%s failed: %s", *key, exc)
        except Exception:  # NOTE: one bad analysis must not end the deployment's protection
            logger.exception("rollback analysis of %s/%s failed", *key)
        await asyncio.sleep(OPTIONS.analysis_interval)
    m = rec.known(key)
    if m is not None:
        m.analyzer = None


async def on_alert(rec: Reconciler, trigger: alertmanager.RollbackTrigger) -> None:
    """A pdfleet rollback alert from Alertmanager: the same analysis, now."""
    rec.rollbacks.triggers.append((asyncio.get_running_loop().time(), trigger))
    key = (trigger.namespace, trigger.deployment)
    if rec.body(key) is None:
        logger.warning("alert about unknown deployment %s/%s ignored", *key)
        return
    await analyze(rec, key, "alertmanager", trigger)


async def analyze(
    rec: Reconciler, key: Key, source: str, trigger: alertmanager.RollbackTrigger | None = None
) -> rollback.RollbackAction | None:
    """One analysis of the served revision; the timer and Alertmanager take turns per deployment.

    NOTE: an analysis awaits Prometheus between reading and storing the revision's health; two
    at once (a timer tick and an alert) would both act on the same health and page or roll back twice.
    """
    async with rec.memory(key).analysis_lock:
        return await _analyze(rec, key, source, trigger)


async def _analyze(
    rec: Reconciler, key: Key, source: str, trigger: alertmanager.RollbackTrigger | None
) -> rollback.RollbackAction | None:
    body = rec.body(key)
    m = rec.memory(key)
    if body is None or m.plan is None:
        return None
    dep = rec.parse(key, body)
    template = m.rollback.template
    served = template.revision if template else (dep.status.current_revision if dep.status else None)
    if served is None:
        return None
    stable = m.extra_status.get("stable_revision") or (dep.status.stable_revision if dep.status else None)
    health = m.rollback.health
    if health is None or health.revision != served:
        health = rollback.health_for(served, time.time(), template is not None, stable, dep.status)
    if trigger is not None and trigger.firing:
        health = rollback.health_from_alert(health, trigger.starts_at, dep.spec.rollback)
    m.rollback = dataclasses.replace(m.rollback, health=health)
    sample = await revisions.sample(dep, OPTIONS.prometheus_url, OPTIONS.metrics_profile, served)
    # NOTE: a window that began before this revision served mixes in the previous one's responses (right
    # after a rollback: the failed revision's 5xx); only a window inside the revision's lifetime counts.
    if sample.time - health.started_at < parse_duration(dep.spec.rollback.window):
        return None
    health, action = rollback.analyze(health, sample, dep.spec.rollback, stable)
    m.rollback = dataclasses.replace(m.rollback, health=health)
    if action.kind == "none":
        return action
    rec.rollbacks.actions.append((asyncio.get_running_loop().time(), key, source, action))
    assert rec.api is not None, "analysis before login"
    record = None
    if action.kind == "rollback" and stable is not None:
        record = rollback.find(await client.list_revisions(rec.api, rec.owner(key, body)), stable)
    acted = rollback.act(
        m.rollback, action, dep, served, stable, record, source, dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    )
    m.rollback = acted.state
    if acted.conditions or acted.fields:
        rec.set_status(
            key,
            conditions=list(acted.conditions),
            why=f"rollback analysis of revision {served} ({source}): {action.kind}",
            **acted.fields,
        )
    if acted.template_changed:
        rec.request(key, f"rollback of revision {served} to {stable} ({source})")
    if acted.notice is not None:
        await rec.api.event(body["metadata"], acted.notice.type, acted.notice.reason, acted.notice.message)
    return action
