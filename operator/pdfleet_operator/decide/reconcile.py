"""The reconcile of one InferenceDeployment as a chain of pure stages: `Observed` in, `Desired` out; the
Kubernetes backend (`kube.reconciler`) gathers the one and writes the other.

    decide(observed, render):
      _serve      which revision is served (the rollback state machine: resume, roll forward, by hand, hold)
      _targets    replicas per role: the autoscaler's ask, else the last plan's, else what runs, else the minimum
      _ideal      placement from scratch on healthy nodes, this deployment's own units counted as free
      _step       make-before-break from what serves now towards the ideal (`transition.step`)
      _rollouts   how each pool rolls to a new template: surge, one down, a bridge replica elsewhere, or held
      _objects    the rendered children, held templates put back, what to delete and what to leave untouched
      _status     pools, conditions (Ready, Progressing, Degraded, ScalingLimited, PlacementDrift, RolloutBlocked)
      _events     what changed, said once

Every rule of issue 24 is a stage here and is unit-tested without a cluster; `kube.reconciler` applies only
what differs. Nothing here does I/O, reads a clock or mutates its inputs.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdfleet_operator.api import (
    ROLES,
    AcceleratorClassSpec,
    Condition,
    InferenceDeployment,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    names,
    set_condition,
)
from pdfleet_operator.decide import cost, drift, inventory, placement, rollback, runtimes, status, transition
from pdfleet_operator.decide.inventory import Reservation
from pdfleet_operator.decide.placement import FleetPlan, PlannedPool
from pdfleet_operator.decide.rollback import Notice
from pdfleet_operator.decide.transition import LivePool

Pool = tuple[str, str]
# Renders every child object: (spec served, plan, revision, pools that roll with a surge replica) -> objects.
Renderer = Callable[[InferenceDeploymentSpec, FleetPlan, int, Collection[Pool]], list[dict[str, Any]]]
ROLLOUT_BLOCKED = "RolloutBlocked"
PLACEMENT_DRIFT = "PlacementDrift"


@dataclass(frozen=True)
class Inputs:
    """What the operator process holds for the deployment between reconciles (its `DeploymentMemory`)."""

    desired: Mapping[str, int] | None = None  # the autoscaler's latest ask (total replicas per role)
    targets: Mapping[str, int] | None = None  # what the last plan was made for
    rollback: rollback.RollbackState = field(default_factory=rollback.RollbackState)
    extra_conditions: Mapping[str, Condition] = field(default_factory=dict)  # the autoscaler's and rollback's
    extra_status: Mapping[str, Any] = field(default_factory=dict)
    last_status: Mapping[str, Any] | None = None  # the status this process last wrote (the index may lag)
    last_status_version: str | None = None  # the CR's resourceVersion that write was made on
    rendered: Mapping[str, str] = field(default_factory=dict)  # child -> digest of what was last applied


@dataclass(frozen=True)
class Observed:
    """Everything one reconcile decides from, gathered once."""

    dep: InferenceDeployment  # spec and status as stored
    uid: str
    resource_version: str | None
    annotations: Mapping[str, str]
    classes: Mapping[str, AcceleratorClassSpec]  # every valid AcceleratorClass, those being deleted included
    deleting: frozenset[str]  # classes with a deletionTimestamp (held by the in-use finalizer)
    nodes: Sequence[Mapping[str, Any]]  # node views (`kube.handlers._node_view`)
    pods: Sequence[Mapping[str, Any]]  # pod views (`inventory.pod_view`) of every namespace seen
    children: Sequence[Mapping[str, Any]]  # the objects this deployment controls
    stored: Sequence[Mapping[str, Any]]  # its ControllerRevisions
    served_record: Mapping[str, Any] | None  # the revision its ConfigMap says is served, as a record
    reserved: Sequence[Reservation]  # what other deployments' pools hold or will hold
    inputs: Inputs
    now: dt.datetime
    why: str = "reconciled"  # what triggered this reconcile (for Events)
    router_cpu: float = cost.DEFAULT_ROUTER_CORES
    worker_image: str | None = None  # the operator's default pdfleet worker image (status)
    token_secret: str | None = None  # the token Secret the writer makes sure of before the status

    @property
    def key(self) -> tuple[str, str]:
        assert self.dep.metadata.namespace and self.dep.metadata.name, "a stored object has both"
        return (self.dep.metadata.namespace, self.dep.metadata.name)


@dataclass(frozen=True)
class Desired:
    """What one reconcile wants: the objects, the status, the Events and the process's new memory."""

    serving: rollback.Serving
    plan: FleetPlan | None  # None while held (the pools are left as they are)
    objects: tuple[dict[str, Any], ...] = ()  # to apply where the live object does not contain them
    delete: tuple[str, ...] = ()  # children ("Kind/name") to delete
    untouched: tuple[str, ...] = ()  # children neither applied nor deleted
    status: InferenceDeploymentStatus | None = None  # None: unchanged
    notices: tuple[Notice, ...] = ()
    engines: Mapping[str, list[str]] = field(default_factory=dict)  # role -> engines its planned pools run
    step: transition.Step | None = None
    blocked: tuple[str, ...] = ()  # pools whose rollout is held, with why

    @property
    def revision(self) -> int:
        return self.serving.revision


