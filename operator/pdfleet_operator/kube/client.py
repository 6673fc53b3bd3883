"""The only module that writes to the Kubernetes API: children by server-side apply, status, Events, and the
deployment token's Secret by create-if-missing.

Called by the reconcile path (`kube.reconciler`). Reads what exists (by label), writes only what differs
(`drift.contains`), deletes the children the reconcile chain says go, never touches objects another owner
controls. Speaks JSON over one aiohttp session with the credentials kopf logged in with.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import secrets
import ssl
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf

from pdfleet_operator.api import names
from pdfleet_operator.decide import drift
from pdfleet_operator.kube import render

FIELD_MANAGER = "pdfleet-operator"
logger = logging.getLogger("pdfleet.kube")

# kind -> (API prefix, plural); every kind this module reads or writes.
RESOURCES: dict[str, tuple[str, str]] = {
    "ConfigMap": ("/api/v1", "configmaps"),
    "Secret": ("/api/v1", "secrets"),  # created only (create_if_missing): never read, listed, patched or deleted
    "Service": ("/api/v1", "services"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "ControllerRevision": ("/apis/apps/v1", "controllerrevisions"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "PodMonitor": ("/apis/monitoring.coreos.com/v1", "podmonitors"),
    "PrometheusRule": ("/apis/monitoring.coreos.com/v1", "prometheusrules"),
    "Event": ("/api/v1", "events"),
    "InferenceDeployment": ("/apis/pdfleet.io/v1alpha1", "inferencedeployments"),
    "AcceleratorClass": ("/apis/pdfleet.io/v1alpha1", "acceleratorclasses"),
    "Node": ("/api/v1", "nodes"),
}
CHILD_KINDS = ("ConfigMap", "Service", "PodDisruptionBudget", "NetworkPolicy", "Deployment")
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
DELETED = "<deleted>"  # marks our own deletes in Api.written


class ApiError(Exception):
    """A Kubernetes Status error answered by the API server."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code, self.reason, self.message = code, reason, message

    @property
    def heals(self) -> bool:
        """Worth retrying: conflicts, throttling, server trouble (not a rejected object)."""
        return self.code in (409, 429) or self.code >= 500


@dataclass
class ApplyResult:
    """What `apply_children` did; `problems` are children it could not apply (-> Degraded)."""

    applied: list[str] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    drifted: dict[str, list[str]] = field(default_factory=dict)  # existing child -> fields that differed
    pruned: list[str] = field(default_factory=list)  # applied again only to drop fields no longer rendered
    retained: dict[str, str] = field(default_factory=dict)  # children left untouched (a pool whose class is gone)
    hashes: dict[str, str] = field(default_factory=dict)  # child -> applied hash of what was rendered for it

    @property
    def writes(self) -> int:
        return len(self.applied) + len(self.created) + len(self.deleted)


