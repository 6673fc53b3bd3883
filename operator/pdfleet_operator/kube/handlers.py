"""kopf handlers: thin triggers into one reconcile path per InferenceDeployment (run by `pdfleet operator`).

Every trigger (the CR's create/update/resume, an AcceleratorClass or Node change, a child edited by
hand, a freed accelerator, the periodic resync, the autoscaler or rollback asking for a new size or
revision) ends in `Reconciler.reconcile(key, why)`: gather (indexes + children) -> plan -> render ->
apply what differs -> status and Events if something changed. Runs of one key never overlap and
requests arriving during a run fold into one more run.

NOTE: kopf's own bookkeeping (last-handled configuration, handler progress) is kept in memory, not
in annotations: it would cost a write per change on every CR. After a restart every CR is "created"
again, which runs the same idempotent reconcile; kopf still writes its touch annotation to retry a
handler that raised TemporaryError.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import hashlib
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

import kopf
import pydantic
from aiohttp import web

from pdfleet_operator.kube import alertmanager, class_status, exporter, client, render, revisions, scaling
from pdfleet_operator.decide import cost, handover, inventory, placement, rollback, status
from pdfleet_operator.api import (
    AcceleratorClass,
    AcceleratorClassSpec,
    Condition,
    InferenceDeployment,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    parse_duration,
    set_condition,
)

GROUP, VERSION = "pdfleet.io", "v1alpha1"
logger = logging.getLogger("pdfleet.operator")
# How long the first reconcile of a process waits for kopf's class and node indexes to be complete.
INDEX_SYNC_TIMEOUT_S = 10.0
Key = tuple[str, str]  # (namespace, name)
MANAGED = {"app.kubernetes.io/managed-by": render.MANAGER}
RETRY_DELAYS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


@dataclasses.dataclass
class Options:
    """Set by `pdfleet operator` before kopf starts."""

    resync_interval: float = 300.0  # seconds between full re-reconciles (0: never)
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = None
    monitoring_check_interval: float = 300.0
    autoscaler: bool = True            # run the autoscaler loops (tests of the reconcile alone switch them off)
    prometheus_url: str | None = None  # the autoscaler's Prometheus when a spec names none
    metrics_profile: str = "pdfleet"   # metric_names.PROFILES: the PromQL of the engine kind
    analysis_interval: float = 15.0    # seconds between rollback analyses from Prometheus (0: only on alerts)
    alertmanager_host: str = "0.0.0.0"
    alertmanager_port: int | None = None  # the Alertmanager webhook receiver (POST /alerts)
    class_status_interval: float = 15.0   # seconds between AcceleratorClass status rounds (0: never written)


OPTIONS = Options()


# --- kopf's state in memory --------------------------------------------------------------------------

class MemoryDiffBaseStorage(kopf.DiffBaseStorage):
    """Last-handled essence per object uid, in this process only."""

    def __init__(self) -> None:
        super().__init__()
        self._essences: dict[str, Any] = {}

    def fetch(self, *, body: kopf.Body) -> Any:
        return self._essences.get(body.metadata.uid)

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: Any) -> None:
        self._essences[body.metadata.uid] = essence


class MemoryProgressStorage(kopf.AnnotationsProgressStorage):
    """Handler progress per object uid in memory; `touch` (inherited) still wakes kopf up for retries."""

    def __init__(self) -> None:
        super().__init__(prefix="pdfleet.io")
        self._records: dict[tuple[str, str], Any] = {}

    def fetch(self, *, key: Any, body: kopf.Body) -> Any:
        return self._records.get((body.metadata.uid, str(key)))

    def store(self, *, key: Any, record: Any, body: kopf.Body, patch: kopf.Patch) -> None:
        self._records[(body.metadata.uid, str(key))] = dict(record)

    def purge(self, *, key: Any, body: kopf.Body, patch: kopf.Patch) -> None:
        self._records.pop((body.metadata.uid, str(key)), None)


# --- the reconcile path --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Template:
    """Which revision's pod template to serve (set by rollback); the spec is that revision's spec."""

    revision: int
    spec: InferenceDeploymentSpec


@dataclasses.dataclass
class Outcome:
    """What one reconcile did (returned to handlers and tests)."""

    writes: int = 0
    plan: placement.FleetPlan | None = None
    result: client.ApplyResult | None = None
    status_written: bool = False
    skipped: str = ""


class Reconciler:
    """The state the handlers share: indexes, the API client, per-key inputs from the autoscaler and rollback."""

    def __init__(self) -> None:
        self.api: client.Api | None = None
        self.indexes: dict[str, Any] = {}
        self._locks: dict[Key, asyncio.Lock] = {}
        self._wanted: dict[Key, int] = {}
        self._done: dict[Key, int] = {}
        self._tasks: set[asyncio.Task] = set()
        self._retries: dict[Key, int] = {}
        self._synced: asyncio.Task | None = None  # the one-time wait for kopf's indexes (see _await_indexes)
        self._analysis_locks: dict[Key, asyncio.Lock] = {}
        # Inputs other pieces feed in (issue 6: desired replicas; issue 7: the revision to serve).
        self.desired: dict[Key, dict[str, int]] = {}
        self.templates: dict[Key, Template] = {}
        self.extra_conditions: dict[Key, dict[str, Condition]] = {}
        self.extra_status: dict[Key, dict[str, Any]] = {}
        # What this process last saw or wrote.
        self.limited: set[Key] = set()
        self.node_digests: dict[str, str] = {}
        self.class_specs: dict[str, dict[str, Any]] = {}
        self._last_status: dict[Key, tuple[dict[str, Any], str | None, str | None]] = {}
        self._monitoring: tuple[float, bool] | None = None
        # key -> child -> digest of what we rendered last: an apply of an unchanged rendering is a revert.
        self._rendered: dict[Key, dict[str, str]] = {}
        self._targets: dict[Key, dict[str, int]] = {}  # replicas per role this process last planned for
        self._specs: dict[Key, tuple[tuple[Any, Any], InferenceDeployment]] = {}
        self.plans: dict[Key, placement.FleetPlan] = {}  # the last plan per deployment
        self.reconciles = 0
        self.loop: asyncio.AbstractEventLoop | None = None  # kopf's loop: other threads call in through it
        self.scaler = scaling.Scaler()
        self.autoscaling = False  # start autoscaler loops (set at kopf startup from OPTIONS.autoscaler)
        self._autoscalers: dict[Key, asyncio.Task] = {}
        self.rollbacks = revisions.Analysis()
        self.analysis = False  # start rollback-analysis timers (set at kopf startup from OPTIONS.analysis_interval)
        self._analyzers: dict[Key, asyncio.Task] = {}

    # --- inputs from the autoscaler and rollback --------------------------------------------------------
    def set_desired(self, key: Key, replicas: Mapping[str, int], why: str = "autoscaler") -> None:
        """Total replicas per role to plan for; placement caps them at capacity (-> ScalingLimited)."""
        self.desired[key] = dict(replicas)
        self.request(key, why)

    def set_template(self, key: Key, template: Template | None, why: str = "rollback") -> None:
        """Serve `template` (a stored revision) instead of the current spec; None goes back to the spec."""
        if template is None:
            self.templates.pop(key, None)
        else:
            self.templates[key] = template
        self.request(key, why)

    def set_status(self, key: Key, *, conditions: list[Condition] = (), why: str = "", **fields: Any) -> None:
        """Conditions (MetricsAvailable, RolledBack, ...) and status fields (lastScalingDecision,
        stableRevision, failedRevision) written with the next status update; no second status writer."""
        self.extra_conditions.setdefault(key, {}).update({c.type: c for c in conditions})
        self.extra_status.setdefault(key, {}).update(fields)
        self.request(key, why or "status update")

    def clear_condition(self, key: Key, type_: str) -> None:
        """Stop overriding a condition the reconcile computes itself (it takes effect with the next status update)."""
        self.extra_conditions.get(key, {}).pop(type_, None)

    def current_replicas(self, key: Key) -> dict[str, int]:
        """Per role, the replicas the last plan runs ({} before the first plan)."""
        plan = self.plans.get(key)
        return {} if plan is None else {role: plan.replicas(role) for role in plan.roles()}

    def class_order(self, key: Key) -> dict[str, tuple[tuple[str, int], ...]]:
        """Per role, (class, most replicas placeable on it) in the order placement fills them, as of the last plan."""
        plan = self.plans.get(key)
        return {} if plan is None else {role: plan.class_capacity(role) for role in plan.roles()}

    def capacity(self, key: Key) -> dict[str, int]:
        """Per role, the most replicas placeable on free capacity as of the last plan (for the autoscaler)."""
        plan = self.plans.get(key)
        return {} if plan is None else {role: plan.capacity(role) for role in plan.roles()}

    # --- triggering ---------------------------------------------------------------------------------------
    def request(self, key: Key, why: str) -> None:
        """Reconcile `key` soon, in the background (coalesced with runs already queued)."""
        task = asyncio.get_running_loop().create_task(self._background(key, why))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _background(self, key: Key, why: str) -> None:
        try:
            await self.reconcile(key, why)
            self._retries.pop(key, None)
        except client.ApiError as exc:
            attempt = self._retries.get(key, 0)
            self._retries[key] = attempt + 1
            delay = RETRY_DELAYS[min(attempt, len(RETRY_DELAYS) - 1)]
            logger.warning("reconcile of %s/%s (%s) failed: %s; retrying in %ss", *key, why, exc, delay)
            await asyncio.sleep(delay)
            self.request(key, why)
        except (pydantic.ValidationError, ValueError) as exc:
            logger.error("reconcile of %s/%s (%s) failed: %s", *key, why, exc)
            exporter.RECONCILES.labels("error").inc()

    # --- the autoscaler and rollback-analysis loops of each deployment ------------------------------------
    # NOTE: a task of our own rather than @kopf.daemon/@kopf.timer: kopf puts a finalizer on every object a
    # daemon or timer serves, which costs a write per CR and blocks deleting a CR while the operator is down.
    def _start_loops(self, key: Key) -> None:
        task = self._autoscalers.get(key)
        if self.autoscaling and (task is None or task.done()):
            self._autoscalers[key] = asyncio.get_running_loop().create_task(self._autoscale(key))
        task = self._analyzers.get(key)
        if self.analysis and (task is None or task.done()):
            self._analyzers[key] = asyncio.get_running_loop().create_task(self._analysis_loop(key))

    def stop_loops(self, key: Key) -> None:
        for tasks in (self._autoscalers, self._analyzers):
            task = tasks.pop(key, None)
            if task is not None:
                task.cancel()
        self.scaler.forget(key)
        self.rollbacks.forget(key)

    async def _analysis_loop(self, key: Key) -> None:
        """Rollback analysis from Prometheus every OPTIONS.analysis_interval while the deployment exists."""
        while key in self._bodies():
            try:
                await self.analyze_rollback(key, "timer")
            except client.ApiError as exc:
                logger.warning("rollback analysis of %s/%s failed: %s", *key, exc)
            except Exception:  # NOTE: one bad analysis must not end the deployment's protection
                logger.exception("rollback analysis of %s/%s failed", *key)
            await asyncio.sleep(OPTIONS.analysis_interval)
        self._analyzers.pop(key, None)

    async def on_alert(self, trigger: alertmanager.RollbackTrigger) -> None:
        """A pdfleet rollback alert from Alertmanager: the same analysis, now."""
        self.rollbacks.triggers.append((asyncio.get_running_loop().time(), trigger))
        key = (trigger.namespace, trigger.deployment)
        if key not in self._bodies():
            logger.warning("alert about unknown deployment %s/%s ignored", *key)
            return
        await self.analyze_rollback(key, "alertmanager", trigger)

    async def analyze_rollback(self, key: Key, source: str, trigger: alertmanager.RollbackTrigger | None = None
                               ) -> rollback.RollbackAction | None:
        """One analysis of the served revision; the timer and Alertmanager take turns per deployment.

        NOTE: an analysis awaits Prometheus between reading and storing the revision's health; two
        at once (a timer tick and an alert) would both act on the same health and page or roll back twice.
        """
        async with self._analysis_locks.setdefault(key, asyncio.Lock()):
            return await self._analyze_rollback(key, source, trigger)

    async def _analyze_rollback(self, key: Key, source: str, trigger: alertmanager.RollbackTrigger | None
                                ) -> rollback.RollbackAction | None:
        body = self._bodies().get(key)
        if body is None or key not in self.plans:
            return None
        dep = self._parse(key, body)
        template = self.templates.get(key)
        served = template.revision if template else (dep.status.current_revision if dep.status else None)
        if served is None:
            return None
        stable = self.extra_status.get(key, {}).get("stable_revision") or (dep.status.stable_revision if dep.status else None)
        health = self.rollbacks.health.get(key)
        if health is None or health.revision != served:
            health = revisions.health_for(served, time.time(), template is not None, stable, dep.status)
        if trigger is not None and trigger.firing:
            health = rollback.health_from_alert(health, trigger.starts_at, dep.spec.rollback)
        self.rollbacks.health[key] = health
        sample = await revisions.sample(dep, OPTIONS.prometheus_url, OPTIONS.metrics_profile)
        # NOTE: a window that began before this revision served mixes in the previous one's responses (right
        # after a rollback: the failed revision's 5xx); only a window inside the revision's lifetime counts.
        if sample.time - health.started_at < parse_duration(dep.spec.rollback.window):
            return None
        health, action = rollback.analyze(health, sample, dep.spec.rollback, stable)
        self.rollbacks.health[key] = health
        if action.kind == "none":
            return action
        self.rollbacks.actions.append((asyncio.get_running_loop().time(), key, source, action))
        assert self.api is not None, "analysis before login"
        involved = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": body["metadata"]}
        generation = dep.metadata.generation
        if action.kind == "mark_stable":
            self.set_status(key, stable_revision=served, why=f"revision {served} stable")
            await self.api.event(involved, "Normal", action.reason, action.message)
        elif action.kind == "rollback":
            assert stable is not None
            stored = revisions.find(await client.list_revisions(self.api, self._owner(key, body)), stable)
            if stored is None:
                action = rollback.RollbackAction("page", "RollbackFailed", f"stable revision {stable} is not stored "
                                                 f"(pruned or deleted); {action.message}", action.ratio)
            else:
                self.rollbacks.failed[key] = revisions.Failed(
                    served, generation, rollback.fingerprint(rollback.template_spec(dep.spec)))
                self.set_status(key, conditions=revisions.conditions_for(action, served, stable, generation),
                                failed_revision=served, why=f"rollback of revision {served} ({source})")
                self.set_template(key, Template(stable, revisions.spec_for_rollback(stored, dep.spec)),
                                  why=f"rollback of revision {served} to {stable} ({source})")
                await self.api.event(involved, "Warning", "RolledBack",
                                     f"revision {served} rolled back to {stable} ({source}): {action.message}")
        if action.kind == "page":
            self.set_status(key, conditions=revisions.conditions_for(action, served, stable, generation),
                            why=f"rollback failed ({source})")
            await self.api.event(involved, "Warning", action.reason, action.message)
        return action

    def _owner(self, key: Key, body: Mapping[str, Any]) -> render.Owner:
        return render.Owner(key[1], key[0], body["metadata"]["uid"])

    async def _autoscale(self, key: Key) -> None:
        """One `scaling` tick per spec.autoscaling.interval while the deployment exists."""
        while True:
            body = self._bodies().get(key)
            if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
                self._autoscalers.pop(key, None)
                self.scaler.forget(key)
                return
            delay = 5.0
            try:
                dep = self._parse(key, body)
            except (pydantic.ValidationError, ValueError):
                dep = None  # the reconcile reports an invalid spec; nothing to scale
            if dep is not None:
                delay = dep.spec.interval_seconds()
                if dep.spec.autoscaling.enabled and (key in self.scaler.memory or not _starting(dep)):
                    try:
                        await self.scaler.tick(self, key, dep, body, default_url=OPTIONS.prometheus_url,
                                               profile=OPTIONS.metrics_profile)
                    except client.ApiError as exc:
                        logger.warning("autoscaler tick of %s/%s failed: %s; next in %ss", *key, exc, delay)
                    except Exception:  # NOTE: a bug in one tick must not end the deployment's autoscaling
                        logger.exception("autoscaler tick of %s/%s failed; next in %ss", *key, delay)
            await asyncio.sleep(delay)

    async def drain(self) -> None:
        """Wait for background reconciles (tests and shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def keys_using(self, class_names: set[str]) -> list[Key]:
        out = []
        for key, body in self._bodies().items():
            spec = body.get("spec") or {}
            listed = {c for role in ("prefill", "decode", "colocated") for c in (spec.get(role) or {}).get("acceleratorClasses", [])}
            if listed & class_names:
                out.append(key)
        return sorted(out)

    # --- gathering ----------------------------------------------------------------------------------------
    def _bodies(self) -> dict[Key, dict[str, Any]]:
        index = self.indexes.get("infdep_index")
        if index is None:
            return {}
        return {key: next(iter(store)) for key, store in index.items()}

    def _classes(self) -> dict[str, AcceleratorClassSpec]:
        index = self.indexes.get("class_index") or {}
        return {name: next(iter(store)) for name, store in index.items()}

    def _inventory(self, key: Key) -> inventory.Inventory:
        nodes = [next(iter(s)) for s in (self.indexes.get("node_index") or {}).values()]
        pods = [p for s in (self.indexes.get("pod_index") or {}).values() for p in s]
        return inventory.build(nodes, pods, exclude_deployment=key)

    async def _monitoring_enabled(self) -> bool:
        assert self.api is not None
        now = asyncio.get_running_loop().time()
        if self._monitoring is None or now - self._monitoring[0] > OPTIONS.monitoring_check_interval:
            self._monitoring = (now, await self.api.has_group("monitoring.coreos.com/v1"))
        return self._monitoring[1]

    # --- the reconcile --------------------------------------------------------------------------------------
    async def reconcile(self, key: Key, why: str, *, body: Mapping[str, Any] | None = None) -> Outcome:
        ticket = self._wanted[key] = self._wanted.get(key, 0) + 1
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            if self._done.get(key, 0) >= ticket:
                return Outcome(skipped="covered by a later run")
            started = self._wanted[key]
            try:
                outcome = await self._reconcile(key, why, body)
            except Exception:
                exporter.RECONCILES.labels("error").inc()
                raise
            self._done[key] = started
            exporter.RECONCILES.labels("ok" if not outcome.skipped else "skipped").inc()
            self.reconciles += 1
            if outcome.plan is not None:
                self._start_loops(key)
            return outcome

    async def _await_indexes(self, api: client.Api) -> None:
        """Once per process: wait until kopf's class and node indexes hold what the API lists.

        NOTE: kopf fills its indexes from watch streams while handlers (class and node events at
        start-up among them) already run. A plan made before every AcceleratorClass and Node is
        indexed sees less capacity or a missing class and would move or delete serving pools, so the
        first reconcile of a process waits (up to INDEX_SYNC_TIMEOUT_S) for both to be complete.
        """
        if self._synced is None:
            self._synced = asyncio.get_running_loop().create_task(self._sync_indexes(api))
        try:
            await asyncio.shield(self._synced)
        except client.ApiError:
            self._synced = None  # the API was unreachable: the next reconcile lists again
            raise

    async def _sync_indexes(self, api: client.Api) -> None:
        listed = {"class_index": {c["metadata"]["name"] for c in await api.list("AcceleratorClass", None)},
                  "node_index": {n["metadata"]["name"] for n in await api.list("Node", None)}}
        deadline = asyncio.get_running_loop().time() + INDEX_SYNC_TIMEOUT_S
        while True:
            missing = {name: sorted(want - set(self.indexes.get(name) or {})) for name, want in listed.items()}
            if not any(missing.values()):
                return
            if asyncio.get_running_loop().time() > deadline:
                logger.warning("planning with incomplete indexes after %ss: %s", INDEX_SYNC_TIMEOUT_S, missing)
                return
            await asyncio.sleep(0.05)

    async def _reconcile(self, key: Key, why: str, given: Mapping[str, Any] | None) -> Outcome:
        api = self.api
        assert api is not None, "reconcile before login"
        # NOTE: the index may hold a newer body than the handler's (our status writes come back through
        # it); the generation decides which spec is newer, the index wins ties.
        indexed = self._bodies().get(key)
        body = indexed if indexed is not None else given
        if given is not None and indexed is not None and \
                (given.get("metadata") or {}).get("generation", 0) > (indexed.get("metadata") or {}).get("generation", 0):
            body = given
        if body is None:
            return Outcome(skipped="gone")
        meta = body.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            return Outcome(skipped="being deleted")
        dep = self._parse(key, body)
        await self._await_indexes(api)
        owner = render.Owner(dep.name, key[0], meta["uid"])
        classes = self._classes()
        monitoring = await self._monitoring_enabled()
        kinds = client.CHILD_KINDS + (("PodMonitor", "PrometheusRule") if monitoring else ())
        children = await client.list_children(api, owner, kinds)

        stored = await client.list_revisions(api, owner)
        config = next((c for c in children if c["kind"] == "ConfigMap"), None)
        if key not in self.rollbacks.resumed:
            self._resume(key, dep, stored, revisions.served_record(config, owner))
        if self.rollbacks.spec_moved_on(key, dep):
            self._roll_forward(key, dep)
        template = self.templates.get(key)
        spec_revision = revisions.number_for(dep.spec, stored, revisions.running_revisions(children),
                                             dep.status.current_revision if dep.status and dep.status.current_revision else 1)
        wanted = (meta.get("annotations") or {}).get(revisions.ANNOTATION_ROLLBACK_TO)
        if wanted is not None and self.rollbacks.manual.get(key) != meta.get("resourceVersion"):
            # (once per version of the object: the index may still show the annotation we just removed)
            self.rollbacks.manual[key] = meta.get("resourceVersion")
            template = await self._manual_rollback(api, key, dep, body, wanted, stored, spec_revision) \
                or template
        if key in self.rollbacks.held:
            if template is None:
                return await self._hold(api, key, dep, body)
            self.rollbacks.held.pop(key)  # a rollback by hand named a stored revision
        spec = template.spec if template else dep.spec
        revision = template.revision if template else spec_revision
        desired = self._desired_for(key, dep.spec, spec, children)
        plan = placement.plan(spec, classes, self._inventory(key), desired)
        self._targets[key] = dict(plan.targets)
        self.plans[key] = plan
        objects = render.render(owner, spec, plan, classes, revision=revision, monitoring=monitoring)
        writes_before = api.writes
        stable = self.extra_status.get(key, {}).get("stable_revision") or (
            dep.status.stable_revision if dep.status else None)
        # Kept: the served revision, the stable one, and the failed one (after a restart it is how the rollback
        # is recognised). The revision served until now is stored before the ConfigMap stops describing it.
        keep = {n for n in (revision, stable, getattr(self.rollbacks.failed.get(key), "revision", None)) if n}
        for k in await revisions.record(api, revisions.superseded(config, owner, revision, stored), stored,
                                        dep.spec.rollback.revision_history_limit, keep):
            exporter.API_WRITES.labels(k.split("/")[0]).inc()
        result = await client.apply_children(api, owner, objects, children)
        rendered = {client.key_of(o): _digest(o) for o in objects}
        last_rendered = self._rendered.get(key, {})
        result.drifted = {k: v for k, v in result.drifted.items() if last_rendered.get(k) == rendered[k]}
        self._rendered[key] = rendered
        for k in result.applied + result.created + result.deleted:
            exporter.API_WRITES.labels(k.split("/")[0]).inc()

        router_cpu = cost.router_cores(spec.router.resources.requests)
        plan_cost = cost.plan_cost(plan, classes, router_replicas=spec.router.replicas, router_cpu=router_cpu)
        ready = {c["metadata"]["name"]: int((c.get("status") or {}).get("readyReplicas") or 0)
                 for c in children if c["kind"] == "Deployment"}
        observed = status.Observed(ready=ready, router_ready=ready.get(render.router_name(dep.name), 0),
                                   problems=tuple(result.problems), retained=_retained(result, children))
        previous = dep.status
        last = self._last_status.get(key)
        if last is not None and meta.get("resourceVersion") == last[1]:
            # The index has not caught up with our last status write yet: that write is the previous status.
            previous = InferenceDeploymentStatus.model_validate(last[0])
        new = status.compute(name=dep.name, namespace=key[0], plan=plan, cost=plan_cost, observed=observed,
                             previous=previous, generation=dep.metadata.generation, revision=revision,
                             router_replicas=spec.router.replicas, now=dt.datetime.now(dt.timezone.utc).replace(microsecond=0),
                             extra_conditions=list(self.extra_conditions.get(key, {}).values()))
        if self.extra_status.get(key):
            new = new.model_copy(update=self.extra_status[key])
        new_wire = new.wire()
        old_wire = previous.wire() if previous else {}
        written = False
        if new_wire != old_wire:
            patched = await api.patch_status(key[0], dep.name, new_wire)
            self._last_status[key] = (new_wire, meta.get("resourceVersion"), (patched.get("metadata") or {}).get("resourceVersion"))
            exporter.API_WRITES.labels("InferenceDeployment/status").inc()
            written = True

        await self._events(api, body, why, previous, new, plan, result)
        if plan.shortfalls:
            self.limited.add(key)
        else:
            self.limited.discard(key)
        exporter.set_pools(key[0], dep.name, ((p.role, p.accelerator_class, p.replicas, plan_cost.of(p.role, p.accelerator_class))
                                              for p in plan.pools),
                           parse_duration(spec.slo.ttft), parse_duration(spec.slo.itl))
        return Outcome(writes=api.writes - writes_before, plan=plan, result=result, status_written=written)

    def _resume(self, key: Key, dep: InferenceDeployment, stored: list[dict[str, Any]],
                serving: dict[str, Any] | None) -> None:
        """Once per key and process: take over a rollback a previous process left in force (see `revisions.resume`),
        so that a restart never re-applies the failed revision while the spec is unchanged."""
        self.rollbacks.resumed.add(key)
        resumed = revisions.resume(dep.status, dep.metadata.generation, dep.spec, stored, serving)
        if resumed.kind == "spec":
            return
        assert resumed.failed is not None, resumed
        logger.info("%s/%s: rollback of revision %s taken over from the status: %s", *key, resumed.failed.revision,
                    resumed.kind)
        self.rollbacks.failed[key] = resumed.failed
        if resumed.kind == "stored":
            assert resumed.template is not None and resumed.spec is not None, resumed
            self.templates[key] = Template(resumed.template, resumed.spec)
        elif resumed.kind == "hold":
            self.rollbacks.held[key] = resumed.message
        # "roll_forward": the failed revision is remembered only for spec_moved_on to end the rollback now.

    def _roll_forward(self, key: Key, dep: InferenceDeployment) -> None:
        """A new generation with another template ends the rollback: serve the spec again."""
        self.templates.pop(key, None)
        self.rollbacks.held.pop(key, None)
        failed = self.rollbacks.failed.pop(key)
        self.clear_condition(key, "Degraded")
        self.extra_conditions.setdefault(key, {})["RolledBack"] = Condition(
            type="RolledBack", status="False", reason="RolledForward",
            message=f"the spec changed after revision {failed.revision} was rolled back",
            last_transition_time=dt.datetime.now(dt.timezone.utc).replace(microsecond=0),
            observed_generation=dep.metadata.generation)

    async def _hold(self, api: client.Api, key: Key, dep: InferenceDeployment, body: Mapping[str, Any]) -> Outcome:
        """The revision a rollback serves cannot be rendered: touch no pool (the spec is the failed revision), page once.

        NOTE: the page is said once per cluster, not per process: a Degraded condition already saying it
        means an earlier process posted the Event too.
        """
        message = self.rollbacks.held[key]
        now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
        page = Condition(type="Degraded", status="True", reason=revisions.REASON_REVISION_MISSING, message=message,
                         last_transition_time=now, observed_generation=dep.metadata.generation)
        said = _condition(dep.status, "Degraded")
        if said is not None and (said.status, said.reason, said.message) == (page.status, page.reason, page.message):
            return Outcome(skipped="held: " + message)
        previous = dep.status or InferenceDeploymentStatus()
        new = previous.model_copy(update={"conditions": set_condition(list(previous.conditions), page)})
        await api.patch_status(key[0], dep.name, new.wire())
        exporter.API_WRITES.labels("InferenceDeployment/status").inc()
        involved = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": body["metadata"]}
        await api.event(involved, "Warning", revisions.REASON_REVISION_MISSING, message)
        logger.error("%s/%s: %s", *key, message)
        return Outcome(skipped="held: " + message, status_written=True)

    async def _manual_rollback(self, api: client.Api, key: Key, dep: InferenceDeployment, body: Mapping[str, Any],
                               wanted: str, stored: list[dict[str, Any]], spec_revision: int) -> Template | None:
        """`kubectl annotate infdep X pdfleet.io/rollback-to=N`: serve revision N until the spec changes again.

        The annotation is a one-shot command: removed once acted on (or rejected with a Warning Event), so a
        restart or a later spec change does not roll back again.
        """
        involved = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": body["metadata"]}
        target = revisions.find(stored, int(wanted)) if wanted.isdigit() else None
        await api.remove_annotation("InferenceDeployment", key[0], key[1], revisions.ANNOTATION_ROLLBACK_TO)
        if target is None:
            known = ", ".join(str(revisions.number_of(r)) for r in stored) or "none"
            serving = self.templates[key].revision if key in self.templates else spec_revision
            await api.event(involved, "Warning", "RollbackRejected",
                            f"{revisions.ANNOTATION_ROLLBACK_TO}={wanted!r} names no stored revision (stored: {known}; "
                            f"serving: {serving})")
            return None
        number = revisions.number_of(target)
        current = self.templates[key].revision if key in self.templates else spec_revision
        template = Template(number, revisions.spec_for_rollback(target, dep.spec))
        self.templates[key] = template
        # What is not re-applied until the spec changes is the spec's own revision (status.failedRevision, which
        # a restart reads back), whichever revision was being served.
        self.rollbacks.failed[key] = revisions.Failed(spec_revision, dep.metadata.generation,
                                                      rollback.fingerprint(rollback.template_spec(dep.spec)))
        self.extra_status.setdefault(key, {})["failed_revision"] = spec_revision
        message = f"revision {current} rolled back to {number} by hand ({revisions.ANNOTATION_ROLLBACK_TO})"
        self.extra_conditions.setdefault(key, {})["RolledBack"] = Condition(
            type="RolledBack", status="True", reason="ManualRollback", message=message,
            last_transition_time=dt.datetime.now(dt.timezone.utc).replace(microsecond=0),
            observed_generation=dep.metadata.generation)
        await api.event(involved, "Normal", "RolledBack", message)
        return template

    def _parse(self, key: Key, body: Mapping[str, Any]) -> InferenceDeployment:
        """The CR as the API model; the spec (whose CEL rules are slow to evaluate) once per generation."""
        meta = body.get("metadata") or {}
        version = (meta.get("uid"), meta.get("generation"))
        cached = self._specs.get(key)
        if cached is None or cached[0] != version:
            dep = InferenceDeployment.model_validate({
                "apiVersion": body.get("apiVersion", f"{GROUP}/{VERSION}"), "kind": "InferenceDeployment",
                "metadata": {k: meta.get(k) for k in ("name", "namespace", "uid", "generation") if meta.get(k) is not None},
                "spec": body.get("spec") or {}})
            self._specs[key] = cached = (version, dep)
        st = InferenceDeploymentStatus.model_validate(body["status"]) if body.get("status") else None
        return cached[1].model_copy(update={"status": st})

    def _desired_for(self, key: Key, current: InferenceDeploymentSpec, spec: InferenceDeploymentSpec,
                     children: list[dict[str, Any]]) -> dict[str, int] | None:
        """The autoscaler's latest ask; else what this process planned last (a hand-scaled pool is reverted);
        else, right after a restart, the sizes the pools run, so a restart never resets what the
        autoscaler had decided; else each role's minimum."""
        roles = spec.roles()
        if not current.autoscaling.enabled:
            return None
        for source in (self.desired, self._targets):
            if key in source:
                return {r: n for r, n in source[key].items() if r in roles}
        running: dict[str, int] = {}
        for c in children:
            role = (c["metadata"].get("labels") or {}).get(render.LABEL_ROLE)
            if c["kind"] == "Deployment" and role in roles:
                running[role] = running.get(role, 0) + int((c.get("spec") or {}).get("replicas") or 0)
        return running or None

    async def _events(self, api: client.Api, body: Mapping[str, Any], why: str, previous: Any, new: Any,
                      plan: placement.FleetPlan, result: client.ApplyResult) -> None:
        involved = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": body["metadata"]}

        def pools(st: Any) -> list[tuple[str, str, int]]:
            return [(p.role, p.accelerator_class, p.desired) for p in (st.pools if st else [])]

        before, after = pools(previous), pools(new)
        old_cost = previous.cost_per_hour if previous else None
        if before != after or (old_cost is not None and old_cost != new.cost_per_hour):
            desc = ", ".join(f"{r} {n}x{a}" for r, a, n in after) or "no pools"
            reason = "Planned" if previous is None or not previous.pools else "Replanned"
            kept = "".join(f"; {k.split('/', 1)[1]} kept {w}" for k, w in sorted(result.retained.items()))
            await api.event(involved, "Normal", reason,
                            f"{why}: {desc}, ${new.cost_per_hour:.2f}/h, P:D {new.pd_ratio}{kept}")
        retired = [k.split("/", 1)[1] for k in result.deleted if k.startswith("Deployment/")]
        if retired and before == after:
            await api.event(involved, "Normal", "PoolRetired", f"deleted {', '.join(retired)}: the pools that "
                            f"replace {'it' if len(retired) == 1 else 'them'} are ready ({why})")
        if result.drifted:
            await api.event(involved, "Normal", "DriftReverted", "; ".join(
                f"{k} ({', '.join(v[:4])})" for k, v in result.drifted.items()) + f" ({why})")
        limited_before = _condition(previous, "ScalingLimited")
        limited_now = _condition(new, "ScalingLimited")
        if limited_now and limited_now.status == "True" and (limited_before is None or limited_before.message != limited_now.message):
            await api.event(involved, "Warning", "ScalingLimited", limited_now.message)
        if result.problems:
            await api.event(involved, "Warning", "ApplyFailed", "; ".join(result.problems))


def _retained(result: client.ApplyResult, children: list[dict[str, Any]]) -> tuple[tuple[str, str, int, str], ...]:
    """The pools `apply_children` kept serving while their role's new pools start, for the status."""
    by_key = {client.key_of(c): c for c in children}
    return tuple((by_key[k]["metadata"]["name"], by_key[k]["metadata"]["labels"][render.LABEL_ROLE],
                  handover.ready_replicas(by_key[k]), why) for k, why in sorted(result.retained.items()))


def _starting(dep: InferenceDeployment) -> bool:
    """A new deployment whose pools have replicas but none ready yet: no worker reports queue metrics.

    NOTE: the autoscaler's first tick waits for that to end; reading metrics earlier finds none and
    would post a MetricsUnavailable warning (and a status write) for every deployment it creates.
    """
    pools = dep.status.pools if dep.status else []
    return not pools or (sum(p.desired for p in pools) > 0 and sum(p.ready for p in pools) == 0)


def _condition(st: Any, type_: str) -> Condition | None:
    return next((c for c in (st.conditions if st else []) if c.type == type_), None)


RECONCILER = Reconciler()


# --- kopf wiring -----------------------------------------------------------------------------------------

@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    RECONCILER.loop = asyncio.get_running_loop()
    settings.persistence.diffbase_storage = MemoryDiffBaseStorage()
    settings.persistence.progress_storage = MemoryProgressStorage()
    settings.persistence.finalizer = "pdfleet.io/finalizer"
    # Events are posted by client.event for decisions only; kopf's per-handler chatter stays in the log.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # NOTE: no worker limit: kopf keeps one worker per object alive for idle_timeout after its last
    # event, so a limit of W caps throughput at W objects per idle_timeout (64 per 5 s was the
    # bottleneck of bench/operator.py). Workers are asyncio tasks; a shorter idle time frees them sooner.
    settings.queueing.idle_timeout = 1.0
    RECONCILER.autoscaling = OPTIONS.autoscaler
    RECONCILER.analysis = OPTIONS.analysis_interval > 0
    if OPTIONS.alertmanager_port is not None:
        runner = web.AppRunner(alertmanager.make_app(RECONCILER.on_alert), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, OPTIONS.alertmanager_host, OPTIONS.alertmanager_port).start()
        RECONCILER.indexes["_alertmanager_runner"] = runner
    if OPTIONS.metrics_port is not None:
        RECONCILER.indexes["_metrics_runner"] = await exporter.serve(OPTIONS.metrics_host, OPTIONS.metrics_port)
    if OPTIONS.resync_interval > 0:
        RECONCILER.indexes["_resync"] = asyncio.get_running_loop().create_task(_resync_loop())
    if OPTIONS.class_status_interval > 0:
        RECONCILER.indexes["_class_status"] = asyncio.get_running_loop().create_task(_class_status_loop())


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is not None:
        RECONCILER.api = client.Api.from_connection(info)
    return info


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    for name in ("_resync", "_class_status"):
        task = RECONCILER.indexes.pop(name, None)
        if task is not None:
            task.cancel()
    for name in ("_metrics_runner", "_alertmanager_runner"):
        runner = RECONCILER.indexes.pop(name, None)
        if runner is not None:
            await runner.cleanup()
    for t in list(RECONCILER._tasks) + list(RECONCILER._autoscalers.values()):
        t.cancel()
    if RECONCILER.api is not None:
        await RECONCILER.api.close()


async def _class_status_loop() -> None:
    """AcceleratorClass status (nodes, allocatable, free units) every --class-status-interval seconds."""
    writer = class_status.ClassStatusWriter()
    while True:
        api = RECONCILER.api
        if api is not None:
            try:
                await RECONCILER._await_indexes(api)
                nodes = [next(iter(s)) for s in (RECONCILER.indexes.get("node_index") or {}).values()]
                pods = [p for s in (RECONCILER.indexes.get("pod_index") or {}).values() for p in s]
                for _ in await writer.sync(api, nodes, pods):
                    exporter.API_WRITES.labels("AcceleratorClass/status").inc()
            except client.ApiError as exc:
                logger.warning("AcceleratorClass status round failed: %s; next in %ss", exc, OPTIONS.class_status_interval)
            except Exception:  # NOTE: a bug here must not end the loop (or the operator)
                logger.exception("AcceleratorClass status round failed")
        await asyncio.sleep(OPTIONS.class_status_interval if api is not None else 0.2)


async def _resync_loop() -> None:
    """Every deployment again, `--resync-interval` after the previous round finished: a round that takes
    longer than the interval (a large fleet, a slow API server) does not stack the next one on top."""
    while True:
        await asyncio.sleep(OPTIONS.resync_interval)
        done = await asyncio.gather(*(RECONCILER._background(key, "periodic resync") for key in sorted(RECONCILER._bodies())),
                                    return_exceptions=True)
        for failed in (d for d in done if isinstance(d, Exception)):
            logger.error("periodic resync: %r", failed)


# Indexes: kopf fills them before any resource handler runs, so the first plan after a start sees the
# whole cluster (an empty inventory would scale everything down).

@kopf.index(GROUP, VERSION, "acceleratorclasses")
def class_index(name: str, body: kopf.Body, logger: logging.Logger, **_: Any) -> dict[str, AcceleratorClassSpec] | None:
    try:
        return {name: AcceleratorClass.model_validate({"metadata": {"name": name}, "spec": dict(body.get("spec") or {})}).spec}
    except pydantic.ValidationError as exc:
        logger.error("AcceleratorClass %s is invalid and ignored: %s", name, exc)
        return None


@kopf.index("", "v1", "nodes")
def node_index(name: str, body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]]:
    return {name: _node_view(body)}


