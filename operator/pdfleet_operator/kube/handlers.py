"""kopf handlers: thin triggers into the one reconcile path per InferenceDeployment (run by `pdfleet operator`).

Each handler turns a watch event into `RECONCILER.request(key, why)` or `reconcile(...)` (see
`kube.reconciler`), keeps kopf's indexes for it, or forgets a deleted deployment. kopf is imported here,
in `operator_cli` (which runs it) and in `client` (its login credentials). Indexes: kopf fills each from its
own watch stream while handlers already run, so the first reconcile of a process waits until the class,
node and child indexes hold what the API lists (`indexes.Cluster.sync`): a plan or status made from a
partial view would move serving pools or call them not ready.

NOTE: kopf's own bookkeeping (last-handled configuration, handler progress) is kept in memory, not
in annotations: it would cost a write per change on every CR. After a restart every CR is "created"
again, which runs the same idempotent reconcile; kopf still writes its touch annotation to retry a
handler that raised TemporaryError.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import logging
from collections.abc import Mapping
from typing import Any

import kopf
import pydantic
from aiohttp import web

from pdfleet_operator.api import GROUP, VERSION, AcceleratorClass, AcceleratorClassSpec
from pdfleet_operator.api.names import LABEL_DEPLOYMENT
from pdfleet_operator.decide import inventory, status
from pdfleet_operator.decide.rollback import ANNOTATION_ROLLBACK_TO
from pdfleet_operator.kube import (
    alertmanager,
    class_protection,
    class_status,
    client,
    exporter,
    loops,
    render,
    token_secret,
)
from pdfleet_operator.kube.indexes import CHILD_INDEXES, pool_view
from pdfleet_operator.kube.options import OPTIONS, Options  # noqa: F401 (`pdfleet operator` sets OPTIONS)
from pdfleet_operator.kube.reconciler import Key, Reconciler, Template  # noqa: F401 (tests reach them here)
from pdfleet_operator.kube.token_secret import ANNOTATION_RECREATE_TOKEN

logger = logging.getLogger("pdfleet.operator")
MANAGED = {"app.kubernetes.io/managed-by": render.MANAGER}
MANAGED_SELECTOR = ",".join(f"{k}={v}" for k, v in MANAGED.items())
# (group, version, plural) of every child kind the operator watches; each watch is label-selected server-side.
CHILD_WATCHES = (
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("networking.k8s.io", "v1", "networkpolicies"),
    ("policy", "v1", "poddisruptionbudgets"),
)


# The kinds with create/update/resume/delete handlers (kopf's diff base is built for these only).
CHANGING_KINDS = ("InferenceDeployment",)


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

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        """kopf's essence of an InferenceDeployment (what on_update compares), computed from the body without the
        status and system metadata; nothing for the other kinds.

        NOTE: kopf builds the essence of every event of every watched kind, deep-copying the whole body first
        (a child Deployment with its pod template, a CR with its status), though only kinds with create/update/
        delete handlers (`CHANGING_KINDS`) or daemons (none) read it. At 500 CRs the copies were a tenth of the
        operator's CPU. kopf drops the status and all metadata but labels and annotations anyway, so dropping them
        before its copy gives the same essence."""
        if body.get("kind") not in (None, *CHANGING_KINDS):
            return {}
        if extra_fields:
            return super().build(body=body, extra_fields=extra_fields)
        meta = body.get("metadata") or {}
        slim = {k: v for k, v in body.items() if k not in ("metadata", "status")}
        slim["metadata"] = {k: meta[k] for k in ("labels", "annotations") if k in meta}
        return super().build(body=slim)


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
    # The children's kinds are watched (and listed) through a server-side label selector: the API server sends
    # only objects labelled as ours, not every ConfigMap, Service, Deployment, PDB and NetworkPolicy of the
    # cluster (kopf's `labels=` on a handler filters client-side, after the whole stream arrived).
    # NOTE: Pods and Nodes stay unfiltered: the capacity inventory needs every pod on a node, whoever owns it.
    for group, version, plural in CHILD_WATCHES:
        settings.watching.label_selectors[group, version, plural] = MANAGED_SELECTOR
    # NOTE: no worker limit: kopf keeps one worker per object alive for idle_timeout after its last
    # event, so a limit of W caps throughput at W objects per idle_timeout (64 per 5 s was the
    # bottleneck of bench/operator.py). Workers are asyncio tasks; a shorter idle time frees them sooner.
    settings.queueing.idle_timeout = 1.0
    RECONCILER.autoscaling = OPTIONS.autoscaler
    RECONCILER.analysis = OPTIONS.analysis_interval > 0
    if OPTIONS.alertmanager_port is not None:
        runner = web.AppRunner(alertmanager.make_app(_on_alert, OPTIONS.alertmanager_token), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, OPTIONS.alertmanager_host, OPTIONS.alertmanager_port).start()
        RECONCILER.indexes["_alertmanager_runner"] = runner
    if OPTIONS.metrics_port is not None:
        RECONCILER.indexes["_metrics_runner"] = await exporter.serve(OPTIONS.metrics_host, OPTIONS.metrics_port)
    if OPTIONS.resync_interval > 0:
        RECONCILER.indexes["_resync"] = asyncio.get_running_loop().create_task(_resync_loop())
    if OPTIONS.class_status_interval > 0:
        RECONCILER.indexes["_class_status"] = asyncio.get_running_loop().create_task(_class_status_loop())


async def _on_alert(trigger: alertmanager.RollbackTrigger) -> None:
    """A pdfleet rollback alert from Alertmanager (the receiver calls this): analyse now."""
    exporter.ALERT_TRIGGERS.inc()
    await loops.on_alert(RECONCILER, trigger)


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
    for t in list(RECONCILER._tasks):
        t.cancel()
    for m in RECONCILER.deployments.values():
        m.stop()
    if RECONCILER.api is not None:
        await RECONCILER.api.close()


async def _class_status_loop() -> None:
    """AcceleratorClass status (nodes, allocatable, free units) every --class-status-interval seconds."""
    writer = class_status.ClassStatusWriter()
    while True:
        api = RECONCILER.api
        if api is not None and RECONCILER.indexed:  # (usedBy and releases need the complete pool index)
            try:
                await RECONCILER.sync(api, OPTIONS.namespaces)
                for _ in await writer.sync(
                    api, RECONCILER.nodes(), RECONCILER.pods(), class_protection.users(RECONCILER)
                ):
                    exporter.API_WRITES.labels("AcceleratorClass/status").inc()
                await class_protection.release(api, RECONCILER)
            except client.ApiError as exc:
                logger.warning(
                    "AcceleratorClass status round failed: %s; next in %ss", exc, OPTIONS.class_status_interval
                )
            except Exception:  # NOTE: a bug here must not end the loop (or the operator)
                logger.exception("AcceleratorClass status round failed")
        await asyncio.sleep(OPTIONS.class_status_interval if api is not None and RECONCILER.indexed else 0.2)


async def _resync_loop() -> None:
    """Every deployment again, `--resync-interval` after the previous round finished: a round that takes
    longer than the interval (a large fleet, a slow API server) does not stack the next one on top."""
    while True:
        await asyncio.sleep(OPTIONS.resync_interval)
        done = await asyncio.gather(
            *(RECONCILER._background(key, "periodic resync") for key in sorted(RECONCILER.bodies())),
            return_exceptions=True,
        )
        for failed in (d for d in done if isinstance(d, Exception)):
            logger.error("periodic resync: %r", failed)


# Indexes: kopf fills them before any resource handler runs, so the first plan after a start sees the
# whole cluster (an empty inventory would scale everything down).


# NOTE: every index function is `async def` though none awaits: kopf runs a plain function in its thread-pool
# executor, a thread hop and a future per call, and each child event calls two of them (at 500 CRs that hopping
# was a fifth of the operator's CPU). They read the body and return at once, so they run on the event loop.
@kopf.index(GROUP, VERSION, "acceleratorclasses")
async def class_meta_index(name: str, body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]]:
    return {name: class_protection.meta_view(body)}


@kopf.index("apps", "v1", "deployments")
async def pool_index(body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]] | None:
    """Every worker pool Deployment pdfleet manages (the watch is label-selected server-side), its `indexes.pool_view`
    under (namespace, its InferenceDeployment): a reconcile reads one deployment's pools without walking all."""
    view = pool_view(body)
    return None if view is None else {(view["namespace"], view["deployment"]): view}