def decide(obs: Observed, render: Renderer) -> Desired:
    """The whole reconcile decision of one deployment."""
    serving = _serve(obs)
    if serving.held is not None:
        return _held(obs, serving)
    spec = serving.spec
    targets = _targets(obs, spec)
    usable, unusable = _usable(obs)
    ideal = _ideal(obs, spec, usable, targets)
    live = _live_pools(obs)
    free_now = _free_now(obs)
    step = _step(spec, ideal, live, free_now, obs, unusable, bridges={})
    plan = _plan(ideal, step)
    objects = _render(render, obs, serving, plan, live, free_now)
    bridges, held, blocked = _rollouts(obs, spec, ideal, plan, live, objects, free_now, usable)
    if bridges:
        step = _step(spec, ideal, live, free_now, obs, unusable, bridges=bridges)
        plan = _plan(ideal, step)
        objects = _render(render, obs, serving, plan, live, free_now)
    objects, delete, untouched = _objects(obs, objects, plan, live, held)
    new_status = _status(obs, serving, plan, step, blocked)
    notices = serving.notices + _notices(obs, new_status, plan, step, blocked, delete)
    engines = {
        role: sorted(
            {
                _engine(spec, obs.classes[p.accelerator_class])
                for p in plan.pools_for(role)
                if p.accelerator_class in obs.classes
            }
        )
        for role in plan.roles()
    }
    return Desired(
        serving,
        plan,
        tuple(objects),
        tuple(delete),
        tuple(untouched),
        new_status,
        notices,
        engines,
        step,
        tuple(blocked),
    )


# --- stages ---------------------------------------------------------------------------------------------------


def _serve(obs: Observed) -> rollback.Serving:
    return rollback.serve(
        obs.inputs.rollback,
        obs.dep,
        stored=obs.stored,
        served_record=obs.served_record,
        children=obs.children,
        annotation=obs.annotations.get(rollback.ANNOTATION_ROLLBACK_TO),
        resource_version=obs.resource_version,
        now=obs.now,
    )


def _held(obs: Observed, serving: rollback.Serving) -> Desired:
    """The revision a rollback serves cannot be rendered: touch no pool, page once (Degraded=True says it was said).

    NOTE: the page is said once per cluster, not per process: a Degraded condition already saying it
    means an earlier process posted the Event too."""
    message = serving.held
    assert message is not None
    page = Condition(
        type="Degraded",
        status="True",
        reason=rollback.REASON_REVISION_MISSING,
        message=message,
        last_transition_time=obs.now,
        observed_generation=obs.dep.metadata.generation,
    )
    said = rollback.condition(obs.dep.status, "Degraded")
    if said is not None and (said.status, said.reason, said.message) == (page.status, page.reason, page.message):
        return Desired(serving, None, notices=serving.notices)
    previous = obs.dep.status or InferenceDeploymentStatus()
    new = previous.model_copy(update={"conditions": set_condition(list(previous.conditions), page)})
    return Desired(
        serving,
        None,
        status=new,
        notices=serving.notices + (Notice("Warning", rollback.REASON_REVISION_MISSING, message),),
    )