@kopf.index("", "v1", "pods")
def pod_index(body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]] | None:
    spec = body.get("spec") or {}
    node_name = spec.get("nodeName")
    if not node_name or (body.get("status") or {}).get("phase") in inventory.FINISHED_PHASES:
        return None
    meta = body.get("metadata") or {}
    view = {"metadata": {"namespace": meta.get("namespace"), "name": meta.get("name"),
                         "labels": {k: v for k, v in (meta.get("labels") or {}).items() if k == inventory.DEPLOYMENT_LABEL}},
            "spec": {"nodeName": node_name, "containers": [{"resources": c.get("resources") or {}} for c in spec.get("containers") or []],
                     "initContainers": [{"resources": c.get("resources") or {}} for c in spec.get("initContainers") or []],
                     **({"overhead": spec["overhead"]} if spec.get("overhead") else {})}}
    return {node_name: view}


@kopf.index(GROUP, VERSION, "inferencedeployments")
def infdep_index(namespace: str, name: str, body: kopf.Body, **kwargs: Any) -> dict[Key, dict[str, Any]]:
    _keep_indexes(kwargs)
    return {(namespace, name): json.loads(json.dumps(dict(body)))}


def _keep_indexes(kwargs: Mapping[str, Any]) -> None:
    for name in ("class_index", "node_index", "pod_index", "infdep_index"):
        if name in kwargs:
            RECONCILER.indexes[name] = kwargs[name]