def _child_view(body: kopf.Body) -> dict[tuple[str, str], dict[str, Any]] | None:
    """A child of an InferenceDeployment, whole, under (namespace, its deployment label); the watches of the child
    kinds are label-selected server-side, so only objects labelled managed-by pdfleet arrive here."""
    meta = body.get("metadata") or {}
    owner = (meta.get("labels") or {}).get(render.LABEL_DEPLOYMENT)
    if not owner:
        return None
    return {(meta.get("namespace"), owner): json.loads(json.dumps(dict(body)))}


def _index_children(group: str, version: str, plural: str, name: str) -> None:
    """Declare kopf's index `name` of one child kind (the names `indexes.CHILD_INDEXES` reads)."""

    async def index(body: kopf.Body, **_: Any) -> dict[tuple[str, str], dict[str, Any]] | None:
        return _child_view(body)

    kopf.index(group, version, plural, id=name)(index)


for (_group, _version, _plural), _kind in zip(
    CHILD_WATCHES, ("Deployment", "Service", "ConfigMap", "NetworkPolicy", "PodDisruptionBudget"), strict=True
):
    _index_children(_group, _version, _plural, CHILD_INDEXES[_kind])


@kopf.index(GROUP, VERSION, "acceleratorclasses")
async def class_index(
    name: str, body: kopf.Body, logger: logging.Logger, **_: Any
) -> dict[str, AcceleratorClassSpec] | None:
    try:
        return {
            name: AcceleratorClass.model_validate(
                {"metadata": {"name": name}, "spec": dict(body.get("spec") or {})}
            ).spec
        }
    except pydantic.ValidationError as exc:
        logger.error("AcceleratorClass %s is invalid and ignored: %s", name, exc)
        return None


