"""The one reconcile path per InferenceDeployment, and the process's memory of each one; the kopf triggers
(`kube.handlers`) and the background loops (`kube.loops`) call it.

Every trigger (the CR's create/update/resume, an AcceleratorClass or Node change, a child edited by
hand, a freed accelerator, the periodic resync, the autoscaler or rollback asking for a new size or
revision) ends in `Reconciler.reconcile(key, why)`: gather (indexes + children) -> plan -> render ->
apply what differs -> status and Events if something changed. Runs of one key never overlap and
requests arriving during a run fold into one more run. What the process remembers of a deployment
is one `DeploymentMemory`, created on first sight and dropped by `forget` when it is deleted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import fnmatch
import hashlib
import json
import logging
from collections.abc import Mapping
from typing import Any

import pydantic

from pdfleet_operator.api import (
    AcceleratorClassSpec,
    Condition,
    InferenceDeployment,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    parse_duration,
    set_condition,
)
from pdfleet_operator.decide import cost, guardrails, handover, inventory, placement, rollback, runtimes, status
from pdfleet_operator.kube import alertmanager, client, exporter, loops, render, revisions
from pdfleet_operator.kube.memory import DeploymentMemory, Template
from pdfleet_operator.kube.options import OPTIONS

GROUP, VERSION = "pdfleet.io", "v1alpha1"
logger = logging.getLogger("pdfleet.operator")
# How long the first reconcile of a process waits for kopf's class and node indexes to be complete.
INDEX_SYNC_TIMEOUT_S = 10.0
# The deployment token's Secret is created when missing at most this often per deployment (a POST that finds it
# answers 409): so a Secret deleted to rotate the token comes back with the next reconcile after that.
AUTH_SECRET_CHECK_S = 60.0
Key = tuple[str, str]  # (namespace, name)
RETRY_DELAYS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)

__all__ = ["Key", "Outcome", "Reconciler", "Template"]


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


@dataclasses.dataclass
class Outcome:
    """What one reconcile did (returned to handlers and tests)."""

    writes: int = 0
    plan: placement.FleetPlan | None = None
    result: client.ApplyResult | None = None
    status_written: bool = False
    skipped: str = ""


class Reconciler:
    """The state the kopf triggers share: indexes, the API client, and one `DeploymentMemory` per deployment."""

    def __init__(self) -> None:
        self.api: client.Api | None = None
        self.indexes: dict[str, Any] = {}
        self.deployments: dict[Key, DeploymentMemory] = {}  # created on first sight, dropped by `forget`
        self._tasks: set[asyncio.Task] = set()
        self._synced: asyncio.Task | None = None  # the one-time wait for kopf's indexes (see _await_indexes)
        # What this process last saw of the cluster-scoped inputs (their changes re-plan deployments).
        self.node_digests: dict[str, str] = {}
        self.class_specs: dict[str, dict[str, Any]] = {}
        self._monitoring: tuple[float, bool] | None = None
        self.reconciles = 0
        self.loop: asyncio.AbstractEventLoop | None = None  # kopf's loop: other threads call in through it
        self.autoscaling = False  # start autoscaler loops (set at kopf startup from OPTIONS.autoscaler)
        self.analysis = False  # start rollback-analysis loops (set at kopf startup from OPTIONS.analysis_interval)
        self.rollbacks = revisions.AnalysisLog()
        self._auth_checked: dict[Key, tuple[str, float]] = {}  # key -> (uid, monotonic time of the last create POST)
        # Namespaced mode: the pods of the namespaces kopf does not watch, as last listed cluster-wide
        # (monotonic time, pod views, why they could not be listed or None); see `_foreign_pods`.
        self._foreign: tuple[float, list[dict[str, Any]], str | None] | None = None
        self._foreign_task: asyncio.Task | None = None

    # --- the memory of each deployment --------------------------------------------------------------------
    def memory(self, key: Key) -> DeploymentMemory:
        """The deployment's memory, created the first time anything asks."""
        m = self.deployments.get(key)
        if m is None:
            m = self.deployments[key] = DeploymentMemory()
        return m

    def known(self, key: Key) -> DeploymentMemory | None:
        """The deployment's memory if this process has one (never creates it)."""
        return self.deployments.get(key)

    def forget(self, key: Key) -> None:
        """The deployment is gone: stop its loops and drop everything this process kept about it."""
        self._auth_checked.pop(key, None)
        m = self.deployments.pop(key, None)
        if m is not None:
            m.stop()
            m.scaler.forget(key)
            self._release(key, m.plan, None, "deleted")
        exporter.forget(*key)

    def limited(self) -> list[Key]:
        """The deployments whose last plan fell short of accelerators."""
        return sorted(k for k, m in self.deployments.items() if m.limited)

    # --- inputs from the autoscaler and rollback --------------------------------------------------------
    def set_desired(self, key: Key, replicas: Mapping[str, int], why: str = "autoscaler") -> None:
        """Total replicas per role to plan for; placement caps them at capacity (-> ScalingLimited)."""
        self.memory(key).desired = dict(replicas)
        self.request(key, why)

    def set_template(self, key: Key, template: Template | None, why: str = "rollback") -> None:
        """Serve `template` (a stored revision) instead of the current spec; None goes back to the spec."""
        self.memory(key).template = template
        self.request(key, why)

    def set_status(self, key: Key, *, conditions: list[Condition] = (), why: str = "", **fields: Any) -> None:
        """Conditions (MetricsAvailable, RolledBack, ...) and status fields (lastScalingDecision,
        stableRevision, failedRevision) written with the next status update; no second status writer."""
        m = self.memory(key)
        m.extra_conditions.update({c.type: c for c in conditions})
        m.extra_status.update(fields)
        self.request(key, why or "status update")

    def clear_condition(self, key: Key, type_: str) -> None:
        """Stop overriding a condition the reconcile computes itself (it takes effect with the next status update)."""
        self.memory(key).extra_conditions.pop(type_, None)

    def last_plan(self, key: Key) -> placement.FleetPlan | None:
        """The deployment's last plan (None before the first): what runs and what is placeable (the autoscaler's tick)."""
        m = self.known(key)
        return None if m is None else m.plan

    def engines(self, key: Key) -> dict[str, list[str]]:
        """Per role, the engines its planned pools run (the autoscaler reads each with its metric names)."""
        m = self.known(key)
        return {} if m is None else dict(m.engines)

    def capacity(self, key: Key) -> dict[str, int]:
        """Per role, the most replicas placeable on free capacity as of the last plan."""
        plan = self.last_plan(key)
        return {} if plan is None else {role: plan.capacity(role) for role in plan.roles()}

    async def on_alert(self, trigger: alertmanager.RollbackTrigger) -> None:
        """A pdfleet rollback alert from Alertmanager (the receiver calls this): analyse now."""
        exporter.ALERT_TRIGGERS.inc()
        await loops.on_alert(self, trigger)

    async def analyze_rollback(self, key: Key, source: str, trigger: alertmanager.RollbackTrigger | None = None
                               ) -> rollback.RollbackAction | None:
        """One rollback analysis of the deployment's served revision (`loops.analyze`)."""
        return await loops.analyze(self, key, source, trigger)

    # --- triggering ---------------------------------------------------------------------------------------
    def request(self, key: Key, why: str) -> None:
        """Reconcile `key` soon, in the background (coalesced with runs already queued)."""
        task = asyncio.get_running_loop().create_task(self._background(key, why))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _background(self, key: Key, why: str) -> None:
        try:
            await self.reconcile(key, why)
            self.memory(key).retries = 0
        except client.ApiError as exc:
            m = self.memory(key)
            attempt = m.retries
            m.retries = attempt + 1
            delay = RETRY_DELAYS[min(attempt, len(RETRY_DELAYS) - 1)]
            logger.warning("reconcile of %s/%s (%s) failed: %s; retrying in %ss", *key, why, exc, delay)
            await asyncio.sleep(delay)
            self.request(key, why)
        except (pydantic.ValidationError, ValueError) as exc:
            logger.error("reconcile of %s/%s (%s) failed: %s", *key, why, exc)
            exporter.RECONCILES.labels("error").inc()

    def owner(self, key: Key, body: Mapping[str, Any]) -> render.Owner:
        return render.Owner(key[1], key[0], body["metadata"]["uid"])

    async def drain(self) -> None:
        """Wait for background reconciles (tests and shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def keys_using(self, class_names: set[str]) -> list[Key]:
        out = []
        for key, body in self.bodies().items():
            spec = body.get("spec") or {}
            listed = {c for role in ("prefill", "decode", "colocated") for c in (spec.get(role) or {}).get("acceleratorClasses", [])}
            if listed & class_names:
                out.append(key)
        return sorted(out)

    # --- gathering ----------------------------------------------------------------------------------------
    def bodies(self) -> dict[Key, dict[str, Any]]:
        """Every InferenceDeployment as kopf's index holds it."""
        index = self.indexes.get("infdep_index")
        if index is None:
            return {}
        return {key: next(iter(store)) for key, store in index.items()}

    def classes(self) -> dict[str, AcceleratorClassSpec]:
        index = self.indexes.get("class_index") or {}
        return {name: next(iter(store)) for name, store in index.items()}

    def _inventory(self, key: Key) -> inventory.Inventory:
        """Free capacity for re-planning `key`: nodes minus bound pods, Pending pods and the replicas other
        deployments' last plans hold whose pods do not exist yet (`reservations`)."""
        nodes = [next(iter(s)) for s in (self.indexes.get("node_index") or {}).values()]
        pods = [p for s in (self.indexes.get("pod_index") or {}).values() for p in s] + self.foreign_pods()
        return inventory.build(nodes, pods, exclude_deployment=key, reserved=self.reservations(exclude=key))

    def foreign_pods(self) -> list[dict[str, Any]]:
        """Namespaced mode: the pods of the other namespaces as last listed (empty cluster-wide, or when forbidden)."""
        return list(self._foreign[1]) if self._foreign is not None else []

    async def _foreign_pods(self, api: client.Api) -> str | None:
        """Namespaced mode: refresh the other namespaces' pods (at most every --foreign-pods-interval s); returns
        why they cannot be seen (RBAC forbids listing pods cluster-wide) or None.

        NOTE: kopf watches pods only in the namespaces it serves, but GPUs are shared by every namespace:
        without this a namespaced operator plans onto accelerators other teams' pods hold.
        """
        if not OPTIONS.namespaces:
            return None
        loop = asyncio.get_running_loop()
        if self._foreign is None or loop.time() - self._foreign[0] >= OPTIONS.foreign_pods_interval:
            if self._foreign_task is None or self._foreign_task.done():
                self._foreign_task = loop.create_task(self._list_foreign_pods(api))
            await asyncio.shield(self._foreign_task)
        assert self._foreign is not None
        return self._foreign[2]

    async def _list_foreign_pods(self, api: client.Api) -> None:
        now = asyncio.get_running_loop().time()
        try:
            listed = await api.request("GET", "/api/v1/pods",
                                       params={"fieldSelector": "status.phase!=Succeeded,status.phase!=Failed"})
        except client.ApiError as exc:
            if exc.code not in (401, 403):
                raise  # the reconcile retries; the last list (if any) stays in use meanwhile
            self._foreign = (now, [], f"cannot list pods outside the watched namespaces ({exc.code} {exc.reason}: "
                                      f"{exc.message}): accelerators that other namespaces' pods hold count as free; "
                                      f"grant list on pods cluster-wide (the chart's ClusterRole does)")
            logger.warning("capacity: %s", self._foreign[2])
            return
        views = [v for p in (listed or {}).get("items") or []
                 if not _watched((p.get("metadata") or {}).get("namespace") or "", OPTIONS.namespaces)
                 and (v := inventory.pod_view(p)) is not None]
        self._foreign = (now, views, None)

    def _capacity_condition(self, blind: str | None, generation: int | None) -> Condition:
        now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
        if blind is not None:
            return Condition(type="CapacityVisible", status="False", reason="PodsForbidden", message=blind,
                             last_transition_time=now, observed_generation=generation)
        return Condition(type="CapacityVisible", status="True", reason="AllNamespaces",
                         message=f"pods outside {', '.join(OPTIONS.namespaces)} are counted too (listed at most every "
                                 f"{OPTIONS.foreign_pods_interval:g} s)",
                         last_transition_time=now, observed_generation=generation)

    def reservations(self, exclude: Key | None = None) -> list[inventory.Reservation]:
        """What this process's last plan of every other known deployment holds, pool by pool.

        NOTE: a plan is made and remembered in one step of the event loop (no await between
        `_inventory` and `m.plan = plan`), so two reconciles running at once never plan onto the
        same units: the second sees the first one's plan before either's pods exist.
        """
        classes = self.classes()
        known = self.bodies()
        out = []
        for k, m in sorted(self.deployments.items()):
            if k == exclude or m.plan is None or k not in known:
                continue
            for p in m.plan.pools:
                if p.accelerator_class in classes:
                    out.append(inventory.Reservation(k[0], k[1], p.role, p.accelerator_class, classes[p.accelerator_class],
                                                     p.replicas))
        return out

    def _release(self, key: Key, before: placement.FleetPlan | None, after: placement.FleetPlan | None, why: str) -> None:
        """Re-plan the deployments short of capacity when `key`'s plan gave up units of a resource they use."""
        if before is None:
            return
        classes = self.classes()

        def units(plan: placement.FleetPlan | None) -> dict[str, int]:
            out: dict[str, int] = {}
            for p in (plan.pools if plan is not None else ()):
                cls = classes.get(p.accelerator_class)
                if cls is not None:
                    out[cls.resource_name] = out.get(cls.resource_name, 0) + p.replicas * cls.count
            return out

        was, now = units(before), units(after)
        freed = sorted(r for r, n in was.items() if n > now.get(r, 0))
        if not freed:
            return
        for other in self.limited():
            if other == key:
                continue
            spec = (self.bodies().get(other) or {}).get("spec") or {}
            listed = {c for r in ("prefill", "decode", "colocated") for c in (spec.get(r) or {}).get("acceleratorClasses", [])}
            if any(classes[c].resource_name in freed for c in listed if c in classes):
                self.request(other, f"{key[0]}/{key[1]} {why}: its plan freed {', '.join(freed)}")

    async def _monitoring_enabled(self) -> bool:
        assert self.api is not None
        now = asyncio.get_running_loop().time()
        if self._monitoring is None or now - self._monitoring[0] > OPTIONS.monitoring_check_interval:
            self._monitoring = (now, await self.api.has_group("monitoring.coreos.com/v1"))
        return self._monitoring[1]

    # --- the reconcile --------------------------------------------------------------------------------------
    async def reconcile(self, key: Key, why: str, *, body: Mapping[str, Any] | None = None) -> Outcome:
        m = self.memory(key)
        m.wanted += 1
        ticket = m.wanted
        async with m.lock:
            if m.done >= ticket:
                return Outcome(skipped="covered by a later run")
            started = m.wanted
            try:
                outcome = await self._reconcile(key, why, body)
            except Exception:
                exporter.RECONCILES.labels("error").inc()
                raise
            m.done = started
            exporter.RECONCILES.labels("ok" if not outcome.skipped else "skipped").inc()
            self.reconciles += 1
            if outcome.plan is not None and self.known(key) is m:
                loops.start(self, key, m)
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
        m = self.memory(key)
        # NOTE: the index may hold a newer body than the handler's (our status writes come back through
        # it); the generation decides which spec is newer, the index wins ties.
        indexed = self.bodies().get(key)
        body = indexed if indexed is not None else given
        if given is not None and indexed is not None and \
                (given.get("metadata") or {}).get("generation", 0) > (indexed.get("metadata") or {}).get("generation", 0):
            body = given
        if body is None:
            return Outcome(skipped="gone")
        meta = body.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            return Outcome(skipped="being deleted")
        dep = self.parse(key, body)
        refused = guardrails.host_path_problem(dep.spec, key[0], OPTIONS.host_path_prefixes, OPTIONS.host_path_namespaces)
        if refused:
            raise ValueError(refused)
        await self._await_indexes(api)
        owner = render.Owner(dep.name, key[0], meta["uid"])
        classes = self.classes()
        monitoring = await self._monitoring_enabled()
        kinds = client.CHILD_KINDS + (("PodMonitor", "PrometheusRule") if monitoring else ())
        children = await client.list_children(api, owner, kinds)

        stored = await client.list_revisions(api, owner)
        config = next((c for c in children if c["kind"] == "ConfigMap"), None)
        if not m.rollback.resumed:
            self._resume(key, dep, stored, revisions.served_record(config, owner))
        if m.rollback.spec_moved_on(dep):
            self._roll_forward(key, dep)
        template = m.template
        spec_revision = revisions.number_for(dep.spec, stored, revisions.running_revisions(children),
                                             dep.status.current_revision if dep.status and dep.status.current_revision else 1)
        wanted = (meta.get("annotations") or {}).get(revisions.ANNOTATION_ROLLBACK_TO)
        if wanted is not None and m.rollback.manual != meta.get("resourceVersion"):
            # (once per version of the object: the index may still show the annotation we just removed)
            m.rollback.manual = meta.get("resourceVersion")
            template = await self._manual_rollback(api, key, dep, body, wanted, stored, spec_revision) \
                or template
        if m.rollback.held is not None:
            if template is None:
                return await self._hold(api, key, dep, body)
            m.rollback.held = None  # a rollback by hand named a stored revision
        spec = template.spec if template else dep.spec
        revision = template.revision if template else spec_revision
        desired = self._desired_for(key, dep.spec, spec, children)
        if OPTIONS.namespaces:
            m.extra_conditions["CapacityVisible"] = self._capacity_condition(await self._foreign_pods(api),
                                                                             dep.metadata.generation)
        free = self._inventory(key)
        plan = placement.plan(spec, classes, free, desired)
        m.targets = dict(plan.targets)
        before, m.plan = m.plan, plan
        self._release(key, before, plan, "re-planned")
        m.engines = {role: sorted({runtimes.engine_of(spec, classes[p.accelerator_class]) for p in plan.pools_for(role)
                                   if p.accelerator_class in classes}) for role in plan.roles()}
        objects = render.render(owner, spec, plan, classes, revision=revision, monitoring=monitoring,
                                scrapers=OPTIONS.scraper_namespaces, worker_image=OPTIONS.worker_image,
                                own_pod_monitor=OPTIONS.pod_monitors, surge=placement.surge_room(plan, classes, free))
        writes_before = api.writes
        stable = m.extra_status.get("stable_revision") or (
            dep.status.stable_revision if dep.status else None)
        # Kept: the served revision, the stable one, and the failed one (after a restart it is how the rollback
        # is recognised). The revision served until now is stored before the ConfigMap stops describing it.
        keep = {n for n in (revision, stable, getattr(m.rollback.failed, "revision", None)) if n}
        for k in await revisions.record(api, revisions.superseded(config, owner, revision, stored), stored,
                                        dep.spec.rollback.revision_history_limit, keep):
            exporter.API_WRITES.labels(k.split("/")[0]).inc()
        await self._ensure_auth_secret(api, key, owner)  # before the pods that mount it
        result = await client.apply_children(api, owner, objects, children)
        rendered = {client.key_of(o): _digest(o) for o in objects}
        last_rendered = m.rendered
        result.drifted = {k: v for k, v in result.drifted.items() if last_rendered.get(k) == rendered[k]}
        m.rendered = rendered
        for k in result.applied + result.created + result.deleted:
            exporter.API_WRITES.labels(k.split("/")[0]).inc()

        router_cpu = cost.router_cores(spec.router.resources.requests)
        plan_cost = cost.plan_cost(plan, classes, router_replicas=spec.router.replicas, router_cpu=router_cpu)
        ready = {c["metadata"]["name"]: int((c.get("status") or {}).get("readyReplicas") or 0)
                 for c in children if c["kind"] == "Deployment"}
        observed = status.Observed(ready=ready, router_ready=ready.get(render.router_name(dep.name), 0),
                                   problems=tuple(result.problems), retained=_retained(result, children))
        previous = dep.status
        last = m.last_status
        if last is not None and meta.get("resourceVersion") == last[1]:
            # The index has not caught up with our last status write yet: that write is the previous status.
            previous = InferenceDeploymentStatus.model_validate(last[0])
        new = status.compute(name=dep.name, namespace=key[0], plan=plan, cost=plan_cost, observed=observed,
                             previous=previous, generation=dep.metadata.generation, revision=revision,
                             router_replicas=spec.router.replicas, now=dt.datetime.now(dt.timezone.utc).replace(microsecond=0),
                             extra_conditions=list(m.extra_conditions.values()),
                             worker_image=spec.engine.image or OPTIONS.worker_image)
        if m.extra_status:
            new = new.model_copy(update=m.extra_status)
        new_wire = new.wire()
        old_wire = previous.wire() if previous else {}
        written = False
        if new_wire != old_wire:
            patched = await api.patch_status(key[0], dep.name, new_wire)
            m.last_status = (new_wire, meta.get("resourceVersion"), (patched.get("metadata") or {}).get("resourceVersion"))
            exporter.API_WRITES.labels("InferenceDeployment/status").inc()
            written = True

        await self._events(api, body, why, previous, new, plan, result)
        if plan.shortfalls:
            m.limited = True
        else:
            m.limited = False
        # Bill what runs: bound pods (a retained pool during a hand-over, a surge pod), not the plan (whose
        # Pending replicas hold nothing); the planned replicas stay the replicas gauge.
        pods = [p for views in (self.indexes.get("pod_index") or {}).values() for p in views]
        running = cost.running_cost(pods, key[0], dep.name, classes, router_cpu=router_cpu)
        planned = {(p.role, p.accelerator_class): p.replicas for p in plan.pools}
        pools = sorted(set(planned) | {(p.role, p.accelerator_class) for p in running.pools})
        exporter.set_pools(key[0], dep.name, ((role, acc, planned.get((role, acc), next(
            (p.replicas for p in running.pools if (p.role, p.accelerator_class) == (role, acc)), 0)),
            running.of(role, acc)) for role, acc in pools),
            parse_duration(spec.slo.ttft), parse_duration(spec.slo.itl))
        return Outcome(writes=api.writes - writes_before, plan=plan, result=result, status_written=written)

    async def _ensure_auth_secret(self, api: client.Api, key: Key, owner: render.Owner) -> None:
        last = self._auth_checked.get(key)
        now = asyncio.get_running_loop().time()
        if last is not None and last[0] == owner.uid and now - last[1] < AUTH_SECRET_CHECK_S:
            return
        if await client.ensure_auth_secret(api, owner):
            logger.info("created the deployment token Secret %s/%s", key[0], render.auth_secret_name(owner.name))
            exporter.API_WRITES.labels("Secret").inc()
        self._auth_checked[key] = (owner.uid, now)

    def _resume(self, key: Key, dep: InferenceDeployment, stored: list[dict[str, Any]],
                serving: dict[str, Any] | None) -> None:
        """Once per key and process: take over a rollback a previous process left in force (see `revisions.resume`),
        so that a restart never re-applies the failed revision while the spec is unchanged."""
        m = self.memory(key)
        m.rollback.resumed = True
        resumed = revisions.resume(dep.status, dep.metadata.generation, dep.spec, stored, serving)
        if resumed.kind == "spec":
            return
        assert resumed.failed is not None, resumed
        logger.info("%s/%s: rollback of revision %s taken over from the status: %s", *key, resumed.failed.revision,
                    resumed.kind)
        m.rollback.failed = resumed.failed
        if resumed.kind == "stored":
            assert resumed.template is not None and resumed.spec is not None, resumed
            m.template = Template(resumed.template, resumed.spec)
        elif resumed.kind == "hold":
            m.rollback.held = resumed.message
        # "roll_forward": the failed revision is remembered only for spec_moved_on to end the rollback now.

    def _roll_forward(self, key: Key, dep: InferenceDeployment) -> None:
        """A new generation with another template ends the rollback: serve the spec again."""
        m = self.memory(key)
        m.template = None
        m.rollback.held = None
        failed, m.rollback.failed = m.rollback.failed, None
        assert failed is not None, "rolled forward with no rollback in force"
        self.clear_condition(key, "Degraded")
        m.extra_conditions["RolledBack"] = Condition(
            type="RolledBack", status="False", reason="RolledForward",
            message=f"the spec changed after revision {failed.revision} was rolled back",
            last_transition_time=dt.datetime.now(dt.timezone.utc).replace(microsecond=0),
            observed_generation=dep.metadata.generation)

    async def _hold(self, api: client.Api, key: Key, dep: InferenceDeployment, body: Mapping[str, Any]) -> Outcome:
        """The revision a rollback serves cannot be rendered: touch no pool (the spec is the failed revision), page once.

        NOTE: the page is said once per cluster, not per process: a Degraded condition already saying it
        means an earlier process posted the Event too.
        """
        message = self.memory(key).rollback.held
        assert message is not None, "held with no message"
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
        m = self.memory(key)
        involved = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": body["metadata"]}
        target = revisions.find(stored, int(wanted)) if wanted.isdigit() else None
        await api.remove_annotation("InferenceDeployment", key[0], key[1], revisions.ANNOTATION_ROLLBACK_TO)
        if target is None:
            known = ", ".join(str(revisions.number_of(r)) for r in stored) or "none"
            serving = m.template.revision if m.template is not None else spec_revision
            await api.event(involved, "Warning", "RollbackRejected",
                            f"{revisions.ANNOTATION_ROLLBACK_TO}={wanted!r} names no stored revision (stored: {known}; "
                            f"serving: {serving})")
            return None
        number = revisions.number_of(target)
        current = m.template.revision if m.template is not None else spec_revision
        template = Template(number, revisions.spec_for_rollback(target, dep.spec))
        m.template = template
        # What is not re-applied until the spec changes is the spec's own revision (status.failedRevision, which
        # a restart reads back), whichever revision was being served.
        m.rollback.failed = revisions.Failed(spec_revision, dep.metadata.generation,
                                                      rollback.fingerprint(rollback.template_spec(dep.spec)))
        m.extra_status["failed_revision"] = spec_revision
        message = f"revision {current} rolled back to {number} by hand ({revisions.ANNOTATION_ROLLBACK_TO})"
        m.extra_conditions["RolledBack"] = Condition(
            type="RolledBack", status="True", reason="ManualRollback", message=message,
            last_transition_time=dt.datetime.now(dt.timezone.utc).replace(microsecond=0),
            observed_generation=dep.metadata.generation)
        await api.event(involved, "Normal", "RolledBack", message)
        return template

    def parse(self, key: Key, body: Mapping[str, Any]) -> InferenceDeployment:
        """The CR as the API model; the spec (whose CEL rules are slow to evaluate) once per generation."""
        meta = body.get("metadata") or {}
        version = (meta.get("uid"), meta.get("generation"))
        m = self.memory(key)
        cached = m.parsed
        if cached is None or cached[0] != version:
            dep = InferenceDeployment.model_validate({
                "apiVersion": body.get("apiVersion", f"{GROUP}/{VERSION}"), "kind": "InferenceDeployment",
                "metadata": {k: meta.get(k) for k in ("name", "namespace", "uid", "generation") if meta.get(k) is not None},
                "spec": body.get("spec") or {}})
            m.parsed = cached = (version, dep)
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
        m = self.memory(key)
        for source in (m.desired, m.targets):
            if source is not None:
                return {r: n for r, n in source.items() if r in roles}
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


def _watched(namespace: str, patterns: tuple[str, ...]) -> bool:
    """Whether kopf serves `namespace` given its --namespace globs (`!glob` excludes, as in kopf)."""
    positive = [p for p in patterns if not p.startswith("!")]
    if any(fnmatch.fnmatchcase(namespace, p[1:]) for p in patterns if p.startswith("!")):
        return False
    return any(fnmatch.fnmatchcase(namespace, p) for p in positive)


def _retained(result: client.ApplyResult, children: list[dict[str, Any]]) -> tuple[tuple[str, str, int, str], ...]:
    """The pools `apply_children` kept serving while their role's new pools start, for the status."""
    by_key = {client.key_of(c): c for c in children}
    return tuple((by_key[k]["metadata"]["name"], by_key[k]["metadata"]["labels"][render.LABEL_ROLE],
                  handover.ready_replicas(by_key[k]), why) for k, why in sorted(result.retained.items()))


def _condition(st: Any, type_: str) -> Condition | None:
    return next((c for c in (st.conditions if st else []) if c.type == type_), None)