def _node_view(body: Mapping[str, Any]) -> dict[str, Any]:
    meta, spec, st = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    return {"metadata": {"name": meta.get("name"), "labels": dict(meta.get("labels") or {})},
            "spec": {"taints": list(spec.get("taints") or []), "unschedulable": bool(spec.get("unschedulable"))},
            "status": {"allocatable": dict(st.get("allocatable") or {}),
                       "conditions": [c for c in st.get("conditions") or [] if c.get("type") == "Ready"][:1]}}


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


# --- the InferenceDeployment itself --------------------------------------------------------------------------

async def _reconcile_from_handler(namespace: str, name: str, body: kopf.Body, why: str, kwargs: Mapping[str, Any]) -> None:
    _keep_indexes(kwargs)
    try:
        outcome = await RECONCILER.reconcile((namespace, name), why, body=json.loads(json.dumps(dict(body))))
    except pydantic.ValidationError as exc:
        raise kopf.PermanentError(f"invalid spec: {exc}") from exc
    except ValueError as exc:
        raise kopf.PermanentError(str(exc)) from exc
    except client.ApiError as exc:
        if exc.heals:
            raise kopf.TemporaryError(f"API server: {exc}", delay=5) from exc
        raise kopf.PermanentError(f"API server rejected a request: {exc}") from exc
    logger.debug("%s/%s reconciled (%s): %s", namespace, name, why, outcome)