@kopf.index("", "v1", "nodes")
async def node_index(name: str, body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]]:
    return {name: _node_view(body)}


@kopf.index("", "v1", "pods")
async def pod_index(body: kopf.Body, **_: Any) -> dict[str, dict[str, Any]] | None:
    view = inventory.pod_view(body)
    return None if view is None else {view["spec"].get("nodeName") or inventory.UNBOUND: view}


@kopf.index(GROUP, VERSION, "inferencedeployments")
async def infdep_index(namespace: str, name: str, body: kopf.Body, **kwargs: Any) -> dict[Key, dict[str, Any]]:
    RECONCILER.keep(kwargs)
    return {(namespace, name): json.loads(json.dumps(dict(body)))}


def _keep_indexes(kwargs: Mapping[str, Any]) -> None:
    """Every resource handler's first step. NOTE: kopf runs resource handlers only once every index holds its initial
    listing, so from the first handler on the indexes are complete (`RECONCILER.indexed`)."""
    RECONCILER.keep(kwargs)
    RECONCILER.indexed = True


def _node_view(body: Mapping[str, Any]) -> dict[str, Any]:
    meta, spec, st = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    return {
        "metadata": {"name": meta.get("name"), "labels": dict(meta.get("labels") or {})},
        "spec": {"taints": list(spec.get("taints") or []), "unschedulable": bool(spec.get("unschedulable"))},
        "status": {
            "allocatable": dict(st.get("allocatable") or {}),
            "conditions": [c for c in st.get("conditions") or [] if c.get("type") == "Ready"][:1],
        },
    }


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


# --- the InferenceDeployment itself --------------------------------------------------------------------------