def _targets(obs: Observed, spec: InferenceDeploymentSpec) -> dict[str, int] | None:
    """The autoscaler's latest ask; else what this process planned last (a hand-scaled pool is reverted);
    else, right after a restart, the role sizes the status reports (or the sizes the pools run), so a restart
    never resets what the autoscaler had decided; else None (each role's minimum)."""
    roles = spec.roles()
    if not obs.dep.spec.autoscaling.enabled:
        return None
    for source in (obs.inputs.desired, obs.inputs.targets):
        if source is not None:
            return {r: n for r, n in source.items() if r in roles}
    st = obs.dep.status
    if st is not None and st.decode_replicas is not None:
        # NOTE: the status's sizes leave out replicas kept during a hand-over, which the pools' sum counts.
        sized = (
            {"colocated": st.decode_replicas}
            if "colocated" in roles
            else {"prefill": st.prefill_replicas, "decode": st.decode_replicas}
        )
        if all(r in roles and n is not None for r, n in sized.items()):
            return {r: int(n) for r, n in sized.items() if n is not None}
    running: dict[str, int] = {}
    for c in obs.children:
        role = (c["metadata"].get("labels") or {}).get(names.LABEL_ROLE)
        if c["kind"] == "Deployment" and role in roles:
            running[role] = running.get(role, 0) + int((c.get("spec") or {}).get("replicas") or 0)
    return running or None


def _usable(obs: Observed) -> tuple[dict[str, AcceleratorClassSpec], dict[str, tuple[str, str]]]:
    """The classes placement may plan new replicas on, and why the others may not (being deleted)."""
    unusable = {
        name: (
            transition.CLASS_DELETED,
            f"AcceleratorClass {name} is being deleted (held by {names.FINALIZER_CLASS_IN_USE} until no pool uses it)",
        )
        for name in obs.deleting
    }
    return {n: c for n, c in obs.classes.items() if n not in unusable}, unusable


def _ideal(
    obs: Observed,
    spec: InferenceDeploymentSpec,
    usable: Mapping[str, AcceleratorClassSpec],
    targets: Mapping[str, int] | None,
) -> FleetPlan:
    """Placement from scratch: healthy nodes, this deployment's own units counted as free."""
    free = inventory.build(list(obs.nodes), list(obs.pods), exclude_deployment=obs.key, reserved=obs.reserved)
    return placement.plan(spec, usable, free, targets)


def _free_now(obs: Observed) -> inventory.Inventory:
    """Capacity free for new replicas now: this deployment's pods and its Deployments' unborn replicas hold theirs."""
    own = [
        Reservation(obs.key[0], obs.key[1], p.role, p.accelerator_class, obs.classes[p.accelerator_class], p.replicas)
        for p in _live_pools(obs)
        if p.accelerator_class in obs.classes
    ]
    return inventory.build(list(obs.nodes), list(obs.pods), reserved=list(obs.reserved) + own)


def _live_pools(obs: Observed) -> list[LivePool]:
    """This deployment's worker Deployments with their ready counts and where their pods run."""
    nodes = {n["metadata"]["name"]: n for n in obs.nodes}
    pods_by_pool: dict[Pool, list[Mapping[str, Any]]] = {}
    for p in obs.pods:
        meta = p.get("metadata") or {}
        labels = meta.get("labels") or {}
        if meta.get("namespace") != obs.key[0] or labels.get(names.LABEL_DEPLOYMENT) != obs.key[1]:
            continue
        role, acc = labels.get(names.LABEL_ROLE), labels.get(names.LABEL_ACCELERATOR)
        if role and acc and role != names.ROUTER_ROLE and not meta.get("deletionTimestamp"):
            pods_by_pool.setdefault((role, acc), []).append(p)
    out = []
    for c in obs.children:
        labels = c["metadata"].get("labels") or {}
        role, acc = labels.get(names.LABEL_ROLE), labels.get(names.LABEL_ACCELERATOR)
        if c["kind"] != "Deployment" or role in (None, names.ROUTER_ROLE) or acc is None:
            continue
        st = c.get("status") or {}
        why = []
        for p in pods_by_pool.get((role, acc), []):
            node_name = (p.get("spec") or {}).get("nodeName")
            if node_name:
                state = transition.node_state(nodes.get(node_name))
                if state is not None:
                    why.append(state)
        replicas = int((c.get("spec") or {}).get("replicas") or 0)
        generation, observed = c["metadata"].get("generation"), st.get("observedGeneration")
        stale = generation is not None and observed is not None and int(observed) < int(generation)
        rolling = stale or int(st.get("updatedReplicas") or 0) < replicas  # (the API omits zero counts)
        out.append(
            LivePool(
                c["metadata"]["name"],
                role,
                acc,
                replicas,
                int(st.get("readyReplicas") or 0),
                len(why),
                tuple(why),
                rolling,
            )
        )
    return out