@kopf.on.create(GROUP, VERSION, "inferencedeployments")
async def on_create(namespace: str, name: str, body: kopf.Body, **kwargs: Any) -> None:
    await _reconcile_from_handler(namespace, name, body, "created", kwargs)


@kopf.on.update(GROUP, VERSION, "inferencedeployments")
async def on_update(namespace: str, name: str, body: kopf.Body, **kwargs: Any) -> None:
    await _reconcile_from_handler(namespace, name, body, "spec changed", kwargs)


@kopf.on.resume(GROUP, VERSION, "inferencedeployments")
async def on_resume(namespace: str, name: str, body: kopf.Body, **kwargs: Any) -> None:
    await _reconcile_from_handler(namespace, name, body, "operator started", kwargs)


@kopf.on.event(GROUP, VERSION, "inferencedeployments", annotations={revisions.ANNOTATION_ROLLBACK_TO: kopf.PRESENT})
async def on_rollback_annotation(namespace: str, name: str, event: Mapping[str, Any], **kwargs: Any) -> None:
    """`pdfleet.io/rollback-to=N` set by hand. NOTE: an on.event handler, because kopf leaves annotations under
    its own storage prefix (pdfleet.io) out of the essence that on.update compares."""
    _keep_indexes(kwargs)
    if event.get("type") in (None, "ADDED", "MODIFIED"):
        RECONCILER.request((namespace, name), f"annotation {revisions.ANNOTATION_ROLLBACK_TO}")