async def _reconcile_from_handler(
    namespace: str, name: str, body: kopf.Body, why: str, kwargs: Mapping[str, Any]
) -> None:
    _keep_indexes(kwargs)
    try:
        outcome = await RECONCILER.reconcile((namespace, name), why, body=json.loads(json.dumps(dict(body))))
    except pydantic.ValidationError as exc:
        raise kopf.PermanentError(f"invalid spec: {exc}") from exc
    except ValueError as exc:
        # NOTE: what admission cannot see (rules across objects, e.g. `decide.runtimes` reading the classes) is
        # refused here: said once per change of the CR as a Warning Event, for `kubectl describe` to show.
        await _say_invalid(body, str(exc))
        raise kopf.PermanentError(str(exc)) from exc
    except client.ApiError as exc:
        if exc.heals:
            raise kopf.TemporaryError(f"API server: {exc}", delay=5) from exc
        raise kopf.PermanentError(f"API server rejected a request: {exc}") from exc
    logger.debug("%s/%s reconciled (%s): %s", namespace, name, why, outcome)
    m = RECONCILER.known((namespace, name))
    if m is not None and m.plan is not None:
        loops.start(RECONCILER, (namespace, name), m)


async def _say_invalid(body: kopf.Body, message: str) -> None:
    api = RECONCILER.api
    if api is None:
        return
    meta = body["metadata"]
    conditions = status.refused(
        body.get("status"), message, meta.get("generation"), dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    )
    try:
        await api.event(meta, "Warning", "InvalidSpec", message)
        if conditions is not None:  # (`kubectl get infdep` shows it, not only `kubectl describe`)
            await api.patch_status(meta["namespace"], meta["name"], {"conditions": conditions})
    except client.ApiError as exc:
        logger.warning("could not report the InvalidSpec of %s/%s: %s", meta.get("namespace"), meta.get("name"), exc)


@kopf.on.create(GROUP, VERSION, "inferencedeployments")
async def on_create(namespace: str, name: str, body: kopf.Body, **kwargs: Any) -> None:
    await _reconcile_from_handler(namespace, name, body, "created", kwargs)


@kopf.on.update(GROUP, VERSION, "inferencedeployments")
async def on_update(namespace: str, name: str, body: kopf.Body, **kwargs: Any) -> None:
    await _reconcile_from_handler(namespace, name, body, "spec changed", kwargs)


@kopf.on.resume(GROUP, VERSION, "inferencedeployments")
async def on_resume(namespace: str, name: str, body: kopf.Body, **kwargs: Any) -> None:
    await _reconcile_from_handler(namespace, name, body, "operator started", kwargs)


@kopf.on.event(GROUP, VERSION, "inferencedeployments", annotations={ANNOTATION_ROLLBACK_TO: kopf.PRESENT})
async def on_rollback_annotation(namespace: str, name: str, event: Mapping[str, Any], **kwargs: Any) -> None:
    """`pdfleet.io/rollback-to=N` set by hand. NOTE: an on.event handler, because kopf leaves annotations under
    its own storage prefix (pdfleet.io) out of the essence that on.update compares."""
    _keep_indexes(kwargs)
    if event.get("type") in (None, "ADDED", "MODIFIED"):
        RECONCILER.request((namespace, name), f"annotation {ANNOTATION_ROLLBACK_TO}")


@kopf.on.event(GROUP, VERSION, "inferencedeployments", annotations={ANNOTATION_RECREATE_TOKEN: kopf.PRESENT})
async def on_recreate_token_annotation(
    namespace: str, name: str, body: kopf.Body, event: Mapping[str, Any], **kwargs: Any
) -> None:
    """`pdfleet.io/recreate-token` set by hand after deleting the token Secret (rotation): a new Secret with a fresh
    token now, not at the next new pod; the annotation is removed once acted on."""
    _keep_indexes(kwargs)
    api = RECONCILER.api
    if event.get("type") not in (None, "ADDED", "MODIFIED") or api is None:
        return
    key = (namespace, name)
    created = await RECONCILER.tokens.check(
        api, key, render.Owner(name, namespace, body["metadata"]["uid"]), f"annotation {ANNOTATION_RECREATE_TOKEN}"
    )
    secret = render.auth_secret_name(name)
    await api.event(
        body["metadata"],
        "Normal",
        "TokenSecretCreated" if created else "TokenSecretKept",
        f"created Secret {secret} with a new token"
        if created
        else f"Secret {secret} exists: its token is kept (delete the Secret first to rotate it)",
    )
    await api.remove_annotation("InferenceDeployment", namespace, name, ANNOTATION_RECREATE_TOKEN)


