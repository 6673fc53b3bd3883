"""The emulator itself: :class:`KubernetesApiEmulator`, kmock's ``KubernetesEmulator`` with the store, registry,
admission, verbs, RBAC, HTTP, discovery, tables and watches of this package mixed in, its clock, the opt-in
controllers of :mod:`tests.support.k8s.workloads` and the helpers tests call on its loop."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import attrs
import kmock

from tests.support.k8s import workloads as k8s_workloads
from tests.support.k8s.admission import AdmissionMixin
from tests.support.k8s.clock import Clock
from tests.support.k8s.discovery import DiscoveryMixin
from tests.support.k8s.errors import ApiError
from tests.support.k8s.eviction import EvictionMixin
from tests.support.k8s.http import HttpMixin
from tests.support.k8s.rbac import RbacMixin, Requester
from tests.support.k8s.registry import RegistryMixin
from tests.support.k8s.requestlog import LoggedRequest
from tests.support.k8s.resources import ApiResource, builtin_resources
from tests.support.k8s.store import DEFAULT_NAMESPACES, Event, Objects, StoreMixin
from tests.support.k8s.tables import TablesMixin
from tests.support.k8s.verbs import VerbsMixin
from tests.support.k8s.watches import WatchesMixin


@attrs.define(kw_only=True)
class KubernetesApiEmulator(
    StoreMixin,
    RegistryMixin,
    AdmissionMixin,
    VerbsMixin,
    EvictionMixin,
    RbacMixin,
    HttpMixin,
    DiscoveryMixin,
    TablesMixin,
    WatchesMixin,
    kmock.KubernetesEmulator,
):
    """A stateful Kubernetes API for tests. See the package docstring (:mod:`tests.support.k8s`) for what it does and
    does not do.

    User-defined kmock reactions (``emulator['get', kmock.resource(...)] << 500``) still take
    precedence, which lets a test inject failures; everything else is served from the emulated state.
    All state changes happen on the server's event loop; use :class:`EmulatorThread` ``.call()``
    from other threads.
    """

    auto_create_namespaces: bool = False
    # The emulator's time (wall clock + an offset `advance` moves): timestamps, due evictions and grace periods.
    clock: Clock = attrs.field(factory=Clock)
    # bearer token -> who it authenticates as; requests with one of these tokens are authorized by the RBAC objects
    # stored in the emulator (403 Forbidden as on a cluster), any other request is the tests' administrator.
    users: dict[str, Requester] = attrs.field(factory=dict)
    _rbac_rules: dict[tuple[Requester, str | None], list[dict]] = attrs.field(factory=dict, init=False)  # cache

    _api: dict[tuple[str, str, str], ApiResource] = attrs.field(factory=dict, init=False)
    _store: Objects = attrs.field(factory=Objects, init=False)
    _uids: dict[str, tuple[str, str, str, str]] = attrs.field(factory=dict, init=False)
    _applied: dict[tuple[str, str, str, str], dict[str, dict]] = attrs.field(factory=dict, init=False)
    _rv: int = attrs.field(default=1, init=False)
    _events: list[Event] = attrs.field(factory=list, init=False)
    _compacted_rv: int = attrs.field(default=0, init=False)
    _watchers: set[asyncio.Queue] = attrs.field(factory=set, init=False)
    log: list[LoggedRequest] = attrs.field(factory=list, init=False)
    # The opt-in controllers (`enable_workloads`): None while off.
    workloads: k8s_workloads.Workloads | None = attrs.field(default=None, init=False)
    _workloads_state: list[bool] = attrs.field(factory=lambda: [False, False], init=False)  # [due, running]
    _timer: asyncio.TimerHandle | None = attrs.field(default=None, init=False)  # the controllers' next due time

    def __attrs_post_init__(self) -> None:
        # Deliberately not calling kmock's post-init: its stateless fallbacks are replaced by _serve().
        for res in builtin_resources():
            self._api[(res.group, res.version, res.plural)] = res
        for ns in DEFAULT_NAMESPACES:
            self._create(
                self.resource_for("", "v1", "namespaces"),
                None,
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
            )

    # ---- controllers (opt-in: tests.support.k8s.workloads) and time -----------------------------

    def enable_workloads(self, *, graceful_termination: bool | None = None) -> k8s_workloads.Workloads:
        """Turn on the controllers of :mod:`tests.support.k8s.workloads` (Deployments, ReplicaSets, scheduler,
        kubelet, node lifecycle, pod GC, disruption budgets); returns them. `graceful_termination`: see there."""
        if self.workloads is None:
            self.workloads = k8s_workloads.Workloads(self)
        if graceful_termination is not None:
            self.workloads.graceful_termination = graceful_termination
        self.run_workloads()
        return self.workloads

    def _workloads_due(self) -> None:
        state = self._workloads_state
        if state[0]:
            return
        state[0] = True
        if state[1]:
            return  # the running pass goes round once more
        try:
            # (in a fresh context: the controllers act as themselves, not as the requester RBAC authorized)
            asyncio.get_running_loop().call_soon(self.run_workloads, context=contextvars.Context())
        except RuntimeError:  # no loop (construction): the next enable/run does it
            state[0] = False

    def run_workloads(self) -> None:
        """Run the controllers until nothing changes (after the write that triggered them has finished), then arm
        the timer for the next thing due on the clock."""
        state = self._workloads_state
        if self.workloads is None or state[1]:
            return
        state[1] = True
        try:
            for _ in range(k8s_workloads.MAX_PASSES):
                state[0] = False
                if not self.workloads.run() and not state[0]:
                    break
        finally:
            state[0] = state[1] = False
        self._arm_timer()

    def _arm_timer(self) -> None:
        due = self.workloads.next_due() if self.workloads is not None else None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if due is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the loop (a test constructing one by hand): advance() runs what is due
            return
        # NOTE: at least 10 ms, so a controller that reports something due it does not act on cannot spin the loop.
        delay = max(0.01, due - self.clock.time())
        self._timer = loop.call_later(delay, self.run_workloads, context=contextvars.Context())

    def advance(self, seconds: float) -> float:
        """Move the emulator's clock forward (tolerationSeconds, grace periods, held readiness, minReadySeconds and
        progress deadlines elapse) and run the controllers at once; returns the new emulator time."""
        self.clock.advance(seconds)
        self.run_workloads()
        return self.clock.time()

    # ---- helpers for tests (call on the loop: EmulatorThread.call does it) ---------------------

    def apply_object(self, obj: dict, *, namespace: str | None = None, field_manager: str = "pytest") -> dict:
        """Create or server-side-apply one object, as ``kubectl apply --server-side`` would."""
        api_version = obj.get("apiVersion") or ""
        group, _, version = api_version.rpartition("/")
        res = next(
            (r for r in self._api.values() if r.group == group and r.version == version and r.kind == obj.get("kind")),
            None,
        )
        if res is None:
            raise ApiError(404, "NotFound", f'no matches for kind "{obj.get("kind")}" in version "{api_version}"')
        ns = (namespace or (obj.get("metadata") or {}).get("namespace") or "default") if res.namespaced else None
        name = (obj.get("metadata") or {}).get("name")
        if not name:
            return self._create(res, ns, obj, field_validation="Strict")
        result, _ = self._patch(res, ns, name, "apply", obj, field_manager=field_manager, field_validation="Strict")
        if res.has_status and obj.get("status") is not None:
            current = self._store[self._key(res, ns, name)]
            result = self._update(res, ns, name, dict(current, status=obj["status"]), subresource="status")
        return result

    def create_object(self, res: ApiResource, obj: dict, namespace: str | None = None) -> dict:
        return self._create(res, namespace, obj, field_validation="Strict")

    def patch_object(
        self,
        res: ApiResource,
        name: str,
        patch: Any,
        namespace: str | None = None,
        *,
        subresource: str | None = None,
        patch_type: str = "merge",
    ) -> dict:
        return self._patch(res, namespace, name, patch_type, patch, subresource=subresource)[0]

    def delete_object(
        self, res: ApiResource, name: str, namespace: str | None = None, *, propagation: str | None = None
    ) -> dict:
        return self._delete(res, namespace, name, {"propagationPolicy": propagation} if propagation else {})[0]

    def cordon(self, node: str, unschedulable: bool = True) -> dict:
        """``kubectl cordon`` (``uncordon`` with False): the node's ``spec.unschedulable``."""
        res = self.resource_for("", "v1", "nodes")
        return self._patch(res, None, node, "strategic", {"spec": {"unschedulable": True if unschedulable else None}})[
            0
        ]

    def set_node_ready(self, node: str, status: str = "True", *, reason: str | None = None) -> dict:
        """Set the node's Ready condition ("True", "False" or "Unknown"), as its kubelet (or, for Unknown, the node
        lifecycle controller once the kubelet stops posting) would; other conditions stay."""
        if status not in ("True", "False", "Unknown"):
            raise ValueError(f"a Ready condition is True, False or Unknown, not {status!r}")
        res = self.resource_for("", "v1", "nodes")
        current = self.get_object(res, None, node)
        conditions = [c for c in (current.get("status") or {}).get("conditions") or [] if c.get("type") != "Ready"]
        ready = {
            "type": "Ready",
            "status": status,
            "lastTransitionTime": self.clock.iso(),
            "reason": reason
            or {"True": "KubeletReady", "False": "KubeletNotReady", "Unknown": "NodeStatusUnknown"}[status],
        }
        return self._patch(
            res, None, node, "merge", {"status": {"conditions": conditions + [ready]}}, subresource="status"
        )[0]