def _step(
    spec: InferenceDeploymentSpec,
    ideal: FleetPlan,
    live: Sequence[LivePool],
    free_now: inventory.Inventory,
    obs: Observed,
    unusable: Mapping[str, tuple[str, str]],
    *,
    bridges: Mapping[Pool, int],
) -> transition.Step:
    wanted = {(p.role, p.accelerator_class): p.replicas for p in ideal.pools}
    for pool, n in bridges.items():
        wanted[pool] = wanted.get(pool, 0) + n
    ranking = {r: tuple(ideal.ranking.get(r, ())) for r in ideal.roles()}
    for role, c in bridges:
        if c not in ranking.get(role, ()):
            ranking[role] = ranking.get(role, ()) + (c,)
    minimums = {role: rs.min_replicas for role, rs in spec.roles().items()}
    holding = frozenset(p.role for p in live if p.rolling)
    return transition.step(
        dict(ideal.targets), minimums, wanted, ranking, live, free_now, obs.classes, unusable=unusable, holding=holding
    )


def _plan(ideal: FleetPlan, step: transition.Step) -> FleetPlan:
    """The ideal plan's targets, shortfalls and capacities with the pools the step runs."""
    order = {(r, c): i for i, (r, c) in enumerate((r, c) for r in ideal.roles() for c in ideal.ranking.get(r, ()))}
    pools = sorted(
        (PlannedPool(r, c, n) for (r, c), n in step.replicas.items() if n > 0),
        key=lambda p: (ROLES.index(p.role), order.get((p.role, p.accelerator_class), 1 << 20), p.accelerator_class),
    )
    return dataclasses.replace(ideal, pools=tuple(pools), reasons=ideal.reasons + step.moving + step.stuck)


def _render(
    render: Renderer,
    obs: Observed,
    serving: rollback.Serving,
    plan: FleetPlan,
    live: Sequence[LivePool],
    free_now: inventory.Inventory,
) -> list[dict[str, Any]]:
    """The children of the plan's pools whose class exists (a pool whose class is gone is left as it runs)."""
    renderable = dataclasses.replace(plan, pools=tuple(p for p in plan.pools if p.accelerator_class in obs.classes))
    surge = placement.surge_room(renderable, obs.classes, free_now, held={p.key: p.replicas for p in live})
    return render(serving.spec, renderable, serving.revision, surge)


def _rollouts(
    obs: Observed,
    spec: InferenceDeploymentSpec,
    ideal: FleetPlan,
    plan: FleetPlan,
    live: Sequence[LivePool],
    objects: Sequence[Mapping[str, Any]],
    free_now: inventory.Inventory,
    usable: Mapping[str, AcceleratorClassSpec],
) -> tuple[dict[Pool, int], set[str], list[str]]:
    """Rule 4, no rollout takes a pool to 0 Ready: for each pool whose pod template changes (or is still rolling)
    and that rolls one replica down (no room for a surge replica on its class), check that the role keeps another
    ready replica. If not: a bridge replica on another class the role allows (kept until the rollout ends); else
    the pool keeps its old template (`held`) and RolloutBlocked says why, unless the spec allows unavailability.

    Returns (bridge replicas per pool, held Deployment names, blocked messages)."""
    rendered = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    children = {c["metadata"]["name"]: c for c in obs.children if c["kind"] == "Deployment"}
    wanted = {(p.role, p.accelerator_class) for p in ideal.pools if p.replicas > 0}
    bridges: dict[Pool, int] = {}
    held: set[str] = set()
    blocked: list[str] = []
    spare = free_now
    for p in live:
        new, old = rendered.get(p.name), children.get(p.name)
        if new is None or old is None:
            continue
        changes = not drift.contains((old.get("spec") or {}).get("template"), new["spec"]["template"])
        if not changes and not p.rolling:
            continue
        strategy = new["spec"].get("strategy", {}).get("rollingUpdate", {})
        if strategy.get("maxSurge") == 1 and strategy.get("maxUnavailable") == 0:
            continue  # a surge replica fits: the pool never drops below its size
        if p.replicas >= 2 or p.ready == 0:
            continue  # one down of several keeps the rest serving; a pool that serves nothing has nothing to lose
        # Another replica of the role that serves, in a pool the plan keeps (a bridge counts once it serves).
        others = sum(q.ready for q in live if q.role == p.role and q.name != p.name)
        core = sum(q.ready for q in live if q.role == p.role and q.name != p.name and q.key in wanted)
        if core == 0:
            bridge = _bridge(p, plan, ideal, usable, spare)
            if bridge is not None:
                bridges[bridge] = bridges.get(bridge, 0) + 1
                spare, _ = spare.take(usable[bridge[1]], 1)
        if others > 0:
            continue
        if spec.rollout.allow_unavailable:
            continue
        if changes:
            held.add(p.name)
            via = (
                f"a bridge replica on {next(c for r, c in bridges if r == p.role)} is starting"
                if any(r == p.role for r, _ in bridges)
                else f"no room for a surge replica on {p.accelerator_class} nor on another class the role allows"
            )
            blocked.append(
                f"{p.name}: its only ready replica would go down to roll to revision "
                f"{_revision_of(new)}; {via} (set spec.rollout.allowUnavailable to roll anyway)"
            )
    return bridges, held, blocked