@kopf.on.delete(GROUP, VERSION, "inferencedeployments", optional=True)
async def on_delete(namespace: str, name: str, **_: Any) -> None:
    """Children go with the CR by garbage collection (ownerReferences); only this process's memory is ours."""
    RECONCILER.forget((namespace, name))


# --- what else re-plans a deployment --------------------------------------------------------------------------


@kopf.on.event(GROUP, VERSION, "acceleratorclasses")
async def on_class_event(name: str, body: kopf.Body, event: Mapping[str, Any], **kwargs: Any) -> None:
    _keep_indexes(kwargs)
    RECONCILER.capacity_changed()  # every holding names its class's spec
    spec = dict(body.get("spec") or {})
    deleting = bool((body.get("metadata") or {}).get("deletionTimestamp"))
    before = RECONCILER.class_specs.get(name)
    was_deleting = name in RECONCILER.deleting_classes
    if event.get("type") == "DELETED":
        RECONCILER.class_specs.pop(name, None)
        RECONCILER.deleting_classes.discard(name)
        why = f"AcceleratorClass {name} deleted"
    else:
        RECONCILER.class_specs[name] = spec
        if deleting:
            RECONCILER.deleting_classes.add(name)
        if event.get("type") is None or (before == spec and deleting == was_deleting):
            return  # the initial listing, or no change of the spec
        if deleting and not was_deleting:
            why = f"AcceleratorClass {name} is being deleted: its pools move to other classes"
            if RECONCILER.api is not None:
                await class_protection.release(RECONCILER.api, RECONCILER)  # nothing runs on it: it goes at once
        elif before is None:
            why = f"AcceleratorClass {name} created"
        else:
            changed = sorted(k for k in set(before) | set(spec) if before.get(k) != spec.get(k))
            why = f"AcceleratorClass {name} changed: " + ", ".join(
                f"{k} {before.get(k)!r} -> {spec.get(k)!r}"
                if k in ("costPerHour", "count", "memoryGiB", "peakTflops", "memoryBandwidthGBps", "resourceName")
                else k
                for k in changed
            )
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
    free = ", ".join(
        f"{view['status']['allocatable'].get(c.resource_name, 0)} {c.resource_name}"
        for c in sorted({c.resource_name: c for c in affected.values()}.values(), key=lambda c: c.resource_name)
    )
    for key in RECONCILER.keys_using(set(affected)):
        RECONCILER.request(key, f"{what} ({free} allocatable)")


def _classes_on(view: dict[str, Any]) -> dict[str, AcceleratorClassSpec]:
    """The classes whose pods could land on this node (selector, taints) and whose resource it advertises."""
    node = inventory.NodeInventory(view["metadata"]["name"], view["metadata"]["labels"], inventory.taints_of(view), {})
    allocatable = view["status"]["allocatable"]
    return {n: c for n, c in RECONCILER.classes().items() if node.admits(c) and c.resource_name in allocatable}


@kopf.on.event("", "v1", "pods")
async def on_pod_event(body: kopf.Body, event: Mapping[str, Any], **kwargs: Any) -> None:
    """A finished or deleted pod (bound or Pending) frees its accelerators: re-plan the deployments that were short."""
    _keep_indexes(kwargs)
    if event.get("type") == "ADDED":
        await _new_pod_needs_the_token(body)
    limited = RECONCILER.limited()
    if event.get("type") is None or not limited:
        return
    # (a Pending pod that goes frees what the inventory counted it for, as a bound one does)
    gone = event.get("type") == "DELETED" or (body.get("status") or {}).get("phase") in inventory.FINISHED_PHASES
    if not gone:
        return
    freed = {k for k in inventory.pod_requests(dict(body)) if k not in ("memory", "pods", "ephemeral-storage")}
    classes = RECONCILER.classes()
    for key in limited:
        spec = (RECONCILER.body(key) or {}).get("spec") or {}
        listed = {
            c for r in ("prefill", "decode", "colocated") for c in (spec.get(r) or {}).get("acceleratorClasses", [])
        }
        if any(classes[c].resource_name in freed for c in listed if c in classes):
            RECONCILER.request(
                key,
                f"pod {body['metadata'].get('namespace')}/{body['metadata'].get('name')} freed "
                + ", ".join(sorted(freed)),
            )