@kopf.on.delete(GROUP, VERSION, "inferencedeployments", optional=True)
async def on_delete(namespace: str, name: str, **_: Any) -> None:
    """Children go with the CR by garbage collection (ownerReferences); only this process's memory is ours."""
    key = (namespace, name)
    for store in (RECONCILER.desired, RECONCILER.templates, RECONCILER.extra_conditions, RECONCILER.extra_status,
                  RECONCILER._last_status, RECONCILER._rendered, RECONCILER._targets, RECONCILER._specs,
                  RECONCILER.plans):
        store.pop(key, None)
    RECONCILER.limited.discard(key)
    RECONCILER.stop_loops(key)
    exporter.forget(namespace, name)


# --- what else re-plans a deployment --------------------------------------------------------------------------

@kopf.on.event(GROUP, VERSION, "acceleratorclasses")
async def on_class_event(name: str, body: kopf.Body, event: Mapping[str, Any], **kwargs: Any) -> None:
    _keep_indexes(kwargs)
    spec = dict(body.get("spec") or {})
    before = RECONCILER.class_specs.get(name)
    if event.get("type") == "DELETED":
        RECONCILER.class_specs.pop(name, None)
        why = f"AcceleratorClass {name} deleted"
    else:
        RECONCILER.class_specs[name] = spec
        if event.get("type") is None or before == spec:
            return  # the initial listing, or no change of the spec
        if before is None:
            why = f"AcceleratorClass {name} created"
        else:
            changed = sorted(k for k in set(before) | set(spec) if before.get(k) != spec.get(k))
            why = f"AcceleratorClass {name} changed: " + ", ".join(
                f"{k} {before.get(k)!r} -> {spec.get(k)!r}" if k in ("costPerHour", "count", "memoryGiB", "peakTflops",
                                                                     "memoryBandwidthGBps", "resourceName")
                else k for k in changed)
    for key in RECONCILER.keys_using({name}):
        RECONCILER.request(key, why)