def _bridge(
    p: LivePool,
    plan: FleetPlan,
    ideal: FleetPlan,
    usable: Mapping[str, AcceleratorClassSpec],
    spare: inventory.Inventory,
) -> Pool | None:
    """Another class of the role with room for one replica now, in placement order."""
    for c in ideal.ranking.get(p.role, ()):
        if c != p.accelerator_class and c in usable and spare.take(usable[c], 1)[1]:
            return (p.role, c)
    return None


def _revision_of(obj: Mapping[str, Any]) -> str:
    return ((obj.get("metadata") or {}).get("labels") or {}).get(names.LABEL_REVISION, "?")


def _objects(
    obs: Observed, objects: list[dict[str, Any]], plan: FleetPlan, live: Sequence[LivePool], held: set[str]
) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """The rendered children, with held pools keeping their live template; the children to delete (a pool the
    plan runs with 0 replicas, anything no longer rendered); the children left untouched (a live pool whose class
    is gone: it cannot be rendered)."""
    children = {_key(c): c for c in obs.children}
    out = []
    for obj in objects:
        name = obj["metadata"]["name"]
        if obj["kind"] == "Deployment" and name in held:
            live_obj = children[_key(obj)]
            obj = {
                **obj,
                "metadata": {
                    **obj["metadata"],
                    "labels": dict(live_obj["metadata"].get("labels") or {}),
                    "annotations": {**(obj["metadata"].get("annotations") or {}), **_template_annotations(live_obj)},
                },
                "spec": {**obj["spec"], "template": live_obj["spec"]["template"]},
            }
        out.append(obj)
    rendered = {_key(o) for o in out}
    kept = {
        f"Deployment/{p.name}"
        for p in live
        if p.accelerator_class not in obs.classes
        and any(pp.role == p.role and pp.accelerator_class == p.accelerator_class for pp in plan.pools)
    }
    delete = sorted(k for k in children if k not in rendered and k not in kept)
    return out, delete, sorted(kept)


def _template_annotations(obj: Mapping[str, Any]) -> dict[str, str]:
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    return {k: v for k, v in annotations.items() if k in (names.ANNOTATION_TEMPLATE_HASH,)}