async def _new_pod_needs_the_token(body: kopf.Body) -> None:
    """A new pod of a deployment mounts its token Secret: create the Secret if it went missing (an admin deleted it),
    at most once a minute per deployment, so the pod does not wait to mount it forever."""
    meta = body.get("metadata") or {}
    owner = (meta.get("labels") or {}).get(LABEL_DEPLOYMENT)
    key = (meta.get("namespace"), owner)
    dep = RECONCILER.body(key) if owner else None
    if dep is None or RECONCILER.api is None:
        return
    try:
        await RECONCILER.tokens.check(
            RECONCILER.api,
            key,
            render.Owner(owner, key[0], dep["metadata"]["uid"]),
            f"new pod {meta.get('name')}",
            at_most_every=token_secret.AUTH_SECRET_CHECK_S,
        )
    except client.ApiError as exc:
        logger.warning("could not check the token Secret of %s/%s: %s", *key, exc)


CHILD_EVENT_GATHER_S = 0.2


def _on_child_event(kind: str, body: kopf.Body, event: Mapping[str, Any], kwargs: Mapping[str, Any]) -> None:
    _keep_indexes(kwargs)
    meta = body.get("metadata") or {}
    owner = (meta.get("labels") or {}).get(render.LABEL_DEPLOYMENT)
    key = (meta.get("namespace"), owner)
    if owner and event.get("type") == "DELETED":
        RECONCILER.child_gone(key, kind, meta.get("name"))
    elif owner and kind == "Deployment":
        RECONCILER.capacity_changed(key)  # (after kopf's pool index took the event in)
    if event.get("type") is None:
        return
    if not owner or RECONCILER.body(key) is None:
        return
    api = RECONCILER.api
    if api is not None and api.is_own_write(
        kind,
        meta.get("namespace"),
        meta.get("name"),
        client.DELETED if event.get("type") == "DELETED" else meta.get("resourceVersion"),
    ):
        return  # the echo of our own write or delete
    if api is not None and event.get("type") == "DELETED":
        # Deleted by someone else: what our last apply returned must not stand in for it any more.
        api.last.pop((kind, meta.get("namespace") or "", meta.get("name")), None)
    # NOTE: gathered: a pool's Deployments become ready (or are edited) in bursts; one reconcile and one status write
    # per burst, not one per Deployment (500 CRs went Ready in 67 s with 5 status writes each before this).
    RECONCILER.request(key, f"{kind} {meta.get('name')} {str(event.get('type')).lower()}", gather=CHILD_EVENT_GATHER_S)


# NOTE: no kopf `labels=` filter on these (the server-side selector in `configure` sends only our objects): a child
# whose managed-by label is removed by hand arrives as DELETED without the label, and must still re-plan its owner.
@kopf.on.event("apps", "v1", "deployments")
async def on_deployment_event(body: kopf.Body, event: Mapping[str, Any], **kwargs: Any) -> None:
    _on_child_event("Deployment", body, event, kwargs)
    if event.get("type") == "DELETED" and RECONCILER.deleting() and RECONCILER.api is not None:
        await class_protection.release(RECONCILER.api, RECONCILER)  # its class may have lost its last pool


@kopf.on.event("", "v1", "services")
async def on_service_event(body: kopf.Body, event: Mapping[str, Any], **kwargs: Any) -> None:
    _on_child_event("Service", body, event, kwargs)


@kopf.on.event("", "v1", "configmaps")
async def on_configmap_event(body: kopf.Body, event: Mapping[str, Any], **kwargs: Any) -> None:
    _on_child_event("ConfigMap", body, event, kwargs)


@kopf.on.event("networking.k8s.io", "v1", "networkpolicies")
async def on_networkpolicy_event(body: kopf.Body, event: Mapping[str, Any], **kwargs: Any) -> None:
    _on_child_event("NetworkPolicy", body, event, kwargs)


@kopf.on.event("policy", "v1", "poddisruptionbudgets")
async def on_pdb_event(body: kopf.Body, event: Mapping[str, Any], **kwargs: Any) -> None:
    _on_child_event("PodDisruptionBudget", body, event, kwargs)
