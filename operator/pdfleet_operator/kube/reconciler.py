"""The one reconcile path per InferenceDeployment, and the process's memory of each one; the kopf triggers
(`kube.handlers`) and the background loops (`kube.loops`) call it.

Every trigger (the CR's create/update/resume, an AcceleratorClass or Node change, a child edited by hand, a
freed accelerator, the periodic resync, the autoscaler or rollback asking for a new size or revision) ends
in `Reconciler.reconcile(key, why)`, which is three steps:

    gather   one `decide.reconcile.Observed`: the CR, kopf's indexes, the children and revisions (two lists)
    decide   `decide.reconcile.decide(observed)`: a pure chain to a `Desired` (objects, status, Events, memory)
    write    only what differs: revision records, the token Secret once, children, status, Events, class finalizers

Runs of one key never overlap and requests arriving during a run fold into one more run. What the process
remembers of a deployment is one `DeploymentMemory`, created on first sight and dropped by `forget`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import time
from collections.abc import Mapping
from typing import Any

import pydantic

from pdfleet_operator.api import (
    AcceleratorClassSpec,
    Condition,
    InferenceDeployment,
    parse_duration,
)
from pdfleet_operator.decide import cost, guardrails, placement, reconcile, rollback
from pdfleet_operator.decide.rollback import Template
from pdfleet_operator.kube import class_protection, client, exporter, render, revisions
from pdfleet_operator.kube.holdings import Holdings
from pdfleet_operator.kube.indexes import Key, capacity_condition
from pdfleet_operator.kube.options import OPTIONS
from pdfleet_operator.kube.token_secret import TokenSecrets

logger = logging.getLogger("pdfleet.operator")
RETRY_DELAYS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)

__all__ = ["Key", "Outcome", "Reconciler", "Template"]


@dataclasses.dataclass
class Outcome:
    """What one reconcile did (returned to handlers and tests)."""

    writes: int = 0
    plan: placement.FleetPlan | None = None
    result: client.ApplyResult | None = None
    status_written: bool = False
    skipped: str = ""
    desired: reconcile.Desired | None = None


class Reconciler(Holdings):
    """The state the kopf triggers share: indexes, one `DeploymentMemory` per deployment and what their pools hold
    (`Holdings`), the API client, the token Secrets' checks."""

    def __init__(self) -> None:
        super().__init__()
        self.api: client.Api | None = None
        self.tokens = TokenSecrets()
        self._tasks: set[asyncio.Task] = set()
        self._gathering: dict[Key, list[str]] = {}  # key -> why of each request waiting in a `gather` window
        # What this process last saw of the cluster-scoped inputs (their changes re-plan deployments).
        self.node_digests: dict[str, str] = {}
        self.class_specs: dict[str, dict[str, Any]] = {}
        self.deleting_classes: set[str] = set()
        self.protected: dict[str, str | None] = {}  # class -> the version this process put its finalizer on
        self._monitoring: tuple[float, bool] | None = None
        self.reconciles = 0
        self.loop: asyncio.AbstractEventLoop | None = None  # kopf's loop: other threads call in through it
        self.autoscaling = False  # start autoscaler loops (set at kopf startup from OPTIONS.autoscaler)
        self.analysis = False  # start rollback-analysis loops (set at kopf startup from OPTIONS.analysis_interval)
        self.rollbacks = revisions.AnalysisLog()

    # --- the memory of each deployment ---------------------------------------------------------------------
    def forget(self, key: Key) -> None:
        """The deployment is gone: stop its loops and drop everything this process kept about it."""
        self.tokens.forget(key)
        if self.api is not None:
            self.api.forget(*key)
        m = self.deployments.pop(key, None)
        self.capacity_changed(key)
        if m is not None:
            m.stop()
            m.scaler.forget(key)
            self._release(key, m.plan, None, "deleted")
        exporter.forget(*key)

    # --- inputs from the autoscaler and rollback --------------------------------------------------------
    def set_desired(self, key: Key, replicas: Mapping[str, int], why: str = "autoscaler") -> None:
        """Total replicas per role to plan for; placement caps them at capacity (-> ScalingLimited)."""
        self.memory(key).desired = dict(replicas)
        self.request(key, why)

    def set_template(self, key: Key, template: Template | None, why: str = "rollback") -> None:
        """Serve `template` (a stored revision) instead of the current spec; None goes back to the spec."""
        m = self.memory(key)
        m.rollback = dataclasses.replace(m.rollback, template=template)
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

    def owner(self, key: Key, body: Mapping[str, Any]) -> render.Owner:
        return render.Owner(key[1], key[0], body["metadata"]["uid"])

    # --- triggering ---------------------------------------------------------------------------------------
    def request(self, key: Key, why: str, *, gather: float = 0.0) -> None:
        """Reconcile `key` soon, in the background (coalesced with runs already queued). `gather`: wait that long
        first, and let every request for `key` made meanwhile ride along (a burst of child events, one reconcile)."""
        if gather > 0:
            if key in self._gathering:
                self._gathering[key].append(why)
                return
            self._gathering[key] = [why]
        task = asyncio.get_running_loop().create_task(self._background(key, why, gather))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _background(self, key: Key, why: str, gather: float = 0.0) -> None:
        if gather > 0:
            await asyncio.sleep(gather)
            whys = self._gathering.pop(key, [why])
            why = whys[0] if len(whys) == 1 else f"{whys[0]} (+{len(whys) - 1} more)"
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

    async def drain(self) -> None:
        """Wait for background reconciles (tests and shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _release(
        self, key: Key, before: placement.FleetPlan | None, after: placement.FleetPlan | None, why: str
    ) -> None:
        """Re-plan the deployments short of capacity when `key`'s plan gave up units of a resource they use."""
        waiting, freed = self.freed_for(key, before, after)
        for other in waiting:
            self.request(other, f"{key[0]}/{key[1]} {why}: its plan freed {', '.join(freed)}")

    async def _monitoring_enabled(self, api: client.Api) -> bool:
        now = asyncio.get_running_loop().time()
        if self._monitoring is None or now - self._monitoring[0] > OPTIONS.monitoring_check_interval:
            self._monitoring = (now, await api.has_group("monitoring.coreos.com/v1"))
        return self._monitoring[1]

    def parse(self, key: Key, body: Mapping[str, Any]) -> InferenceDeployment:
        """The CR as the API model (the spec parsed once per generation, `DeploymentMemory.parse`)."""
        return self.memory(key).parse(body)

    # --- the reconcile --------------------------------------------------------------------------------------
    async def reconcile(self, key: Key, why: str, *, body: Mapping[str, Any] | None = None) -> Outcome:
        m = self.memory(key)
        m.wanted += 1
        ticket = m.wanted
        async with m.lock:
            if m.done >= ticket:
                return Outcome(skipped="covered by a later run")
            started = m.wanted
            t0 = time.perf_counter()
            try:
                outcome = await self._reconcile(key, why, body)
            except Exception:
                exporter.RECONCILES.labels("error").inc()
                raise
            m.done = started
            exporter.RECONCILES.labels("ok" if not outcome.skipped else "skipped").inc()
            self.reconciles += 1
            logger.debug("reconciled %s/%s in %.1f ms (%s)", *key, (time.perf_counter() - t0) * 1e3, why)
            return outcome

    async def _reconcile(self, key: Key, why: str, given: Mapping[str, Any] | None) -> Outcome:
        api = self.api
        assert api is not None, "reconcile before login"
        # NOTE: the index may hold a newer body than the handler's (our status writes come back through
        # it); the generation decides which spec is newer, the index wins ties.
        indexed = self.body(key)
        body = indexed if indexed is not None else given
        if (
            given is not None
            and indexed is not None
            and (given.get("metadata") or {}).get("generation", 0)
            > (indexed.get("metadata") or {}).get("generation", 0)
        ):
            body = given
        if body is None:
            return Outcome(skipped="gone")
        if (body.get("metadata") or {}).get("deletionTimestamp"):
            return Outcome(skipped="being deleted")
        obs, monitoring = await self._gather(api, key, why, body)
        m = self.memory(key)
        owner = render.Owner(key[1], key[0], obs.uid)
        desired = reconcile.decide(obs, _renderer(owner, obs.classes, monitoring))
        # (before any await: the analysis reads it) What the state machine set stays set for the next reconciles.
        m.rollback = desired.serving.state
        m.extra_conditions.update({c.type: c for c in desired.serving.conditions})
        for type_ in desired.serving.cleared:
            m.extra_conditions.pop(type_, None)
        m.extra_status.update(desired.serving.fields)
        if desired.plan is not None:
            m.targets = dict(desired.plan.targets)
            before, m.plan = m.plan, desired.plan
            self.capacity_changed(key)
            m.engines = {r: list(e) for r, e in desired.engines.items()}
            m.limited = bool(desired.plan.shortfalls)
            self._release(key, before, desired.plan, "re-planned")
        return await self._write(api, key, body, obs, desired, owner)

    async def _gather(
        self, api: client.Api, key: Key, why: str, body: Mapping[str, Any]
    ) -> tuple[reconcile.Observed, bool]:
        meta = body.get("metadata") or {}
        dep = self.parse(key, body)
        refused = guardrails.host_path_problem(
            dep.spec, key[0], OPTIONS.host_path_prefixes, OPTIONS.host_path_namespaces
        )
        if refused:
            raise ValueError(refused)
        await self.sync(api, OPTIONS.namespaces)
        owner = render.Owner(dep.name, key[0], meta["uid"])
        monitoring = await self._monitoring_enabled(api)
        # The child kinds kopf watches come from its indexes (with our own writes over them); the monitoring kinds
        # and the revision history are listed.
        children = self.children(key, meta["uid"], api.last_of(*key))
        if monitoring:
            children += await client.list_children(api, owner, ("PodMonitor", "PrometheusRule"))
        stored = await client.list_revisions(api, owner)
        m = self.memory(key)
        now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
        if OPTIONS.namespaces:
            blind = await self.refresh_foreign(api, OPTIONS.namespaces, OPTIONS.foreign_pods_interval)
            m.extra_conditions["CapacityVisible"] = capacity_condition(
                blind, OPTIONS.namespaces, OPTIONS.foreign_pods_interval, dep.metadata.generation, now
            )
        config = next((c for c in children if c["kind"] == "ConfigMap"), None)
        obs = reconcile.Observed(
            dep=dep,
            uid=meta["uid"],
            resource_version=meta.get("resourceVersion"),
            annotations=dict(meta.get("annotations") or {}),
            classes=self.classes(),
            deleting=self.deleting(),
            nodes=self.nodes(),
            pods=self.pods(),
            children=children,
            stored=stored,
            served_record=revisions.served_record(config, owner),
            reserved=self.reservations(exclude=key),
            inputs=m.inputs(),
            now=now,
            why=why,
            router_cpu=cost.router_cores(dep.spec.router.resources.requests),
            worker_image=OPTIONS.worker_images.describe(),
            token_secret=render.auth_secret_name(key[1]),
        )
        return obs, monitoring

    async def _write(
        self,
        api: client.Api,
        key: Key,
        body: Mapping[str, Any],
        obs: reconcile.Observed,
        desired: reconcile.Desired,
        owner: render.Owner,
    ) -> Outcome:
        m = self.memory(key)
        writes_before = api.writes
        if desired.serving.remove_annotation:
            await api.remove_annotation("InferenceDeployment", key[0], key[1], rollback.ANNOTATION_ROLLBACK_TO)
        result = None
        new = desired.status
        if desired.plan is not None:
            stable = m.extra_status.get("stable_revision") or (
                obs.dep.status.stable_revision if obs.dep.status else None
            )
            for k in await revisions.record_superseded(api, owner, obs, desired.revision, stable, m.rollback.failed):
                exporter.API_WRITES.labels(k.split("/")[0]).inc()
            await self.tokens.ensure(api, key, owner, obs.dep.status)  # before the pods that mount it
            result = await client.apply_children(
                api,
                owner,
                list(desired.objects),
                list(obs.children),
                delete=desired.delete,
                untouched=desired.untouched,
            )
            result.drifted = {k: v for k, v in result.drifted.items() if m.rendered.get(k) == result.hashes[k]}
            m.rendered = dict(result.hashes)
            for k in result.applied + result.created + result.deleted:
                exporter.API_WRITES.labels(k.split("/")[0]).inc()
            assert new is not None
            if result.problems:
                new = reconcile.apply_failed(new, result.problems, obs.now, obs.dep.metadata.generation)
        written = False
        previous = reconcile.previous_status(obs)
        if new is not None and new.wire() != (previous.wire() if previous else {}):
            patched = await api.patch_status(key[0], key[1], new.wire())
            m.last_status = (new.wire(), obs.resource_version, (patched.get("metadata") or {}).get("resourceVersion"))
            exporter.API_WRITES.labels("InferenceDeployment/status").inc()
            written = True
        for notice in desired.notices + (reconcile.apply_notices(result, obs.why) if result is not None else ()):
            await api.event(body["metadata"], notice.type, notice.reason, notice.message)
        if desired.plan is not None:
            await class_protection.sync(api, self, desired.plan, obs)
            spec = desired.serving.spec
            exporter.bill(
                key[0],
                key[1],
                desired.plan,
                cost.running_cost(
                    [p for views in (self.indexes.get("pod_index") or {}).values() for p in views],
                    key[0],
                    key[1],
                    obs.classes,
                    router_cpu=obs.router_cpu,
                ),
                parse_duration(spec.slo.ttft),
                parse_duration(spec.slo.itl),
            )
        return Outcome(
            writes=api.writes - writes_before,
            plan=desired.plan,
            result=result,
            status_written=written,
            skipped="" if desired.plan is not None else f"held: {desired.serving.held}",
            desired=desired,
        )


def _renderer(owner: render.Owner, classes: Mapping[str, AcceleratorClassSpec], monitoring: bool) -> reconcile.Renderer:
    """`render.render` with this operator's settings, as the chain calls it."""

    def run(spec, plan, revision, surge):
        return render.render(
            owner,
            spec,
            plan,
            classes,
            revision=revision,
            monitoring=monitoring,
            scrapers=OPTIONS.scraper_namespaces,
            images=OPTIONS.worker_images,
            own_pod_monitor=OPTIONS.pod_monitors,
            surge=surge,
        )

    return run