def _key(obj: Mapping[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def _engine(spec: InferenceDeploymentSpec, cls: AcceleratorClassSpec) -> str:
    return runtimes.engine_of(spec, cls)


def previous_status(obs: Observed) -> InferenceDeploymentStatus | None:
    """The status to compare with: our own last write when the CR as gathered does not show it yet."""
    if obs.inputs.last_status is not None and obs.resource_version == obs.inputs.last_status_version:
        return InferenceDeploymentStatus.model_validate(obs.inputs.last_status)
    return obs.dep.status


def _status(
    obs: Observed, serving: rollback.Serving, plan: FleetPlan, step: transition.Step, blocked: Sequence[str]
) -> InferenceDeploymentStatus:
    spec = serving.spec
    classes = {n: c for n, c in obs.classes.items()}
    plan_cost = cost.plan_cost(
        dataclasses.replace(plan, pools=tuple(p for p in plan.pools if p.accelerator_class in classes)),
        classes,
        router_replicas=spec.router.replicas,
        router_cpu=obs.router_cpu,
    )
    ready = {
        c["metadata"]["name"]: int((c.get("status") or {}).get("readyReplicas") or 0)
        for c in obs.children
        if c["kind"] == "Deployment"
    }
    seen = status.Observed(
        ready=ready,
        router_ready=ready.get(names.router_name(obs.key[1]), 0),
        drift=step.drift,
        moving=step.moving,
        stuck=step.stuck,
        blocked=tuple(blocked),
    )
    extra = dict(obs.inputs.extra_conditions)
    for c in serving.conditions:
        extra[c.type] = c
    for t in serving.cleared:
        extra.pop(t, None)
    new = status.compute(
        name=obs.key[1],
        namespace=obs.key[0],
        plan=plan,
        cost=plan_cost,
        observed=seen,
        previous=previous_status(obs),
        generation=obs.dep.metadata.generation,
        revision=serving.revision,
        router_replicas=spec.router.replicas,
        now=obs.now,
        extra_conditions=list(extra.values()),
        worker_image=spec.engine.image or obs.worker_image,
    )
    fields = {**obs.inputs.extra_status, **serving.fields, "token_secret": obs.token_secret}
    return new.model_copy(update=fields)


def _notices(
    obs: Observed,
    new: InferenceDeploymentStatus,
    plan: FleetPlan,
    step: transition.Step,
    blocked: Sequence[str],
    delete: Sequence[str],
) -> tuple[Notice, ...]:
    """Events for what changed since the previous status (each said once)."""
    previous = previous_status(obs)
    out: list[Notice] = []

    def pools(st: InferenceDeploymentStatus | None) -> list[tuple[str, str, int]]:
        return [(p.role, p.accelerator_class, p.desired) for p in (st.pools if st else [])]

    before, after = pools(previous), pools(new)
    old_cost = previous.cost_per_hour if previous else None
    why = obs.why
    if before != after or (old_cost is not None and old_cost != new.cost_per_hour):
        desc = ", ".join(f"{r} {n}x{a}" for r, a, n in after) or "no pools"
        reason = "Planned" if previous is None or not previous.pools else "Replanned"
        out.append(
            Notice(
                "Normal",
                reason,
                f"{why}: {desc}, ${new.cost_per_hour:.2f}/h, P:D {new.pd_ratio}"
                + "".join(f"; {m}" for m in step.moving),
            )
        )
    retired = [k.split("/", 1)[1] for k in delete if k.startswith("Deployment/")]
    if retired:
        out.append(Notice("Normal", "PoolRetired", f"deleted {', '.join(retired)} ({why})"))
    for type_, reason in (
        (PLACEMENT_DRIFT, "PlacementDrift"),
        (ROLLOUT_BLOCKED, ROLLOUT_BLOCKED),
        ("ScalingLimited", "ScalingLimited"),
    ):
        was, now = rollback.condition(previous, type_), rollback.condition(new, type_)
        if (
            now is not None
            and now.status == "True"
            and (was is None or was.status != "True" or was.message != now.message)
        ):
            out.append(Notice("Warning", reason, now.message or ""))
    return tuple(out)


def apply_failed(
    new: InferenceDeploymentStatus, problems: Sequence[str], now: dt.datetime, generation: int | None
) -> InferenceDeploymentStatus:
    """The status once some children could not be applied (a name taken by another owner, a rejection)."""
    failed = Condition(
        type="Degraded",
        status="True",
        reason="ApplyFailed",
        message="; ".join(problems)[:32000],
        last_transition_time=now,
        observed_generation=generation,
    )
    return new.model_copy(update={"conditions": set_condition(list(new.conditions), failed)})


def apply_notices(result: Any, why: str) -> tuple[Notice, ...]:
    """Events for what writing found: children edited by hand (reverted), children that could not be applied.
    `result`: a `kube.client.ApplyResult` (drifted: child -> fields; problems)."""
    out = []
    if result.drifted:
        out.append(
            Notice(
                "Normal",
                "DriftReverted",
                "; ".join(f"{k} ({', '.join(v[:4])})" for k, v in result.drifted.items()) + f" ({why})",
            )
        )
    if result.problems:
        out.append(Notice("Warning", "ApplyFailed", "; ".join(result.problems)))
    return tuple(out)