@kopf.on.event("", "v1", "nodes")
async def on_node_event(name: str, body: kopf.Body, event: Mapping[str, Any], **kwargs: Any) -> None:
    _keep_indexes(kwargs)
    view = _node_view(body)
    digest = _digest(view)
    before = RECONCILER.node_digests.get(name)
    if event.get("type") == "DELETED":
        RECONCILER.node_digests.pop(name, None)
        what = f"node {name} removed"
    else:
        RECONCILER.node_digests[name] = digest
        if event.get("type") is None or before == digest:
            return  # the initial listing, or a heartbeat
        what = f"node {name} {'added' if before is None else 'changed'}"
    affected = _classes_on(view)
    if not affected:
        return
    free = ", ".join(f"{view['status']['allocatable'].get(c.resource_name, 0)} {c.resource_name}"
                     for c in {c.resource_name: c for c in affected.values()}.values())
    for key in RECONCILER.keys_using(set(affected)):
        RECONCILER.request(key, f"{what} ({free} allocatable)")


def _classes_on(view: dict[str, Any]) -> dict[str, AcceleratorClassSpec]:
    """The classes whose pods could land on this node (selector, taints) and whose resource it advertises."""
    node = inventory.NodeInventory(view["metadata"]["name"], view["metadata"]["labels"], inventory.taints_of(view), {})
    allocatable = view["status"]["allocatable"]
    return {n: c for n, c in RECONCILER._classes().items() if node.admits(c) and c.resource_name in allocatable}