def path(kind: str, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
    prefix, plural = RESOURCES[kind]
    path = prefix + (f"/namespaces/{namespace}" if namespace else "") + f"/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def key_of(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def controller_uid(obj: dict[str, Any]) -> str | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


class Api:
    """A small async client for the few calls the operator makes; counts its writes."""

    connect_timeout_s = 10.0  # to open a TCP (and TLS) connection
    read_timeout_s = 30.0  # of silence from the server while a response is due

    def __init__(
        self, server: str, *, headers: dict[str, str] | None = None, ssl_context: ssl.SSLContext | bool | None = None
    ) -> None:
        self.server = server.rstrip("/")
        self._headers = {"Accept": "application/json", **(headers or {})}
        self._ssl = ssl_context
        self._session: aiohttp.ClientSession | None = None
        self.writes = 0
        self.reads = 0
        # (kind, namespace, name) -> resourceVersion of our last write: watch events carrying it are our own.
        self.written: dict[tuple[str, str, str], str] = {}
        # (kind, namespace, name) -> the object our last apply returned, or {"deletedUid": uid} after our delete:
        # what the reconcile reads over kopf's indexes until they catch up (`indexes.Cluster.children`).
        self.last: dict[tuple[str, str, str], dict[str, Any]] = {}
        # (namespace, owning InferenceDeployment) -> the keys of `last` of its children: a reconcile reads its own
        # (`last_of`) without walking every write of the process (thousands at scale, per reconcile).
        self._last_by_owner: dict[tuple[str, str], set[tuple[str, str, str]]] = {}

    @classmethod
    def from_connection(cls, info: kopf.ConnectionInfo) -> Api:
        """An Api with the credentials kopf's login produced (kubeconfig or in-cluster service account)."""
        headers: dict[str, str] = {}
        if info.token:  # NOTE: kopf's kubeconfig login leaves the scheme empty for a token; kopf itself sends Bearer
            headers["Authorization"] = f"{info.scheme or 'Bearer'} {info.token}"
        elif info.username and info.password:
            import base64

            headers["Authorization"] = "Basic " + base64.b64encode(f"{info.username}:{info.password}".encode()).decode()
        context: ssl.SSLContext | bool | None = None
        if info.server.startswith("https"):
            if info.insecure:
                context = False
            else:
                context = (
                    ssl.create_default_context(cafile=info.ca_path) if info.ca_path else ssl.create_default_context()
                )
                if info.ca_data:
                    context.load_verify_locations(
                        cadata=info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
                    )
                if info.certificate_path or info.certificate_data:
                    context.load_cert_chain(*_cert_files(info))
        return cls(info.server, headers=headers, ssl_context=context)

    async def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # NOTE: no total timeout: with hundreds of reconciles in flight a request can wait long for one of
            # the `limit` pooled connections (our own back-pressure, not a server fault); a server that does
            # not answer is still cut off after sock_read seconds of silence.
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(
                    total=None, connect=None, sock_connect=self.connect_timeout_s, sock_read=self.read_timeout_s
                ),
                connector=aiohttp.TCPConnector(ssl=self._ssl if self._ssl is not None else True, limit=32),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        counted: bool = True,
    ) -> Any:
        session = await self._client()
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        if method in WRITE_METHODS and counted:
            self.writes += 1
        else:
            self.reads += 1
        try:
            async with session.request(method, self.server + path, params=params, data=data, headers=headers) as resp:
                text = await resp.text()
                payload = json.loads(text) if text else None
                if resp.status >= 400:
                    status = payload if isinstance(payload, dict) else {}
                    raise ApiError(resp.status, status.get("reason", "Unknown"), status.get("message", text[:500]))
                return payload
        except asyncio.TimeoutError as exc:  # (aiohttp's ServerTimeoutError is one too: sock_connect / sock_read)
            raise ApiError(504, "Timeout", f"{method} {path}: no answer in time ({exc or 'timeout'})") from exc
        except aiohttp.ClientError as exc:
            raise ApiError(503, "Unreachable", f"{method} {path}: {exc}") from exc

    # --- reads ---
    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path(kind, namespace, name))
        except ApiError as exc:
            if exc.code == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str | None, label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        items = (await self.request("GET", path(kind, namespace), params=params))["items"] or []
        api_version = "v1" if RESOURCES[kind][0] == "/api/v1" else RESOURCES[kind][0].removeprefix("/apis/")
        for item in items:  # list items come without kind/apiVersion
            item.setdefault("kind", kind)
            item.setdefault("apiVersion", api_version)
        return items

    async def has_group(self, group_version: str) -> bool:
        try:
            await self.request("GET", f"/apis/{group_version}")
            return True
        except ApiError as exc:
            if exc.code == 404:
                return False
            raise

    # --- writes ---
    def _remember(self, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        if meta.get("resourceVersion"):
            self.written[(obj.get("kind", ""), meta.get("namespace", ""), meta["name"])] = meta["resourceVersion"]

    def _keep_last(self, key: tuple[str, str, str], obj: dict[str, Any], labels: Mapping[str, str] | None) -> None:
        self.last[key] = obj
        owner = (labels or {}).get(render.LABEL_DEPLOYMENT)
        if owner:
            self._last_by_owner.setdefault((key[1], owner), set()).add(key)

    def last_of(self, namespace: str, owner: str) -> dict[tuple[str, str, str], dict[str, Any]]:
        """What `last` holds of one InferenceDeployment's children (by their deployment label)."""
        keys = self._last_by_owner.get((namespace, owner), ())
        return {k: self.last[k] for k in keys if k in self.last}

    def forget(self, namespace: str, owner: str) -> None:
        """Drop what `last` holds of one InferenceDeployment's children (it is deleted). A delete mark carries no
        labels: it goes by name (every child's name starts with its deployment's, or its first 54 characters)."""
        self._last_by_owner.pop((namespace, owner), None)
        for key, obj in list(self.last.items()):
            label = ((obj.get("metadata") or {}).get("labels") or {}).get(render.LABEL_DEPLOYMENT)
            if key[1] == namespace and (label == owner or (label is None and key[2].startswith(owner[:54]))):
                self.last.pop(key, None)

    def is_own_write(self, kind: str, namespace: str, name: str, resource_version: str | None) -> bool:
        return resource_version is not None and self.written.get((kind, namespace, name)) == resource_version

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply with our field manager, forcing ownership of the fields we render."""
        meta = obj["metadata"]
        result = await self.request(
            "PATCH",
            path(obj["kind"], meta.get("namespace"), meta["name"]),
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            body=obj,
            content_type="application/apply-patch+yaml",
        )
        result.setdefault("kind", obj["kind"])
        self._remember(result)
        self._keep_last((obj["kind"], meta.get("namespace") or "", meta["name"]), result, meta.get("labels"))
        return result

    async def create_if_missing(self, obj: dict[str, Any]) -> bool:
        """POST `obj`: True if created, False if one of that name exists (409 AlreadyExists), which is left as it is.
        NOTE: what the deployment token's Secret needs: `create` is the only verb on Secrets the operator holds
        (it can read no Secret), and no reconcile ever replaces the token the pods were given."""
        meta = obj["metadata"]
        try:
            await self.request("POST", path(obj["kind"], meta.get("namespace")), body=obj, counted=False)
        except ApiError as exc:
            if exc.code == 409:
                return False
            raise
        self.writes += 1
        return True

    async def delete(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        body = (
            {
                "kind": "DeleteOptions",
                "apiVersion": "v1",
                "propagationPolicy": "Background",
                "preconditions": {"uid": meta["uid"]},
            }
            if meta.get("uid")
            else None
        )
        self.written[(obj["kind"], meta.get("namespace", ""), meta["name"])] = DELETED
        self._keep_last(
            (obj["kind"], meta.get("namespace") or "", meta["name"]),
            {"deletedUid": meta.get("uid")},
            meta.get("labels"),
        )
        try:
            await self.request("DELETE", path(obj["kind"], meta.get("namespace"), meta["name"]), body=body)
        except ApiError as exc:
            if exc.code not in (404, 409):  # already gone, or replaced by a new object of that name
                raise

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        return await self.patch_status_of("InferenceDeployment", namespace, name, status)

    async def patch_status_of(
        self, kind: str, namespace: str | None, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        """A merge patch of the status subresource (the only way the operator writes a status)."""
        return await self.request(
            "PATCH",
            path(kind, namespace, name, "status"),
            body={"status": status},
            content_type="application/merge-patch+json",
        )

    async def remove_annotation(self, kind: str, namespace: str, name: str, key: str) -> None:
        """Drop one annotation (a one-shot command such as pdfleet.io/rollback-to, once acted on)."""
        await self.request(
            "PATCH",
            path(kind, namespace, name),
            body={"metadata": {"annotations": {key: None}}},
            content_type="application/merge-patch+json",
        )

    async def event(self, meta: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event about the InferenceDeployment whose metadata is `meta` (what `kubectl describe` shows)."""
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta['name']}.{int(time.time() * 1e6):x}{secrets.token_hex(2)}",
                "namespace": meta["namespace"],
            },
            "involvedObject": {
                "apiVersion": render.API_VERSION,
                "kind": "InferenceDeployment",
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": FIELD_MANAGER,
            "reportingInstance": FIELD_MANAGER,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.request("POST", path("Event", meta["namespace"]), body=body)
        except ApiError as exc:  # an Event is a courtesy: never fail a reconcile over it
            logger.warning("could not post Event %s on %s/%s: %s", reason, meta["namespace"], meta["name"], exc)


def _cert_files(info: kopf.ConnectionInfo) -> tuple[str, str | None]:
    def path_of(path: str | None, data: bytes | str | None) -> str | None:
        if path or not data:
            return path
        handle = tempfile.NamedTemporaryFile("wb", delete=False, suffix=".pem")
        handle.write(data if isinstance(data, bytes) else data.encode())
        handle.close()
        return handle.name

    cert = path_of(info.certificate_path, info.certificate_data)
    assert cert is not None, "client certificate expected"
    return cert, path_of(info.private_key_path, info.private_key_data)


async def list_children(api: Api, owner: render.Owner, kinds: Iterable[str]) -> list[dict[str, Any]]:
    """The objects carrying this deployment's label that it controls (by ownerReference uid)."""
    selector = f"{render.LABEL_DEPLOYMENT}={owner.name},app.kubernetes.io/managed-by={render.MANAGER}"
    out: list[dict[str, Any]] = []
    for kind in kinds:
        out += [o for o in await api.list(kind, owner.namespace, selector) if controller_uid(o) == owner.uid]
    return out


async def apply_children(
    api: Api,
    owner: render.Owner,
    desired: list[dict[str, Any]],
    existing: list[dict[str, Any]],
    *,
    delete: Iterable[str] = (),
    untouched: Iterable[str] = (),
) -> ApplyResult:
    """Apply each child of `desired` the live object does not already contain, then delete the children named in
    `delete` (the reconcile chain decided which: `decide.reconcile`); `untouched` ones are neither.

    A name taken by an object this deployment does not control is left alone and reported.
    """
    result = ApplyResult()
    current = {key_of(o): o for o in existing}
    for obj in (drift.with_applied_hash(o) for o in desired):
        key = key_of(obj)
        result.hashes[key] = obj["metadata"]["annotations"][names.ANNOTATION_APPLIED_HASH]
        cur = current.get(key)
        if cur is None:
            found = await api.get(obj["kind"], owner.namespace, obj["metadata"]["name"])
            if found is not None and controller_uid(found) != owner.uid:
                result.problems.append(f"{key} exists and is not controlled by this InferenceDeployment")
                continue
            cur = found
        if cur is not None and drift.contains(cur, obj):
            continue
        try:
            await api.apply(obj)
        except ApiError as exc:
            if exc.heals:
                raise
            result.problems.append(f"{key}: {exc.reason}: {exc.message}")
            continue
        if cur is None:
            result.created.append(key)
        elif drift.pruned_only(cur, obj):
            result.applied.append(key)
            result.pruned.append(key)  # a field the render no longer produces, or a child applied before the stamp
        else:
            result.applied.append(key)
            result.drifted[key] = [
                d
                for d in drift.differences(cur, obj)
                if not d.endswith(f".annotations.{names.ANNOTATION_APPLIED_HASH}")
            ] or ["."]
    result.retained = {k: "untouched" for k in untouched}
    for key in delete:
        if key in current and key not in result.retained:
            await api.delete(current[key])
            result.deleted.append(key)
    return result


async def ensure_auth_secret(api: Api, owner: render.Owner) -> bool:
    """The deployment token's Secret, created with a fresh token when missing (True), else left alone (False)."""
    return await api.create_if_missing(render.auth_secret(owner, secrets.token_urlsafe(32)))


async def list_revisions(api: Api, owner: render.Owner) -> list[dict[str, Any]]:
    """The ControllerRevisions this deployment controls, oldest revision first."""
    found = await list_children(api, owner, ("ControllerRevision",))
    return sorted(found, key=lambda o: int(o.get("revision") or 0))


async def save_revision(api: Api, revision: dict[str, Any]) -> dict[str, Any]:
    """Create (or take over) one ControllerRevision; its data never changes after creation."""
    return await api.apply(revision)


async def delete_revisions(api: Api, revisions: Iterable[dict[str, Any]]) -> None:
    for obj in revisions:
        await api.delete(obj)