@kopf.on.event("", "v1", "pods")
async def on_pod_event(body: kopf.Body, event: Mapping[str, Any], **kwargs: Any) -> None:
    """A finished or deleted pod frees its accelerators: re-plan the deployments that were short of them."""
    _keep_indexes(kwargs)
    if event.get("type") is None or not RECONCILER.limited:
        return
    gone = event.get("type") == "DELETED" or (body.get("status") or {}).get("phase") in inventory.FINISHED_PHASES
    if not gone or not (body.get("spec") or {}).get("nodeName"):
        return
    freed = {k for k in inventory.pod_requests(dict(body)) if k not in ("memory", "pods", "ephemeral-storage")}
    classes = RECONCILER._classes()
    for key in sorted(RECONCILER.limited):
        spec = (RECONCILER._bodies().get(key) or {}).get("spec") or {}
        listed = {c for r in ("prefill", "decode", "colocated") for c in (spec.get(r) or {}).get("acceleratorClasses", [])}
        if any(classes[c].resource_name in freed for c in listed if c in classes):
            RECONCILER.request(key, f"pod {body['metadata'].get('namespace')}/{body['metadata'].get('name')} freed "
                                    + ", ".join(sorted(freed)))


def _on_child_event(kind: str, body: kopf.Body, event: Mapping[str, Any], kwargs: Mapping[str, Any]) -> None:
    _keep_indexes(kwargs)
    if event.get("type") is None:
        return
    meta = body.get("metadata") or {}
    owner = (meta.get("labels") or {}).get(render.LABEL_DEPLOYMENT)
    key = (meta.get("namespace"), owner)
    if not owner or key not in RECONCILER._bodies():
        return
    api = RECONCILER.api
    if api is not None and api.is_own_write(kind, meta.get("namespace"), meta.get("name"),
                                            client.DELETED if event.get("type") == "DELETED" else meta.get("resourceVersion")):
        return  # the echo of our own write or delete
    RECONCILER.request(key, f"{kind} {meta.get('name')} {str(event.get('type')).lower()}")


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
async def on_deployment_event(body: kopf.Body, event: Mapping[str, Any], **kwargs: Any) -> None:
    _on_child_event("Deployment", body, event, kwargs)


@kopf.on.event("", "v1", "services", labels=MANAGED)
async def on_service_event(body: kopf.Body, event: Mapping[str, Any], **kwargs: Any) -> None:
    _on_child_event("Service", body, event, kwargs)


@kopf.on.event("", "v1", "configmaps", labels=MANAGED)
async def on_configmap_event(body: kopf.Body, event: Mapping[str, Any], **kwargs: Any) -> None:
    _on_child_event("ConfigMap", body, event, kwargs)


@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=MANAGED)
async def on_pdb_event(body: kopf.Body, event: Mapping[str, Any], **kwargs: Any) -> None:
    _on_child_event("PodDisruptionBudget", body, event, kwargs)
