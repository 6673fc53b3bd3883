"""A stateful Kubernetes API emulator for tests, built on kmock.

``KubernetesApiEmulator`` extends kmock's ``KubernetesEmulator`` (and is served by ``kmock.Server``)
into something kopf, the ``kubernetes`` Python client and ``kubectl`` can run against for real:

* objects get ``uid``, ``resourceVersion`` (one global monotonic counter, as etcd's revision),
  ``generation`` (bumped on changes outside ``metadata``/``status`` only), ``creationTimestamp``
  and ``namespace``; no-op writes change nothing and send no watch event;
* list (``kind: XList`` + ``metadata.resourceVersion``), get, create, replace (PUT, with
  resourceVersion conflicts → 409), patch (JSON patch with ``test`` failures → 422, merge patch,
  strategic merge as an approximation, server-side apply), delete, deletecollection, ``dryRun=All``;
* watches: without ``resourceVersion`` (or with ``0``/``sendInitialEvents``) the current objects
  come as ADDED first, with a resourceVersion only the events after it; MODIFIED/DELETED follow,
  label/field selectors translate changes into ADDED/DELETED as the real API does;
  ``timeoutSeconds`` ends the stream; :meth:`KubernetesApiEmulator.compact` makes older
  resourceVersions answer ``410 Gone``;
* ``/status`` subresources (writes there change only ``status``; main writes ignore ``status``),
  ``metadata.finalizers`` + ``deletionTimestamp``, garbage collection by ``ownerReferences``
  (background cascade, ``Foreground`` approximated, ``Orphan`` honoured), namespace termination;
* namespaces (``default``, ``kube-system``, ``kube-public``, ``kube-node-lease`` exist; objects in
  a missing namespace are refused with 404 as on a real cluster);
* applied CustomResourceDefinitions become served resources with discovery (group/version, short
  names, categories, scope, subresources), CR admission against the served version's
  ``openAPIV3Schema`` and CEL ``x-kubernetes-validations`` (422 ``Invalid`` Status with causes),
  unknown fields per ``fieldValidation`` (Strict → 400, Warn → pruned + ``Warning`` header,
  Ignore → pruned), schema defaults, and Table responses from ``additionalPrinterColumns``;
* discovery (``/api``, ``/apis``, ``/api/v1``, ``/apis/<g>/<v>``), ``/version``, an empty
  ``/openapi/v2`` (kubectl then skips client-side validation), ``/healthz``/``/readyz``;
* a request log (:class:`LoggedRequest`) to count writes and list the verbs a client used, who sent each
  request, and which objects each list answered and each watch streamed (``objects``), so a test can show
  that a server-side ``labelSelector`` kept unlabelled objects from ever reaching a client;
* RBAC, opt-in per token: a bearer token registered in ``users`` (``service_account(ns, name)`` makes one
  for a ServiceAccount) is authorized by the Roles, ClusterRoles, RoleBindings and ClusterRoleBindings
  stored in the emulator (apiGroups/resources/subresources/verbs/resourceNames, ``*`` wildcards,
  ServiceAccount/User/Group subjects, ``system:masters``); a request no rule allows gets kube-apiserver's
  403 Forbidden Status; a server-side apply that creates needs ``create`` too; and the
  OwnerReferencesPermissionEnforcement admission plugin: changing an existing object's ownerReferences
  needs ``delete`` on it, ``blockOwnerDeletion: true`` needs ``update`` on the owner's ``finalizers``.

What a real kube-apiserver does that this does NOT:

* no authentication: a token not registered in ``users`` (the tests' own kubeconfig) may do anything;
  RBAC knows no aggregated ClusterRoles (``aggregationRule``), no built-in roles or bindings
  (non-resource URLs such as discovery are allowed to everyone instead), no escalation/bind checks on
  writes of RBAC objects, no impersonation, no SubjectAccessReviews; no admission webhooks, no
  ValidatingAdmissionPolicy, no quota/LimitRange, no validation of built-in kinds beyond the object
  name (a Deployment with a bad spec is stored as sent);
* controllers only when a test turns them on (:meth:`KubernetesApiEmulator.enable_workloads`, see
  :mod:`tests.support.k8s_workloads`): Deployments then get Pods (directly: no ReplicaSets, a changed
  template replaces every old pod at once, no maxSurge/maxUnavailable pacing, no progress deadline),
  a scheduler binds them to Nodes by their requests (nodeSelector, required node affinity on labels,
  taints, free allocatable of every resource: nvidia.com/gpu, MIG and other extended resources, cpu,
  memory, pods) and leaves the rest ``Pending`` with ``PodScheduled=False``/``Unschedulable`` until
  capacity frees; bound pods turn Running and Ready at once. Not emulated even then: preemption and
  priorities, pod (anti-)affinity and topology spread, preferred affinity and scoring beyond
  "fullest node first", node-affinity on fields, taint-based eviction, resource quotas, device
  plugins (allocatable is what the Node says), probes, restarts, image pulls, Services' endpoints,
  Jobs. Off (the default), nothing makes Pods or readiness — patch ``status`` in tests;
* garbage collection is synchronous and approximate (Foreground deletion deletes dependents first
  instead of using the ``foregroundDeletion`` finalizer; Orphan removes the owner references at
  once); deleting a CRD deletes its objects without waiting for their finalizers;
* server-side apply merges the applied configuration into the object (maps merge, lists are
  replaced) and forgets fields the same manager stopped applying; there is no ``managedFields``
  bookkeeping, no conflict detection between managers; strategic merge patch knows only a few
  merge keys (``name``, ``containerPort``, ``mountPath``, ``type``, ...) and ``$patch`` directives;
* no protobuf (requests in protobuf get 415; so ``kubectl create <typed resource>`` and Helm's
  Secret storage do not work), no CBOR, no aggregated discovery (clients fall back to legacy
  discovery), no OpenAPI documents, no ``kubectl explain``;
* lists ignore ``limit``/``continue`` (everything comes in one page) and ``resourceVersion``
  parameters (lists are always current); no watch bookmarks except the one that ends
  ``sendInitialEvents``; field selectors accept any dotted path (the real API allows only a few
  per kind); no ``/scale``, ``/log``, ``/exec``, ``/eviction``, ``/token`` or ``/proxy``
  subresources; CRD conversion webhooks are not called (versions differ only in ``apiVersion``);
* graceful deletion periods are ignored (objects without finalizers go at once), ``Event``
  aggregation, TTLs and ``generateName`` retries are not emulated (Leases are stored objects like any
  other: leader election is the clients' protocol over them, which works as on a cluster).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import copy
import datetime
import functools
import gzip
import importlib.resources
import json
import re
import secrets
import string
import threading
import traceback
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml
from kmock._internal import apps as _kmock_apps
from kmock._internal import rendering as _kmock_rendering

from pdfleet_operator.api import admission
from tests.support import k8s_workloads

__all__ = [
    "ApiError",
    "Forbidden",
    "Requester",
    "ApiResource",
    "LoggedRequest",
    "KubernetesApiEmulator",
    "EmulatorThread",
    "write_kubeconfig",
]

JSON = "application/json"
WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})
DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")


# ---------------------------------------------------------------------------------------------
# Errors as Kubernetes Status objects
# ---------------------------------------------------------------------------------------------

class ApiError(Exception):
    """An error answered as a Kubernetes ``Status`` (``kind: Status``, ``status: Failure``)."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> dict:
        body: dict[str, Any] = {
            "kind": "Status", "apiVersion": "v1", "metadata": {},
            "status": "Failure", "message": self.message, "reason": self.reason, "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def _not_found(res: ApiResource, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{res.group_resource} "{name}" not found',
                    {"name": name, "group": res.group, "kind": res.plural})


def _conflict(res: ApiResource, name: str) -> ApiError:
    return ApiError(409, "Conflict",
                    f'Operation cannot be fulfilled on {res.group_resource} "{name}": the object has been '
                    "modified; please apply your changes to the latest version and try again",
                    {"name": name, "group": res.group, "kind": res.plural})


def _bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def _invalid(res: ApiResource, name: str, errors: list[admission.FieldError]) -> ApiError:
    return ApiError(422, "Invalid", admission.status_message(res.kind, res.group, name, errors), {
        "name": name, "group": res.group, "kind": res.kind,
        "causes": [{"reason": e.reason, "message": e.message, "field": e.field} for e in errors],
    })


def _unprocessable(message: str) -> ApiError:
    return ApiError(422, "Invalid", message)


# ---------------------------------------------------------------------------------------------
# Resources
# ---------------------------------------------------------------------------------------------

@dataclass
class ApiResource:
    """One served resource (group/version/plural) and its discovery information."""

    group: str
    version: str
    plural: str
    kind: str
    singular: str
    namespaced: bool
    verbs: list[str] = field(default_factory=list)
    shortnames: list[str] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    subresources: set[str] = field(default_factory=set)
    crd: dict | None = None  # the CustomResourceDefinition behind a custom resource

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_resource(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def has_status(self) -> bool:
        return "status" in self.subresources

    @property
    def crd_version(self) -> dict | None:
        if self.crd is None:
            return None
        for entry in self.crd["spec"].get("versions") or []:
            if entry.get("name") == self.version:
                return entry
        return None

    def __repr__(self) -> str:
        return f"<ApiResource {self.plural}.{self.version}.{self.group or 'core'}>"


_CRD_VERBS = ["delete", "deletecollection", "get", "list", "patch", "create", "update", "watch"]


@functools.lru_cache(maxsize=1)
def _bundled_discovery() -> list[dict]:
    """kmock's bundled discovery dump of a real cluster's built-in resources."""
    data = importlib.resources.files("kmock._internal").joinpath("resources.json.gz").read_bytes()
    return json.loads(gzip.decompress(data))


def _builtin_resources() -> list[ApiResource]:
    result = []
    for doc in _bundled_discovery():
        gv = doc["groupVersion"]
        group, _, version = gv.rpartition("/")
        subs: dict[str, set[str]] = {}
        for entry in doc.get("resources", []):
            if "/" in entry["name"]:
                parent, sub = entry["name"].split("/", 1)
                subs.setdefault(parent, set()).add(sub)
        for entry in doc.get("resources", []):
            if "/" in entry["name"]:
                continue
            if group == "metrics.k8s.io":
                continue  # served by an aggregated API server, not by kube-apiserver
            result.append(ApiResource(
                group=group, version=version, plural=entry["name"], kind=entry["kind"],
                singular=entry.get("singularName") or entry["kind"].lower(),
                namespaced=bool(entry.get("namespaced")), verbs=list(entry.get("verbs") or []),
                shortnames=list(entry.get("shortNames") or []), categories=list(entry.get("categories") or []),
                subresources=subs.get(entry["name"], set()),
            ))
    return result


_VERSION_RE = re.compile(r"^v(\d+)(?:(alpha|beta)(\d+))?$")


def _version_priority(version: str) -> tuple:
    """Kubernetes' version ordering: GA > beta > alpha, higher numbers first, then others."""
    m = _VERSION_RE.match(version)
    if not m:
        return (3, 0, 0, version)
    major, stage, minor = int(m.group(1)), m.group(2), int(m.group(3) or 0)
    rank = {None: 0, "beta": 1, "alpha": 2}[stage]
    return (rank, -major, -minor, version)


# ---------------------------------------------------------------------------------------------
# Small pure helpers: time, selectors, JSONPath, patches
# ---------------------------------------------------------------------------------------------

def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def human_duration(seconds: float) -> str:
    """apimachinery's duration.HumanDuration, used for AGE columns."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m" if s % 60 == 0 else f"{minutes}m{s % 60}s"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        return f"{hours}h" if minutes % 60 == 0 else f"{hours}h{minutes % 60}m"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d" if hours % 24 == 0 else f"{hours // 24}d{hours % 24}h"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f"{hours // 24 // 365}y" if days == 0 else f"{hours // 24 // 365}y{days}d"
    return f"{hours // 24 // 365}y"


def _age(timestamp: str | None) -> str:
    if not timestamp:
        return "<unknown>"
    try:
        then = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return "<invalid>"
    return human_duration((datetime.datetime.now(datetime.UTC) - then).total_seconds())


_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"


def parse_label_selector(text: str) -> Callable[[dict], bool]:
    """Parse ``a=b,c!=d,e in (x,y),f notin (z),g,!h`` into a predicate over a labels dict."""
    terms: list[str] = []
    depth, cur = 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            terms.append(cur)
            cur = ""
        else:
            cur += ch
    terms.append(cur)
    checks: list[Callable[[dict], bool]] = []
    for raw in terms:
        term = raw.strip()
        if not term:
            continue
        if m := re.fullmatch(rf"!\s*({_KEY})", term):
            key = m.group(1)
            checks.append(lambda labels, key=key: key not in labels)
        elif m := re.fullmatch(rf"({_KEY})\s+(in|notin)\s+\(([^)]*)\)", term):
            key, op = m.group(1), m.group(3)
            values = {v.strip() for v in m.group(4).split(",") if v.strip()}
            if op == "in":
                checks.append(lambda labels, key=key, values=values: labels.get(key) in values)
            else:
                checks.append(lambda labels, key=key, values=values: labels.get(key) not in values)
        elif m := re.fullmatch(rf"({_KEY})\s*(==|=|!=)\s*([-A-Za-z0-9_.]*)", term):
            key, op, value = m.group(1), m.group(3), m.group(4)
            if op == "!=":
                checks.append(lambda labels, key=key, value=value: labels.get(key) != value)
            else:
                checks.append(lambda labels, key=key, value=value: labels.get(key) == value)
        elif m := re.fullmatch(rf"({_KEY})", term):
            key = m.group(1)
            checks.append(lambda labels, key=key: key in labels)
        else:
            raise _bad_request(f"unable to parse requirement: invalid label selector: {term!r}")
    return lambda labels: all(check(labels or {}) for check in checks)


def parse_field_selector(text: str) -> Callable[[dict], bool]:
    """Parse ``metadata.name=x,status.phase!=Running`` into a predicate over an object."""
    checks: list[Callable[[dict], bool]] = []
    for raw in text.split(","):
        term = raw.strip()
        if not term:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(.*)", term)
        if not m:
            raise _bad_request(f"invalid field selector: {term!r}")
        path, op, value = m.group(1), m.group(2), m.group(3)

        def lookup(obj: dict, path: str = path) -> str:
            cur: Any = obj
            for part in path.split("."):
                cur = cur.get(part) if isinstance(cur, dict) else None
            if cur is None:
                return ""
            if isinstance(cur, bool):
                return "true" if cur else "false"
            return str(cur)

        if op == "!=":
            checks.append(lambda obj, lookup=lookup, value=value: lookup(obj) != value)
        else:
            checks.append(lambda obj, lookup=lookup, value=value: lookup(obj) == value)
    return lambda obj: all(check(obj) for check in checks)


_JP_TOKEN = re.compile(
    r"""\.\.(?P<rec>[A-Za-z0-9_$-]+)|\.(?P<field>[A-Za-z0-9_$-]+)|\[\s*'(?P<quoted>[^']*)'\s*\]"""
    r"""|\[\s*"(?P<dquoted>[^"]*)"\s*\]|\[\s*(?P<index>-?\d+)\s*\]|\[\s*\*\s*\]|\.\*"""
    r"""|\[\s*\?\(\s*@\.(?P<fpath>[A-Za-z0-9_.$-]+)\s*(?P<fop>==|!=)\s*(?P<fval>"[^"]*"|'[^']*'|[^)\s]+)\s*\)\s*\]"""
)


def jsonpath(obj: Any, expression: str) -> list[Any]:
    """The subset of Kubernetes JSONPath that printer columns use (``.a.b[0]``, ``[*]``, ``[?(@.k=="v")]``)."""
    expr = expression.strip()
    if expr.startswith("{") and expr.endswith("}"):
        expr = expr[1:-1]
    if expr.startswith("$"):
        expr = expr[1:]
    current = [obj]
    pos = 0
    while pos < len(expr):
        m = _JP_TOKEN.match(expr, pos)
        if not m:
            raise ValueError(f"unsupported JSONPath: {expression!r}")
        pos = m.end()
        nxt: list[Any] = []
        if m.group("field") is not None or m.group("quoted") is not None or m.group("dquoted") is not None:
            key = m.group("field") or m.group("quoted") or m.group("dquoted") or ""
            nxt = [c[key] for c in current if isinstance(c, dict) and key in c]
        elif m.group("rec") is not None:
            key = m.group("rec")

            def walk(node: Any) -> None:
                if isinstance(node, dict):
                    if key in node:
                        nxt.append(node[key])
                    for v in node.values():
                        walk(v)
                elif isinstance(node, list):
                    for v in node:
                        walk(v)
            for c in current:
                walk(c)
        elif m.group("index") is not None:
            i = int(m.group("index"))
            nxt = [c[i] for c in current if isinstance(c, list) and -len(c) <= i < len(c)]
        elif m.group("fpath") is not None:
            raw = m.group("fval")
            want: Any = raw[1:-1] if raw[:1] in "'\"" else raw
            for c in current:
                for item in c if isinstance(c, list) else []:
                    got: Any = item
                    for part in m.group("fpath").split("."):
                        got = got.get(part) if isinstance(got, dict) else None
                    same = (str(got).lower() if isinstance(got, bool) else str(got)) == str(want) if got is not None else False
                    if same == (m.group("fop") == "=="):
                        nxt.append(item)
        else:  # [*] or .*
            for c in current:
                if isinstance(c, list):
                    nxt.extend(c)
                elif isinstance(c, dict):
                    nxt.extend(c.values())
        current = nxt
    return current


def json_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = json_merge_patch(result.get(key), value)
    return result


_SMP_MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name", "env": "name",
    "volumes": "name", "volumeMounts": "mountPath", "volumeDevices": "devicePath", "ports": "containerPort",
    "imagePullSecrets": "name", "conditions": "type", "hostAliases": "ip", "topologySpreadConstraints": "topologyKey",
    "ownerReferences": "uid", "resourceClaims": "name", "envFrom": None, "tolerations": None,
}


def strategic_merge_patch(target: Any, patch: Any, field_name: str | None = None) -> Any:
    """An approximation of strategic merge patch: merge patch + merge keys for well-known lists."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if not k.startswith("$")}
    if patch.get("$patch") == "delete":
        return None
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            merged = strategic_merge_patch(result.get(key), value, key)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list) and _SMP_MERGE_KEYS.get(key) and isinstance(result.get(key), list) \
                and all(isinstance(v, dict) for v in value):
            merge_key = _SMP_MERGE_KEYS[key]
            items = [copy.deepcopy(v) for v in result[key]]
            for item in value:
                idx = next((i for i, old in enumerate(items)
                            if isinstance(old, dict) and old.get(merge_key) == item.get(merge_key)), None)
                if item.get("$patch") == "delete":
                    if idx is not None:
                        items.pop(idx)
                elif idx is None:
                    items.append({k: v for k, v in item.items() if not k.startswith("$")})
                else:
                    items[idx] = strategic_merge_patch(items[idx], item, None)
            result[key] = items
        else:
            result[key] = [{k: v for k, v in i.items() if not k.startswith("$")} if isinstance(i, dict) else i
                           for i in value] if isinstance(value, list) else copy.deepcopy(value)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ValueError(f"invalid JSON pointer: {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json_patch(doc: Any, operations: Any) -> Any:
    """RFC 6902. Raises ``ValueError`` with jsonpatch-like messages when an operation fails."""
    if not isinstance(operations, list):
        raise TypeError("json patch must be a list of operations")
    doc = copy.deepcopy(doc)

    def parent_of(d: Any, parts: list[str], op: str, path: str) -> tuple[Any, str]:
        cur = d
        for part in parts[:-1]:
            if isinstance(cur, dict) and part in cur:
                cur = cur[part]
            elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
                cur = cur[int(part)]
            else:
                raise ValueError(f"{op} operation does not apply: doc is missing path: \"{path}\"")
        return cur, parts[-1]

    def get(d: Any, path: str, op: str) -> Any:
        cur = d
        for part in _pointer(path):
            if isinstance(cur, dict) and part in cur:
                cur = cur[part]
            elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
                cur = cur[int(part)]
            else:
                raise ValueError(f"{op} operation does not apply: doc is missing path: \"{path}\"")
        return cur

    def remove(d: Any, path: str, op: str) -> Any:
        parts = _pointer(path)
        if not parts:
            raise ValueError("cannot remove the whole document")
        parent, last = parent_of(d, parts, op, path)
        if isinstance(parent, dict) and last in parent:
            return parent.pop(last)
        if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
            return parent.pop(int(last))
        raise ValueError(f"{op} operation does not apply: doc is missing path: \"{path}\"")

    def add(d: Any, path: str, value: Any, op: str) -> Any:
        parts = _pointer(path)
        if not parts:
            return value
        parent, last = parent_of(d, parts, op, path)
        if isinstance(parent, dict):
            parent[last] = value
        elif isinstance(parent, list):
            if last == "-":
                parent.append(value)
            elif last.isdigit() and int(last) <= len(parent):
                parent.insert(int(last), value)
            else:
                raise ValueError(f"{op} operation does not apply: index out of range: \"{path}\"")
        else:
            raise ValueError(f"{op} operation does not apply: doc is missing path: \"{path}\"")
        return d

    for operation in operations:
        if not isinstance(operation, dict) or "op" not in operation or "path" not in operation:
            raise TypeError(f"invalid JSON patch operation: {operation!r}")
        op, path = operation["op"], operation["path"]
        if op == "add":
            doc = add(doc, path, copy.deepcopy(operation.get("value")), op)
        elif op == "remove":
            remove(doc, path, op)
        elif op == "replace":
            get(doc, path, op)
            parts = _pointer(path)
            if not parts:
                doc = copy.deepcopy(operation.get("value"))
            else:
                parent, last = parent_of(doc, parts, op, path)
                if isinstance(parent, list):
                    parent[int(last)] = copy.deepcopy(operation.get("value"))
                else:
                    parent[last] = copy.deepcopy(operation.get("value"))
        elif op == "move":
            value = remove(doc, operation["from"], op)
            doc = add(doc, path, value, op)
        elif op == "copy":
            doc = add(doc, path, copy.deepcopy(get(doc, operation["from"], op)), op)
        elif op == "test":
            try:
                actual = get(doc, path, op)
            except ValueError:
                raise ValueError(f"testing value {path} failed: test failed") from None
            if actual != operation.get("value"):
                raise ValueError(f"testing value {path} failed: test failed")
        else:
            raise TypeError(f"unsupported JSON patch operation: {op!r}")
    return doc


def _leaf_paths(value: Any, prefix: tuple = ()) -> set[tuple]:
    if isinstance(value, dict) and value:
        out: set[tuple] = set()
        for k, v in value.items():
            out |= _leaf_paths(v, prefix + (k,))
        return out
    return {prefix}


def _deep_merge(target: Any, applied: Any) -> Any:
    if isinstance(target, dict) and isinstance(applied, dict):
        result = copy.deepcopy(target)
        for k, v in applied.items():
            result[k] = _deep_merge(result.get(k), v)
        return result
    return copy.deepcopy(applied)


def _delete_path(obj: dict, path: tuple) -> None:
    cur: Any = obj
    for part in path[:-1]:
        if not isinstance(cur, dict) or part not in cur:
            return
        cur = cur[part]
    if isinstance(cur, dict):
        cur.pop(path[-1], None)


# ---------------------------------------------------------------------------------------------
# RBAC (opt-in per emulator: only requests with a token registered in ``users`` are authorized)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Requester:
    """Who sent a request: the user name and groups its token stands for (``KubernetesApiEmulator.users``), and
    the pod a bound ServiceAccount token names (the ``authentication.kubernetes.io/pod-name`` extra; not used by
    RBAC, only logged, which tells replicas of one ServiceAccount apart)."""

    user: str
    groups: tuple[str, ...] = ()
    pod: str | None = None


# The requester of the request being served (a context variable: each request is its own aiohttp task).
_REQUESTER: contextvars.ContextVar[Requester | None] = contextvars.ContextVar("emulator_requester", default=None)
RBAC_GROUP = "rbac.authorization.k8s.io"


def service_account_user(namespace: str, name: str, pod: str | None = None) -> Requester:
    """What a ServiceAccount token (bound to `pod`, when given) authenticates as on a real cluster."""
    return Requester(f"system:serviceaccount:{namespace}:{name}",
                     ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"), pod)


def rule_allows(rule: dict, group: str, resource: str, subresource: str | None, verb: str, name: str | None) -> bool:
    """One PolicyRule against one request, as kube-apiserver's RBAC authorizer matches them."""
    groups = rule.get("apiGroups") or []
    if "*" not in groups and group not in groups:
        return False
    resources = rule.get("resources") or []
    full = f"{resource}/{subresource}" if subresource else resource
    if "*" not in resources and full not in resources and not (subresource and f"*/{subresource}" in resources):
        return False
    verbs = rule.get("verbs") or []
    if "*" not in verbs and verb not in verbs:
        return False
    names = rule.get("resourceNames") or []
    return not names or (name is not None and name in names)


def _subject_matches(subject: dict, who: Requester) -> bool:
    kind = subject.get("kind")
    if kind == "ServiceAccount":
        return who.user == f"system:serviceaccount:{subject.get('namespace')}:{subject.get('name')}"
    if kind == "User":
        return who.user == subject.get("name")
    if kind == "Group":
        return subject.get("name") in who.groups
    return False


class Forbidden(ApiError):
    """403 from the emulator's RBAC or its OwnerReferencesPermissionEnforcement (``LoggedRequest.denied``)."""


def _forbidden(who: Requester, verb: str, group: str, resource: str, subresource: str | None, namespace: str | None,
               name: str | None, prefix: str = "") -> ApiError:
    """kube-apiserver's 403 Status for a request no rule allows."""
    full = f"{resource}/{subresource}" if subresource else resource
    group_resource = f"{resource}.{group}" if group else resource
    what = f'{group_resource} "{name}"' if name else group_resource
    where = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
    details: dict[str, Any] = {"group": group, "kind": resource}
    if name:
        details["name"] = name
    return Forbidden(403, "Forbidden", f'{what} is forbidden: {prefix}User "{who.user}" cannot {verb} resource '
                                      f'"{full}" in API group "{group}" {where}', details)


# ---------------------------------------------------------------------------------------------
# The request log
# ---------------------------------------------------------------------------------------------

@dataclass
class LoggedRequest:
    """One request as the emulator understood it (for assertions on what a client did)."""

    method: str
    path: str
    verb: str | None  # get, list, watch, create, update, patch, delete, deletecollection; None: not a resource
    group: str | None = None
    version: str | None = None
    resource: str | None = None  # the plural, e.g. "inferencedeployments"
    subresource: str | None = None
    namespace: str | None = None
    name: str | None = None
    query: dict[str, str] = field(default_factory=dict)
    content_type: str | None = None
    user_agent: str | None = None
    status: int | None = None  # the response status, when known
    body: Any = None  # the decoded request body for writes
    user: str | None = None  # who sent it, when the emulator knows the token (`users=`); None: the tests' admin
    pod: str | None = None  # the pod its ServiceAccount token is bound to, if any
    denied: str | None = None  # the message when the emulator's RBAC (or the ownerReference check) refused it
    objects: list[str] = field(default_factory=list)  # `namespace/name` of each object a list answered or a watch sent

    @property
    def is_write(self) -> bool:
        return self.verb in WRITE_VERBS and not self.query.get("dryRun")

    @property
    def patch_type(self) -> str | None:
        if self.method != "PATCH" or not self.content_type:
            return None
        return {"application/merge-patch+json": "merge", "application/json-patch+json": "json",
                "application/strategic-merge-patch+json": "strategic",
                "application/apply-patch+yaml": "apply"}.get(self.content_type, self.content_type)


def _object_ref(obj: dict) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or ''}/{meta.get('name')}"


@dataclass
class _Event:
    rv: int
    group: str
    plural: str
    namespace: str
    type: str
    obj: dict
    old: dict | None


_CLOSE = object()


# ---------------------------------------------------------------------------------------------
# The emulator
# ---------------------------------------------------------------------------------------------

@attrs.define(kw_only=True)
class KubernetesApiEmulator(kmock.KubernetesEmulator):
    """A stateful Kubernetes API for tests. See the module docstring for what it does and does not do.

    User-defined kmock reactions (``emulator['get', kmock.resource(...)] << 500``) still take
    precedence, which lets a test inject failures; everything else is served from the emulated state.
    All state changes happen on the server's event loop; use :class:`EmulatorThread` ``.call()``
    from other threads.
    """

    auto_create_namespaces: bool = False
    # bearer token -> who it authenticates as; requests with one of these tokens are authorized by the RBAC objects
    # stored in the emulator (403 Forbidden as on a cluster), any other request is the tests' administrator.
    users: dict[str, Requester] = attrs.field(factory=dict)
    _rbac_rules: dict[tuple[Requester, str | None], list[dict]] = attrs.field(factory=dict, init=False)  # cache

    _api: dict[tuple[str, str, str], ApiResource] = attrs.field(factory=dict, init=False)
    _store: dict[tuple[str, str, str, str], dict] = attrs.field(factory=dict, init=False)
    _uids: dict[str, tuple[str, str, str, str]] = attrs.field(factory=dict, init=False)
    _applied: dict[tuple[str, str, str, str], dict[str, dict]] = attrs.field(factory=dict, init=False)
    _rv: int = attrs.field(default=1, init=False)
    _events: list[_Event] = attrs.field(factory=list, init=False)
    _compacted_rv: int = attrs.field(default=0, init=False)
    _watchers: set[asyncio.Queue] = attrs.field(factory=set, init=False)
    log: list[LoggedRequest] = attrs.field(factory=list, init=False)
    # The opt-in controllers (`enable_workloads`): None while off.
    workloads: k8s_workloads.Workloads | None = attrs.field(default=None, init=False)
    _workloads_state: list[bool] = attrs.field(factory=lambda: [False, False], init=False)  # [due, running]

    def __attrs_post_init__(self) -> None:
        # Deliberately not calling kmock's post-init: its stateless fallbacks are replaced by _serve().
        for res in _builtin_resources():
            self._api[(res.group, res.version, res.plural)] = res
        for ns in DEFAULT_NAMESPACES:
            self._create(self.resource_for("", "v1", "namespaces"), None,
                         {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})

    # ---- resources ---------------------------------------------------------------------------

    def resource_for(self, group: str, version: str, plural: str) -> ApiResource:
        res = self._api.get((group, version, plural))
        if res is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource",
                           {"group": group, "kind": plural})
        return res

    def find_resource(self, name: str) -> ApiResource:
        """Resolve what kubectl would: ``infdep``, ``inferencedeployments.pdfleet.io``, ``Deployment``, ``deploy.apps``."""
        wanted = name.strip()
        group: str | None = None
        if "." in wanted:
            wanted, group = wanted.split(".", 1)
            if _VERSION_RE.match(group.split(".")[0]):  # plural.version.group
                version, _, group = group.partition(".")
        candidates = []
        for res in self._api.values():
            if group is not None and res.group != group:
                continue
            names = {res.plural, res.singular, res.kind.lower(), *res.shortnames}
            if wanted.lower() in names or wanted == res.kind:
                candidates.append(res)
        if not candidates:
            raise KeyError(f"unknown resource {name!r}")
        # Prefer core, then other built-ins, then custom resources; preferred versions first.
        candidates.sort(key=lambda r: (r.crd is not None, r.group != "", r.group, _version_priority(r.version)))
        return candidates[0]

    def _resources_of_group(self, group: str) -> list[ApiResource]:
        return [r for r in self._api.values() if r.group == group]

    def _group_versions(self) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        for res in self._api.values():
            versions = groups.setdefault(res.group, [])
            if res.version not in versions:
                versions.append(res.version)
        for versions in groups.values():
            versions.sort(key=_version_priority)
        return groups

    def _register_crd(self, crd: dict) -> None:
        spec = crd["spec"]
        names = spec["names"]
        self._unregister_crd(crd, keep_objects=True)
        for entry in spec.get("versions") or []:
            if not entry.get("served", True):
                continue
            subs = set((entry.get("subresources") or spec.get("subresources") or {}).keys())
            res = ApiResource(
                group=spec["group"], version=entry["name"], plural=names["plural"], kind=names["kind"],
                singular=names.get("singular") or names["kind"].lower(),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced", verbs=list(_CRD_VERBS),
                shortnames=list(names.get("shortNames") or []), categories=list(names.get("categories") or []),
                subresources=subs, crd=crd,
            )
            self._api[(res.group, res.version, res.plural)] = res

    def _unregister_crd(self, crd: dict, *, keep_objects: bool) -> None:
        spec = crd["spec"]
        group, plural = spec["group"], spec["names"]["plural"]
        for key in [k for k, r in self._api.items() if r.group == group and r.plural == plural and r.crd is not None]:
            del self._api[key]
        if not keep_objects:
            for key in [k for k in self._store if k[0] == group and k[1] == plural]:
                obj = self._store[key]
                self._remove(key, obj)

    # ---- controllers (opt-in: tests.support.k8s_workloads) -----------------------------------

    def enable_workloads(self) -> k8s_workloads.Workloads:
        """Turn on the Deployment controller, scheduler and kubelet of `k8s_workloads`; returns them."""
        if self.workloads is None:
            self.workloads = k8s_workloads.Workloads(self)
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
        """Run the controllers until nothing changes (after the write that triggered them has finished)."""
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

    # ---- state primitives --------------------------------------------------------------------

    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    @staticmethod
    def _key(res: ApiResource, namespace: str | None, name: str) -> tuple[str, str, str, str]:
        return (res.group, res.plural, (namespace or "") if res.namespaced else "", name)

    def _res_for_key(self, key: tuple[str, str, str, str]) -> ApiResource:
        matches = [r for r in self._api.values() if r.group == key[0] and r.plural == key[1]]
        matches.sort(key=lambda r: _version_priority(r.version))
        return matches[0]

    def _emit(self, type_: str, key: tuple[str, str, str, str], obj: dict, old: dict | None) -> None:
        event = _Event(int(obj["metadata"]["resourceVersion"]), key[0], key[1], key[2], type_, obj, old)
        self._events.append(event)
        for queue in list(self._watchers):
            queue.put_nowait(event)
        if key[0] == RBAC_GROUP:
            self._rbac_rules.clear()
        if self.workloads is not None and key[:2] in k8s_workloads.WATCHED:
            self._workloads_due()

    def _put(self, key: tuple[str, str, str, str], obj: dict, type_: str, old: dict | None) -> dict:
        obj["metadata"]["resourceVersion"] = str(self._next_rv())
        self._store[key] = obj
        self._uids[obj["metadata"]["uid"]] = key
        self._emit(type_, key, copy.deepcopy(obj), copy.deepcopy(old) if old is not None else None)
        return obj

    def _remove(self, key: tuple[str, str, str, str], obj: dict) -> dict:
        """Remove for good: DELETED event, then namespace/CRD/GC follow-ups."""
        if key not in self._store:
            return obj
        old = self._store.pop(key)
        self._applied.pop(key, None)
        final = copy.deepcopy(old)
        final["metadata"]["resourceVersion"] = str(self._next_rv())
        self._uids.pop(final["metadata"].get("uid", ""), None)
        self._emit("DELETED", key, final, old)
        if key[0] == "apiextensions.k8s.io" and key[1] == "customresourcedefinitions":
            self._unregister_crd(final, keep_objects=False)
        self._collect_garbage(final["metadata"].get("uid"))
        if key[2]:
            self._maybe_finish_namespace(key[2])
        return final

    def _collect_garbage(self, owner_uid: str | None) -> None:
        if not owner_uid:
            return
        for key, obj in list(self._store.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if not any(ref.get("uid") == owner_uid for ref in refs):
                continue
            if any(ref.get("uid") in self._uids for ref in refs if ref.get("uid") != owner_uid):
                continue  # another owner is still alive
            if key in self._store:
                self._delete_key(key, propagation="Background")

    def _orphan_dependents(self, owner_uid: str) -> None:
        for key, obj in list(self._store.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if any(ref.get("uid") == owner_uid for ref in refs):
                new = copy.deepcopy(obj)
                kept = [ref for ref in refs if ref.get("uid") != owner_uid]
                if kept:
                    new["metadata"]["ownerReferences"] = kept
                else:
                    new["metadata"].pop("ownerReferences", None)
                self._put(key, new, "MODIFIED", obj)

    def _dependents(self, owner_uid: str) -> list[tuple[str, str, str, str]]:
        return [key for key, obj in self._store.items()
                if any(ref.get("uid") == owner_uid for ref in obj["metadata"].get("ownerReferences") or [])]

    def _maybe_finish_namespace(self, namespace: str) -> None:
        ns_key = ("", "namespaces", "", namespace)
        ns = self._store.get(ns_key)
        if ns is None or not ns["metadata"].get("deletionTimestamp"):
            return
        if any(k[2] == namespace for k in self._store):
            return
        self._remove(ns_key, ns)

    def _delete_key(self, key: tuple[str, str, str, str], *, propagation: str | None) -> dict:
        obj = self._store[key]
        uid = obj["metadata"]["uid"]
        if propagation == "Orphan":
            self._orphan_dependents(uid)
        elif propagation == "Foreground":
            for dep in self._dependents(uid):
                if dep in self._store:
                    self._delete_key(dep, propagation="Foreground")
        obj = self._store.get(key)
        if obj is None:
            return {}
        if key[:2] == ("", "namespaces"):
            return self._terminate_namespace(key, obj)
        if obj["metadata"].get("finalizers"):
            if obj["metadata"].get("deletionTimestamp"):
                return obj
            new = copy.deepcopy(obj)
            new["metadata"]["deletionTimestamp"] = _now()
            new["metadata"]["deletionGracePeriodSeconds"] = 0
            return self._put(key, new, "MODIFIED", obj)
        return self._remove(key, obj)

    def _terminate_namespace(self, key: tuple[str, str, str, str], obj: dict) -> dict:
        if not obj["metadata"].get("deletionTimestamp"):
            new = copy.deepcopy(obj)
            new["metadata"]["deletionTimestamp"] = _now()
            new["status"] = {"phase": "Terminating"}
            obj = self._put(key, new, "MODIFIED", obj)
        name = key[3]
        for sub in [k for k in self._store if k[2] == name]:
            if sub in self._store:
                self._delete_key(sub, propagation="Background")
        self._maybe_finish_namespace(name)
        return self._store.get(key, obj)

    def _check_namespace(self, res: ApiResource, namespace: str | None) -> None:
        if not res.namespaced:
            return
        if not namespace:
            raise _bad_request("the namespace of the object is required for a namespaced resource")
        ns = self._store.get(("", "namespaces", "", namespace))
        if ns is None:
            if self.auto_create_namespaces:
                self._create(self.resource_for("", "v1", "namespaces"), None,
                             {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
                return
            raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found',
                           {"name": namespace, "kind": "namespaces"})
        if ns["metadata"].get("deletionTimestamp"):
            raise ApiError(403, "Forbidden",
                           f'{res.group_resource} is forbidden: unable to create new content in namespace '
                           f'{namespace} because it is being terminated',
                           {"group": res.group, "kind": res.plural})

    # ---- admission ---------------------------------------------------------------------------

    def _admit(self, res: ApiResource, obj: dict, old: dict | None, field_validation: str,
               warnings: list[str]) -> dict:
        """Validate/prune/default a would-be stored object; returns the object to store."""
        self._check_owner_references(res, obj, old)
        name = obj["metadata"].get("name") or obj["metadata"].get("generateName") or ""
        if res.crd is not None:
            crd = res.crd
            mode = field_validation if field_validation in ("Strict", "Warn", "Ignore") else "Warn"
            errors = admission.validate(crd, obj, unknown_fields=mode, old=old)
            unknown = [e for e in errors if e.reason == "FieldValueUnknown"]
            if unknown:
                raise _bad_request("strict decoding error: " + ", ".join(e.message for e in unknown))
            if errors:
                raise _invalid(res, name, errors)
            if mode == "Warn":
                warnings += [f'unknown field "{p}"' for p in admission.unknown_fields(crd, obj)]
            obj = admission.apply_defaults(crd, admission.prune_unknown(crd, obj))
        elif res.group == "apiextensions.k8s.io" and res.plural == "customresourcedefinitions":
            errors = admission.check_crd(obj)
            if errors:
                raise _invalid(res, name, errors)
        if old is None and obj["metadata"].get("name"):
            label = res.group == "" and res.plural in ("namespaces", "services")
            msgs = admission.name_errors(obj["metadata"]["name"], label=label)
            if msgs:
                raise _invalid(res, name, [admission.FieldError(
                    "metadata.name", "FieldValueInvalid",
                    f'Invalid value: {json.dumps(obj["metadata"]["name"])}: {msgs[0]}')])
        return obj

    def _normalize(self, res: ApiResource, body: Any, namespace: str | None, name: str | None) -> dict:
        if not isinstance(body, dict):
            raise _bad_request("the body of the request must be a JSON/YAML object")
        obj = copy.deepcopy(body)
        if obj.get("kind") not in (None, res.kind):
            raise _bad_request(f'the kind of the object ({obj.get("kind")}) does not match the expected kind ({res.kind})')
        api_version = obj.get("apiVersion")
        if api_version not in (None, res.api_version):
            known = {r.api_version for r in self._api.values() if r.group == res.group and r.plural == res.plural}
            if api_version not in known:
                raise _bad_request(f"the API version in the data ({api_version}) does not match the "
                                   f"expected API version ({res.api_version})")
        obj["apiVersion"], obj["kind"] = res.api_version, res.kind
        meta = obj.get("metadata")
        if meta is None:
            meta = obj["metadata"] = {}
        if not isinstance(meta, dict):
            raise _bad_request("metadata must be an object")
        if res.namespaced:
            if namespace and meta.get("namespace") and meta["namespace"] != namespace:
                raise _bad_request("the namespace of the provided object does not match the namespace sent on the request")
            if namespace:
                meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        if name is not None:
            if meta.get("name") and meta["name"] != name:
                raise _bad_request(f"the name of the object ({meta['name']}) does not match the name on the URL ({name})")
            meta["name"] = name
        for key in ("selfLink", "managedFields"):
            meta.pop(key, None)
        return obj

    @staticmethod
    def _spec_part(res: ApiResource, obj: dict) -> dict:
        drop = {"metadata", "status"} if res.has_status else {"metadata"}
        return {k: v for k, v in obj.items() if k not in drop}

    @staticmethod
    def _tracks_generation(res: ApiResource) -> bool:
        return res.crd is not None or (res.has_status and res.plural != "namespaces")

    # ---- verbs (synchronous, atomic on the loop) ---------------------------------------------

    def _create(self, res: ApiResource, namespace: str | None, body: Any, *, dry_run: bool = False,
                field_validation: str = "Warn", warnings: list[str] | None = None) -> dict:
        warnings = warnings if warnings is not None else []
        obj = self._normalize(res, body, namespace, None)
        meta = obj["metadata"]
        namespace = meta.get("namespace") if res.namespaced else None
        if res.namespaced and not namespace:
            namespace = meta["namespace"] = "default"
        self._check_namespace(res, namespace)
        if not meta.get("name"):
            if meta.get("generateName"):
                alphabet = string.ascii_lowercase + string.digits
                meta["name"] = meta["generateName"] + "".join(secrets.choice(alphabet) for _ in range(5))
            else:
                raise _invalid(res, "", [admission.FieldError("metadata.name", "FieldValueRequired",
                                                             "Required value: name or generateName is required")])
        key = self._key(res, namespace, meta["name"])
        if key in self._store:
            raise ApiError(409, "AlreadyExists", f'{res.group_resource} "{meta["name"]}" already exists',
                           {"name": meta["name"], "group": res.group, "kind": res.plural})
        for k in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
            meta.pop(k, None)
        if res.has_status:
            obj.pop("status", None)  # status is written through the /status subresource only
        obj = self._admit(res, obj, None, field_validation, warnings)
        meta = obj["metadata"]
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        if self._tracks_generation(res):
            meta["generation"] = 1
        else:
            meta.pop("generation", None)
        if key[:2] == ("", "namespaces"):
            meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = meta["name"]
            obj["spec"] = {"finalizers": ["kubernetes"]}
            obj["status"] = {"phase": "Active"}
        if key[:2] == ("apiextensions.k8s.io", "customresourcedefinitions"):
            obj["status"] = self._crd_status(obj)
        if dry_run:
            return obj
        self._put(key, obj, "ADDED", None)
        if key[:2] == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self._register_crd(obj)
        return copy.deepcopy(obj)

    @staticmethod
    def _crd_status(crd: dict) -> dict:
        names = copy.deepcopy(crd["spec"]["names"])
        names.setdefault("singular", names["kind"].lower())
        names.setdefault("listKind", names["kind"] + "List")
        now = _now()
        return {
            "acceptedNames": names,
            "conditions": [
                {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts",
                 "message": "no conflicts found", "lastTransitionTime": now},
                {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
                 "message": "the initial names have been accepted", "lastTransitionTime": now},
            ],
            "storedVersions": [v["name"] for v in crd["spec"].get("versions") or [] if v.get("storage")],
        }

    def _update(self, res: ApiResource, namespace: str | None, name: str, body: Any, *,
                subresource: str | None = None, dry_run: bool = False, field_validation: str = "Warn",
                warnings: list[str] | None = None, old: dict | None = None) -> dict:
        warnings = warnings if warnings is not None else []
        key = self._key(res, namespace, name)
        if old is None:
            old = self._store.get(key)
            if old is None:
                raise _not_found(res, name)
        new = self._normalize(res, body, namespace if res.namespaced else None, name)
        meta = new["metadata"]
        sent_rv = meta.get("resourceVersion")
        if sent_rv and sent_rv != old["metadata"]["resourceVersion"]:
            raise _conflict(res, name)
        if subresource == "status":
            status = new.get("status")
            new = copy.deepcopy(old)
            if status is None:
                new.pop("status", None)
            else:
                new["status"] = status
        elif subresource:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({subresource})")
        elif res.has_status:
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        meta = new["metadata"]
        old_meta = old["metadata"]
        for k in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds"):
            if k in old_meta:
                meta[k] = old_meta[k]
            else:
                meta.pop(k, None)
        meta["resourceVersion"] = old_meta["resourceVersion"]
        if old_meta.get("deletionTimestamp"):
            added = set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or [])
            if added:
                raise _invalid(res, name, [admission.FieldError(
                    "metadata.finalizers", "FieldValueForbidden",
                    f"Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers {json.dumps(sorted(added))}")])
        if key[:2] == ("", "namespaces"):
            new["spec"] = copy.deepcopy(old.get("spec", {}))
            meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = name
        new = self._admit(res, new, old, field_validation, warnings)
        meta = new["metadata"]
        if self._tracks_generation(res):
            generation = old_meta.get("generation", 1)
            if self._spec_part(res, new) != self._spec_part(res, old):
                generation += 1
            meta["generation"] = generation
        if key[:2] == ("apiextensions.k8s.io", "customresourcedefinitions") and subresource != "status":
            new["status"] = self._crd_status(new)
        if new == old:
            return copy.deepcopy(old)  # a no-op: no new resourceVersion, no watch event
        if dry_run:
            return new
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            # As kube-apiserver: emptying the finalizers of a deleting object deletes it (only DELETED is seen).
            self._store[key] = new
            return self._remove(key, new)
        self._put(key, new, "MODIFIED", old)
        if key[:2] == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self._register_crd(new)
        return copy.deepcopy(new)

    def _patch(self, res: ApiResource, namespace: str | None, name: str, patch_type: str, patch: Any, *,
               subresource: str | None = None, dry_run: bool = False, field_validation: str = "Warn",
               field_manager: str | None = None, warnings: list[str] | None = None) -> tuple[dict, bool]:
        """Returns (object, created)."""
        warnings = warnings if warnings is not None else []
        key = self._key(res, namespace, name)
        old = self._store.get(key)
        if patch_type == "apply":
            if not field_manager:
                raise _bad_request("PATCH request with apply content type requires fieldManager")
            if not isinstance(patch, dict):
                raise _bad_request("the apply configuration must be an object")
            if old is None:
                if subresource:
                    raise _not_found(res, name)
                body = copy.deepcopy(patch)
                body.setdefault("metadata", {})["name"] = body.get("metadata", {}).get("name") or name
                if res.namespaced:
                    body["metadata"].setdefault("namespace", namespace)
                if body["metadata"]["name"] != name:
                    raise _bad_request(f"the name of the object ({body['metadata']['name']}) does not match the name on the URL ({name})")
                created = self._create(res, namespace, body, dry_run=dry_run, field_validation=field_validation,
                                       warnings=warnings)
                if res.has_status and patch.get("status") is not None and not dry_run:
                    pass  # status in an apply on the main resource is ignored, as on a real server
                if not dry_run:
                    self._applied.setdefault(key, {})[field_manager] = copy.deepcopy(patch)
                return created, True
            merged = _deep_merge(old, {k: v for k, v in patch.items()})
            previous = self._applied.get(key, {}).get(field_manager)
            if previous is not None:
                for path in _leaf_paths(previous) - _leaf_paths(patch):
                    if path and path[0] not in ("apiVersion", "kind") and path[:2] != ("metadata", "name") \
                            and path[:2] != ("metadata", "namespace"):
                        still = any(p[:len(path)] == path for p in _leaf_paths(patch))
                        if not still:
                            _delete_path(merged, path)
            new = merged
            if "resourceVersion" not in (patch.get("metadata") or {}):
                new["metadata"].pop("resourceVersion", None)
            result = self._update(res, namespace, name, new, subresource=subresource, dry_run=dry_run,
                                  field_validation=field_validation, warnings=warnings, old=old)
            if not dry_run:
                self._applied.setdefault(key, {})[field_manager] = copy.deepcopy(patch)
            return result, False
        if old is None:
            raise _not_found(res, name)
        current = copy.deepcopy(old)
        try:
            if patch_type == "json":
                new = json_patch(current, patch)
            elif patch_type == "merge":
                new = json_merge_patch(current, patch)
            elif patch_type == "strategic":
                if res.crd is not None:
                    raise ApiError(415, "UnsupportedMediaType",
                                   "the body of the request was in an unknown format - accepted media types include: "
                                   "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml")
                new = strategic_merge_patch(current, patch)
            else:
                raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - {patch_type}")
        except TypeError as exc:
            raise _bad_request(str(exc)) from None
        except ValueError as exc:
            raise _unprocessable(str(exc)) from None
        if not isinstance(new, dict):
            raise _unprocessable("the patched object is not an object")
        # A resourceVersion that the patch itself sets acts as a precondition; otherwise the current one.
        patched_rv = (new.get("metadata") or {}).get("resourceVersion")
        if patched_rv != old["metadata"]["resourceVersion"]:
            if patched_rv:
                raise _conflict(res, name)
        return self._update(res, namespace, name, new, subresource=subresource, dry_run=dry_run,
                            field_validation=field_validation, warnings=warnings, old=old), False

    def _delete(self, res: ApiResource, namespace: str | None, name: str, options: dict, *,
                dry_run: bool = False) -> tuple[dict, bool]:
        """Returns (object, gone_now)."""
        key = self._key(res, namespace, name)
        obj = self._store.get(key)
        if obj is None:
            raise _not_found(res, name)
        pre = options.get("preconditions") or {}
        if pre.get("uid") and pre["uid"] != obj["metadata"]["uid"]:
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {res.group_resource} "{name}": '
                           f'Precondition failed: UID in precondition: {pre["uid"]}, UID in object meta: {obj["metadata"]["uid"]}')
        if pre.get("resourceVersion") and pre["resourceVersion"] != obj["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {res.group_resource} "{name}": '
                           f'Precondition failed: ResourceVersion in precondition: {pre["resourceVersion"]}, '
                           f'ResourceVersion in object meta: {obj["metadata"]["resourceVersion"]}')
        if dry_run:
            return copy.deepcopy(obj), not obj["metadata"].get("finalizers")
        propagation = options.get("propagationPolicy")
        if propagation is None and options.get("orphanDependents") is True:
            propagation = "Orphan"
        result = self._delete_key(key, propagation=propagation)
        return copy.deepcopy(result), key not in self._store

    # ---- reading -----------------------------------------------------------------------------

    def _matching(self, res: ApiResource, namespace: str | None, label_sel: Callable[[dict], bool] | None,
                  field_sel: Callable[[dict], bool] | None) -> list[dict]:
        items = []
        for key in sorted(k for k in self._store if k[0] == res.group and k[1] == res.plural):
            if res.namespaced and namespace and key[2] != namespace:
                continue
            obj = self._store[key]
            if self._selected(obj, label_sel, field_sel):
                items.append(self._as_version(res, obj))
        return items

    @staticmethod
    def _selected(obj: dict, label_sel: Callable[[dict], bool] | None, field_sel: Callable[[dict], bool] | None) -> bool:
        if label_sel is not None and not label_sel(obj["metadata"].get("labels") or {}):
            return False
        if field_sel is not None and not field_sel(obj):
            return False
        return True

    @staticmethod
    def _as_version(res: ApiResource, obj: dict) -> dict:
        out = copy.deepcopy(obj)
        out["apiVersion"] = res.api_version
        return out

    def get_object(self, res: ApiResource, namespace: str | None, name: str) -> dict:
        obj = self._store.get(self._key(res, namespace, name))
        if obj is None:
            raise _not_found(res, name)
        return self._as_version(res, obj)

    def list_objects(self, res: ApiResource, namespace: str | None = None, label_selector: str | None = None,
                     field_selector: str | None = None) -> list[dict]:
        return self._matching(res, namespace, parse_label_selector(label_selector) if label_selector else None,
                              parse_field_selector(field_selector) if field_selector else None)

    def compact(self) -> int:
        """Forget the event history: watches from an older resourceVersion get 410 Gone (like etcd compaction)."""
        self._compacted_rv = self._rv
        self._events.clear()
        return self._rv

    @property
    def resource_version(self) -> int:
        return self._rv

    # ---- RBAC --------------------------------------------------------------------------------

    def service_account(self, namespace: str, name: str, pod: str | None = None) -> str:
        """Register (or find) a token for ServiceAccount ``namespace/name`` (bound to `pod`); its requests are then
        authorized by RBAC."""
        who = service_account_user(namespace, name, pod)
        for token, known in self.users.items():
            if known == who:
                return token
        token = f"sa-{namespace}-{name}-{secrets.token_hex(8)}"
        self.users[token] = who
        return token

    def _requester(self, raw: aiohttp.web.BaseRequest) -> Requester | None:
        scheme, _, token = (raw.headers.get("Authorization") or "").partition(" ")
        return self.users.get(token.strip()) if scheme.lower() == "bearer" else None

    def _rules_for(self, who: Requester, namespace: str | None) -> list[dict]:
        """Every PolicyRule granted to `who` that applies in `namespace` (None: cluster scope only); cached until
        an RBAC object changes."""
        cached = self._rbac_rules.get((who, namespace))
        if cached is None:
            cached = self._rbac_rules[(who, namespace)] = list(self._find_rules(who, namespace))
        return cached

    def _find_rules(self, who: Requester, namespace: str | None) -> Iterable[dict]:
        def role_rules(kind: str, role_ns: str, name: str) -> list[dict]:
            plural = "clusterroles" if kind == "ClusterRole" else "roles"
            role = self._store.get((RBAC_GROUP, plural, role_ns if kind == "Role" else "", name))
            return list((role or {}).get("rules") or [])

        for (group, plural, _, _), binding in self._store.items():
            if group != RBAC_GROUP or plural != "clusterrolebindings":
                continue
            if any(_subject_matches(s, who) for s in binding.get("subjects") or []):
                yield from role_rules("ClusterRole", "", binding["roleRef"]["name"])
        if namespace:
            for (group, plural, ns, _), binding in self._store.items():
                if group != RBAC_GROUP or plural != "rolebindings" or ns != namespace:
                    continue
                if any(_subject_matches(s, who) for s in binding.get("subjects") or []):
                    yield from role_rules(binding["roleRef"]["kind"], namespace, binding["roleRef"]["name"])

    def allowed(self, who: Requester, verb: str, group: str, resource: str, subresource: str | None = None,
                namespace: str | None = None, name: str | None = None) -> bool:
        """Whether the stored Roles/ClusterRoles and their bindings let `who` do this (system:masters may do anything)."""
        if "system:masters" in who.groups:
            return True
        return any(rule_allows(r, group, resource, subresource, verb, name) for r in self._rules_for(who, namespace))

    def _authorize(self, who: Requester, entry: LoggedRequest) -> None:
        """RBAC for one request; non-resource URLs (discovery, /version, /healthz) are allowed to everyone, as the
        system:discovery and system:public-info-viewer ClusterRoles do on a cluster."""
        if entry.verb is None or entry.resource is None:
            return
        group = entry.group or ""
        verbs = [entry.verb]
        if entry.patch_type == "apply" and entry.subresource is None:
            res = self._api.get((group, entry.version or "", entry.resource))
            if res is not None and self._key(res, entry.namespace, entry.name or "") not in self._store:
                verbs.append("create")  # an apply that creates is authorized as create as well
        for verb in verbs:
            if not self.allowed(who, verb, group, entry.resource, entry.subresource, entry.namespace, entry.name):
                raise _forbidden(who, verb, group, entry.resource, entry.subresource, entry.namespace, entry.name)

    def _check_owner_references(self, res: ApiResource, obj: dict, old: dict | None) -> None:
        """The OwnerReferencesPermissionEnforcement admission plugin, for requests authorized by RBAC: changing
        an existing object's ownerReferences needs `delete` on it, and setting `blockOwnerDeletion: true` on a
        reference needs `update` on the owner's `finalizers` subresource."""
        who = _REQUESTER.get()
        if who is None:
            return
        refs = list((obj.get("metadata") or {}).get("ownerReferences") or [])
        before = list(((old or {}).get("metadata") or {}).get("ownerReferences") or [])
        if refs == before:
            return
        meta = obj.get("metadata") or {}
        namespace, name = meta.get("namespace"), meta.get("name")
        if old is not None and not self.allowed(who, "delete", res.group, res.plural, None, namespace, name):
            raise _forbidden(who, "delete", res.group, res.plural, None, namespace, name,
                             prefix="cannot set an ownerRef on a resource you can't delete: ")
        blocking_before = {r.get("uid") for r in before if r.get("blockOwnerDeletion")}
        for ref in refs:
            if not ref.get("blockOwnerDeletion") or ref.get("uid") in blocking_before:
                continue
            group, _, version = str(ref.get("apiVersion") or "").rpartition("/")
            owners = [r for r in self._api.values() if r.group == group and r.version == version and r.kind == ref.get("kind")]
            if not owners:
                raise Forbidden(403, "Forbidden", f'{res.group_resource} "{name}" is forbidden: cannot set '
                                f'blockOwnerDeletion in this case because cannot find RESTMapping for APIVersion '
                                f'{ref.get("apiVersion")} Kind {ref.get("kind")}')
            for owner in owners:
                owner_ns = namespace if owner.namespaced else None
                if not self.allowed(who, "update", owner.group, owner.plural, "finalizers", owner_ns, ref.get("name")):
                    raise _forbidden(who, "update", owner.group, owner.plural, "finalizers", owner_ns, ref.get("name"),
                                     prefix="cannot set blockOwnerDeletion if an ownerReference refers to a resource "
                                            "you can't set finalizers on: ")

    # ---- HTTP --------------------------------------------------------------------------------

    _ACTIONS = {"get": kmock.action.FETCH, "list": kmock.action.LIST, "watch": kmock.action.WATCH,
                "create": kmock.action.CREATE, "update": kmock.action.UPDATE, "patch": kmock.action.UPDATE,
                "delete": kmock.action.DELETE, "deletecollection": kmock.action.DELETE}

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # Replaces kmock's entry point: its path parser crashes on /api/v1/namespaces and knows no PUT.
        body = await raw_request.read()
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        parsed = self._split_path(raw_request.path)
        fields: dict[str, Any] = {}
        if parsed and not parsed.get("invalid") and parsed["plural"]:
            watch = raw_request.query.get("watch") in ("true", "1") or parsed["legacy_watch"]
            method = raw_request.method.upper()
            verb = ("watch" if watch else "get" if parsed["name"] else "list") if method == "GET" else \
                {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method) or \
                (("delete" if parsed["name"] else "deletecollection") if method == "DELETE" else None)
            fields = dict(action=self._ACTIONS.get(verb or ""),
                          resource=kmock.resource(parsed["group"], parsed["version"], parsed["plural"]),
                          namespace=parsed["namespace"], name=parsed["name"], subresource=parsed["subresource"])
        request = kmock.Request(
            id=len(self._requests), raw_request=raw_request, url=raw_request.url, method=raw_request.method,
            params=dict(raw_request.query), headers=dict(raw_request.headers), cookies=dict(raw_request.cookies),
            body=body, text=body.decode("utf-8", "replace"), data=data, **fields)
        self._requests.append(request)
        try:
            return await self._handle(request)
        except _kmock_rendering.StreamingError as exc:  # a user-defined streaming reaction failed mid-way
            response = exc.args[0]
            await self._stream_error(exc.__cause__ or exc, response)
            await response.write_eof()
            return response
        except Exception as exc:
            return self._json(ApiError(500, "InternalError", f"emulator error: {exc!r}",
                                       {"causes": [{"message": traceback.format_exc()}]}).status(), status=500)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        assert raw is not None
        entry = self._log_entry(request)
        self.log.append(entry)
        who = self._requester(raw)
        _REQUESTER.set(who)  # (always: aiohttp serves a keep-alive connection's requests in one task)
        if who is not None:
            entry.user, entry.pod = who.user, who.pod
            try:
                self._authorize(who, entry)
            except Forbidden as exc:
                entry.status, entry.denied = exc.code, exc.message
                return self._json(exc.status(), status=exc.code)
        if self._payloads:  # user-defined kmock reactions take precedence (e.g. to inject failures)
            try:
                response = await _kmock_apps.RawHandler._handle(self, request)
                entry.status = response.status
                return response
            except NotImplementedError:  # NOTE: kmock's own signal that no user reaction matched
                pass
        try:
            response = await self._dispatch(request, entry)
        except ApiError as exc:
            if isinstance(exc, Forbidden):
                entry.denied = exc.message
            response = self._json(exc.status(), status=exc.code)
        except Exception as exc:  # a bug in the emulator: say so loudly, as an InternalError Status
            response = self._json(ApiError(500, "InternalError", f"emulator error: {exc!r}",
                                           {"causes": [{"message": traceback.format_exc()}]}).status(), status=500)
        entry.status = response.status
        return response

    @staticmethod
    def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> aiohttp.web.Response:
        return aiohttp.web.Response(body=json.dumps(body).encode(), status=status, content_type=JSON,
                                    headers=headers or {})

    @staticmethod
    def _split_path(path: str) -> dict | None:
        parts = [p for p in path.split("/") if p]
        if len(parts) >= 2 and parts[0] == "api":
            group, version, rest = "", parts[1], parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return None
        legacy_watch = bool(rest) and rest[0] == "watch"
        if legacy_watch:
            rest = rest[1:]
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] not in ("status", "finalize"):
            namespace, rest = rest[1], rest[2:]
        if len(rest) > 3:
            return {"invalid": True}
        return {"group": group, "version": version, "namespace": namespace, "legacy_watch": legacy_watch,
                "plural": rest[0] if rest else None, "name": rest[1] if len(rest) > 1 else None,
                "subresource": rest[2] if len(rest) > 2 else None}

    def _log_entry(self, request: kmock.Request) -> LoggedRequest:
        raw = request._raw_request
        assert raw is not None
        query = dict(raw.query)
        parsed = self._split_path(raw.path)
        method = raw.method.upper()
        entry = LoggedRequest(method=method, path=raw.path, verb=None, query=query,
                              content_type=(raw.headers.get("Content-Type") or "").split(";")[0].strip() or None,
                              user_agent=raw.headers.get("User-Agent"))
        if parsed and not parsed.get("invalid") and parsed["plural"]:
            entry.group, entry.version, entry.resource = parsed["group"], parsed["version"], parsed["plural"]
            entry.namespace, entry.name, entry.subresource = parsed["namespace"], parsed["name"], parsed["subresource"]
            watch = query.get("watch") in ("true", "1") or parsed["legacy_watch"]
            if method == "GET":
                entry.verb = "watch" if watch else ("get" if entry.name else "list")
            elif method == "POST":
                entry.verb = "create"
            elif method == "PUT":
                entry.verb = "update"
            elif method == "PATCH":
                entry.verb = "patch"
            elif method == "DELETE":
                entry.verb = "delete" if entry.name else "deletecollection"
            if entry.verb in WRITE_VERBS and request.body:
                entry.body = self._decode(request.body, entry.content_type, quiet=True)
        return entry

    @staticmethod
    def _decode(body: bytes, content_type: str | None, *, quiet: bool = False) -> Any:
        if content_type and "protobuf" in content_type:
            if quiet:
                return None
            raise ApiError(415, "UnsupportedMediaType",
                           "the emulator does not speak protobuf (send JSON: e.g. use `kubectl apply` rather than "
                           "`kubectl create <typed resource>`)")
        if not body:
            return None
        try:
            if content_type and "yaml" in content_type:
                return yaml.safe_load(body)
            return json.loads(body)
        except (ValueError, yaml.YAMLError) as exc:
            if quiet:
                return None
            raise _bad_request(f"the body of the request could not be decoded: {exc}") from None

    async def _dispatch(self, request: kmock.Request, entry: LoggedRequest) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        assert raw is not None
        path = raw.path.rstrip("/") or "/"
        method = raw.method.upper()
        simple = self._serve_non_resource(path, method)
        if simple is not None:
            return simple
        parsed = self._split_path(path)
        if parsed is None or parsed.get("invalid"):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if parsed["plural"] is None:
            return self._json(self._discovery_version(parsed["group"], parsed["version"]))
        res = self.resource_for(parsed["group"], parsed["version"], parsed["plural"])
        namespace, name, sub = parsed["namespace"], parsed["name"], parsed["subresource"]
        if namespace is not None and not res.namespaced:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if sub is not None and sub not in res.subresources:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({sub})")
        if sub is not None and sub != "status":
            raise ApiError(405, "MethodNotAllowed", f"the emulator does not serve the {sub} subresource")
        query = entry.query
        dry_run = "All" in raw.query.getall("dryRun", [])
        field_validation = query.get("fieldValidation") or "Warn"
        warnings: list[str] = []
        accept = raw.headers.get("Accept", "")
        table = "as=Table" in accept.replace(" ", "")

        if entry.verb == "watch":
            if name:
                query = dict(query)
                query["fieldSelector"] = ",".join(filter(None, [query.get("fieldSelector"), f"metadata.name={name}"]))
            return await self._serve_watch(raw, res, namespace, query, table, entry)
        if entry.verb == "list":
            items = self.list_objects(res, namespace, query.get("labelSelector"), query.get("fieldSelector"))
            entry.objects = [_object_ref(o) for o in items]
            if table:
                return self._json(self._table(res, items, query.get("includeObject")))
            return self._json({"apiVersion": res.api_version, "kind": f"{res.kind}List",
                               "metadata": {"resourceVersion": str(self._rv)}, "items": items})
        if entry.verb == "get":
            obj = self.get_object(res, namespace, name)
            if table:
                return self._json(self._table(res, [obj], query.get("includeObject")))
            return self._json(obj)

        body = self._decode(request.body, entry.content_type)
        if entry.verb == "create":
            if name:
                raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")
            obj = self._create(res, namespace, body, dry_run=dry_run, field_validation=field_validation, warnings=warnings)
            return self._json(self._as_version(res, obj), 201, self._warning_headers(warnings))
        if entry.verb == "update":
            sent_rv = ((body.get("metadata") or {}) if isinstance(body, dict) else {}).get("resourceVersion")
            if res.crd is not None and isinstance(body, dict) and not sent_rv:
                # Custom resources do not allow unconditional updates (AllowUnconditionalUpdate is false).
                raise _invalid(res, name or "", [admission.FieldError(
                    "metadata.resourceVersion", "FieldValueInvalid",
                    "Invalid value: 0x0: must be specified for an update")])
            obj = self._update(res, namespace, name, body, subresource=sub, dry_run=dry_run,
                               field_validation=field_validation, warnings=warnings)
            return self._json(self._as_version(res, obj), 200, self._warning_headers(warnings))
        if entry.verb == "patch":
            patch_type = entry.patch_type
            if patch_type not in ("merge", "json", "strategic", "apply"):
                raise ApiError(415, "UnsupportedMediaType",
                               f"the body of the request was in an unknown format - accepted media types include: "
                               f"application/json-patch+json, application/merge-patch+json, "
                               f"application/apply-patch+yaml, application/strategic-merge-patch+json")
            if body is None:
                raise _bad_request("the patch body is empty")
            obj, created = self._patch(res, namespace, name, patch_type, body, subresource=sub, dry_run=dry_run,
                                       field_validation=field_validation if patch_type != "apply" or "fieldValidation" in query else "Strict",
                                       field_manager=query.get("fieldManager"), warnings=warnings)
            return self._json(self._as_version(res, obj), 201 if created else 200, self._warning_headers(warnings))
        if entry.verb == "delete":
            options = body if isinstance(body, dict) else {}
            for k in ("propagationPolicy", "gracePeriodSeconds"):
                if k in query:
                    options[k] = query[k]
            if "orphanDependents" in query:
                options["orphanDependents"] = query["orphanDependents"] == "true"
            dry_run = dry_run or "All" in (options.get("dryRun") or [])
            obj, gone = self._delete(res, namespace, name, options, dry_run=dry_run)
            if gone:
                return self._json({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                   "details": {"name": name, "group": res.group, "kind": res.plural,
                                               "uid": obj.get("metadata", {}).get("uid")}})
            return self._json(self._as_version(res, obj))
        if entry.verb == "deletecollection":
            options = body if isinstance(body, dict) else {}
            items = self.list_objects(res, namespace, query.get("labelSelector"), query.get("fieldSelector"))
            deleted = []
            for item in items:
                key = self._key(res, item["metadata"].get("namespace"), item["metadata"]["name"])
                if key in self._store and not dry_run:
                    self._delete_key(key, propagation=options.get("propagationPolicy") or query.get("propagationPolicy"))
                deleted.append(item)
            return self._json({"apiVersion": res.api_version, "kind": f"{res.kind}List",
                               "metadata": {"resourceVersion": str(self._rv)}, "items": deleted})
        raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")

    @staticmethod
    def _warning_headers(warnings: list[str]) -> dict[str, str]:
        if not warnings:
            return {}
        return {"Warning": ", ".join('299 - ' + json.dumps(w) for w in warnings)}

    # ---- discovery and other non-resource endpoints ------------------------------------------

    def _serve_non_resource(self, path: str, method: str) -> aiohttp.web.StreamResponse | None:
        if method != "GET":
            return None
        if path in ("/healthz", "/readyz", "/livez"):
            return aiohttp.web.Response(text="ok", content_type="text/plain")
        if path == "/version":
            return self._json({"major": "1", "minor": "33", "gitVersion": "v1.33.0-pdfleet-emulator",
                               "gitCommit": "0000000000000000000000000000000000000000", "gitTreeState": "clean",
                               "buildDate": "2025-01-01T00:00:00Z", "goVersion": "go1.24", "compiler": "gc",
                               "platform": "linux/amd64"})
        if path == "/openapi/v2":
            # An empty protobuf document: kubectl then skips client-side schema validation.
            return aiohttp.web.Response(body=b"", content_type="application/octet-stream")
        if path.startswith("/openapi"):
            raise ApiError(404, "NotFound", "the emulator serves no OpenAPI v3 documents")
        if path == "/":
            paths = {"/api", "/api/v1", "/apis", "/version", "/healthz", "/readyz", "/livez", "/openapi/v2"}
            for group, versions in self._group_versions().items():
                if group:
                    paths.add(f"/apis/{group}")
                    paths |= {f"/apis/{group}/{v}" for v in versions}
            return self._json({"paths": sorted(paths)})
        if path == "/api":
            return self._json({"kind": "APIVersions", "versions": ["v1"],
                               "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]})
        if path == "/apis":
            groups = [self._api_group(g, vs) for g, vs in self._group_versions().items() if g]
            return self._json({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
        m = re.fullmatch(r"/apis/([^/]+)", path)
        if m:
            versions = self._group_versions().get(m.group(1))
            if not versions:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            return self._json(dict(self._api_group(m.group(1), versions), kind="APIGroup", apiVersion="v1"))
        return None

    @staticmethod
    def _api_group(group: str, versions: list[str]) -> dict:
        return {"name": group,
                "versions": [{"groupVersion": f"{group}/{v}", "version": v} for v in versions],
                "preferredVersion": {"groupVersion": f"{group}/{versions[0]}", "version": versions[0]}}

    def _discovery_version(self, group: str, version: str) -> dict:
        resources = [r for r in self._api.values() if r.group == group and r.version == version]
        if not resources:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        entries = []
        for res in sorted(resources, key=lambda r: r.plural):
            entry = {"name": res.plural, "singularName": res.singular, "namespaced": res.namespaced,
                     "kind": res.kind, "verbs": list(res.verbs)}
            if res.shortnames:
                entry["shortNames"] = list(res.shortnames)
            if res.categories:
                entry["categories"] = list(res.categories)
            entries.append(entry)
            for sub in sorted(res.subresources):
                verbs = ["get", "patch", "update"] if sub in ("status", "scale") else ["get"]
                entries.append({"name": f"{res.plural}/{sub}", "singularName": "", "namespaced": res.namespaced,
                                "kind": res.kind, "verbs": verbs})
        return {"kind": "APIResourceList", "apiVersion": "v1",
                "groupVersion": f"{group}/{version}" if group else version, "resources": entries}

    # ---- tables ------------------------------------------------------------------------------

    def _columns(self, res: ApiResource) -> list[dict]:
        columns = [{"name": "Name", "type": "string", "format": "name", "priority": 0,
                    "description": "Name must be unique within a namespace.", "jsonPath": ".metadata.name"}]
        version = res.crd_version
        printer = (version or {}).get("additionalPrinterColumns") if version is not None else None
        if printer is None and res.crd is not None:
            printer = res.crd["spec"].get("additionalPrinterColumns")
        if printer:
            for col in printer:
                columns.append({"name": col["name"], "type": col.get("type", "string"), "format": col.get("format", ""),
                                "description": col.get("description", ""), "priority": col.get("priority", 0),
                                "jsonPath": col.get("jsonPath") or col.get("JSONPath")})
            return columns
        if (res.group, res.plural) == ("", "namespaces"):
            columns.append({"name": "Status", "type": "string", "format": "", "priority": 0,
                            "description": "The phase of the namespace.", "jsonPath": ".status.phase"})
        columns.append({"name": "Age", "type": "date", "format": "", "priority": 0,
                        "description": "CreationTimestamp is a timestamp representing the server time when this object was created.",
                        "jsonPath": ".metadata.creationTimestamp"})
        return columns

    @staticmethod
    def _cell(column: dict, obj: dict) -> Any:
        try:
            values = jsonpath(obj, column["jsonPath"])
        except ValueError:
            return None
        if not values:
            return None
        if column["type"] == "date":
            return _age(values[0]) if isinstance(values[0], str) else None
        if len(values) > 1:
            return ",".join(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in values)
        value = values[0]
        if isinstance(value, (dict, list)):
            return json.dumps(value, separators=(",", ":"))
        if column["type"] == "integer" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value)
        if column["type"] == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        if column["type"] == "boolean" and isinstance(value, bool):
            return value
        if column["type"] == "string":
            return str(value).lower() if isinstance(value, bool) else str(value)
        return value

    def _table(self, res: ApiResource, objs: list[dict], include_object: str | None, *,
               with_columns: bool = True) -> dict:
        columns = self._columns(res)
        rows = []
        for obj in objs:
            if include_object == "Object":
                embedded: Any = obj
            elif include_object == "None":
                embedded = None
            else:
                embedded = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}
            rows.append({"cells": [self._cell(c, obj) for c in columns], "object": embedded})
        table = {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": str(self._rv)},
                 "rows": rows}
        if with_columns:
            table["columnDefinitions"] = [{k: v for k, v in c.items() if k != "jsonPath"} for c in columns]
        return table

    # ---- watches -----------------------------------------------------------------------------

    async def _serve_watch(self, raw: aiohttp.web.BaseRequest, res: ApiResource, namespace: str | None,
                           query: dict[str, str], table: bool, entry: LoggedRequest | None = None) -> aiohttp.web.StreamResponse:
        label_sel = parse_label_selector(query["labelSelector"]) if query.get("labelSelector") else None
        field_sel = parse_field_selector(query["fieldSelector"]) if query.get("fieldSelector") else None
        rv_param = query.get("resourceVersion") or ""
        send_initial = query.get("sendInitialEvents") == "true"
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        if rv_param and rv_param != "0" and not rv_param.isdigit():
            raise _bad_request(f"invalid resource version: {rv_param!r}")

        def selected(obj: dict | None) -> bool:
            if obj is None:
                return False
            if res.namespaced and namespace and obj["metadata"].get("namespace") != namespace:
                return False
            return self._selected(obj, label_sel, field_sel)

        def translate(event: _Event) -> tuple[str, dict] | None:
            if event.group != res.group or event.plural != res.plural:
                return None
            now, before = selected(event.obj), selected(event.old)
            if event.type == "ADDED":
                return ("ADDED", event.obj) if now else None
            if event.type == "DELETED":
                return ("DELETED", event.obj) if before or now else None
            if now and before:
                return ("MODIFIED", event.obj)
            if now:
                return ("ADDED", event.obj)
            if before:
                return ("DELETED", event.obj)
            return None

        # Everything below up to the first await is atomic: no event can slip between the snapshot and the queue.
        queue: asyncio.Queue = asyncio.Queue()
        initial: list[tuple[str, dict]] = []
        gone = False
        if send_initial or not rv_param or rv_param == "0":
            initial = [("ADDED", obj) for obj in self._matching(res, namespace, label_sel, field_sel)]
        else:
            since = int(rv_param)
            if since < self._compacted_rv:
                gone = True
            else:
                for event in self._events:
                    if event.rv > since and (t := translate(event)) is not None:
                        initial.append(t)
        self._watchers.add(queue)
        response = aiohttp.web.StreamResponse(status=200, headers={"Content-Type": JSON, "Cache-Control": "no-cache, private"})
        first_table = True

        async def send(type_: str, obj: dict) -> None:
            nonlocal first_table
            if table and type_ not in ("BOOKMARK", "ERROR"):
                payload = self._table(res, [self._as_version(res, obj)], query.get("includeObject"),
                                      with_columns=first_table)
                first_table = False
            elif type_ in ("BOOKMARK", "ERROR"):
                payload = obj
            else:
                payload = self._as_version(res, obj)
            if entry is not None and type_ not in ("BOOKMARK", "ERROR"):
                entry.objects.append(_object_ref(obj))
            await response.write(json.dumps({"type": type_, "object": payload}).encode() + b"\n")

        try:
            await response.prepare(raw)
            if entry is not None:
                entry.status = 200  # streaming from now on
            if gone:
                await send("ERROR", {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                     "message": f"too old resource version: {rv_param} ({self._compacted_rv})",
                                     "reason": "Expired", "code": 410})
                await response.write_eof()
                return response
            for type_, obj in initial:
                await send(type_, obj)
            if send_initial:
                await send("BOOKMARK", {"kind": res.kind, "apiVersion": res.api_version, "metadata": {
                    "resourceVersion": str(self._rv), "annotations": {"k8s.io/initial-events-end": "true"}}})
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout if timeout is not None else None
            while True:
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    break
                try:
                    event = await asyncio.wait_for(queue.get(), remaining)
                except TimeoutError:
                    break
                if event is _CLOSE:
                    break
                if (t := translate(event)) is not None:
                    await send(*t)
            await response.write_eof()
        except ConnectionError:
            pass
        finally:
            self._watchers.discard(queue)
        return response

    def close_watches(self) -> None:
        """End every open watch stream (clients see a normal end of stream and usually re-watch)."""
        for queue in list(self._watchers):
            queue.put_nowait(_CLOSE)

    # ---- helpers for tests (call on the loop: EmulatorThread.call does it) ---------------------

    def apply_object(self, obj: dict, *, namespace: str | None = None, field_manager: str = "pytest") -> dict:
        """Create or server-side-apply one object, as ``kubectl apply --server-side`` would."""
        api_version = obj.get("apiVersion") or ""
        group, _, version = api_version.rpartition("/")
        res = next((r for r in self._api.values() if r.group == group and r.version == version and r.kind == obj.get("kind")), None)
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

    def patch_object(self, res: ApiResource, name: str, patch: Any, namespace: str | None = None, *,
                     subresource: str | None = None, patch_type: str = "merge") -> dict:
        return self._patch(res, namespace, name, patch_type, patch, subresource=subresource)[0]

    def delete_object(self, res: ApiResource, name: str, namespace: str | None = None, *,
                      propagation: str | None = None) -> dict:
        return self._delete(res, namespace, name, {"propagationPolicy": propagation} if propagation else {})[0]


# ---------------------------------------------------------------------------------------------
# Running it in a background thread (for sync tests, kopf's KopfRunner, kubectl subprocesses)
# ---------------------------------------------------------------------------------------------

class EmulatorThread:
    """Serve a :class:`KubernetesApiEmulator` on a free loopback port from a background thread."""

    def __init__(self, emulator: KubernetesApiEmulator | None = None, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self._kwargs = {"emulator": emulator, "host": host, "port": port}
        self.emulator: KubernetesApiEmulator | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.url = ""
        self.port = 0
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    def start(self) -> EmulatorThread:
        self._thread = threading.Thread(target=self._run, name="k8s-emulator", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the Kubernetes API emulator did not start in 30 s")
        if self._error is not None:
            raise RuntimeError("the Kubernetes API emulator failed to start") from self._error
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported to start() or visible at stop()
            self._error = exc
            self._ready.set()
        finally:
            loop.close()

    async def _serve(self) -> None:
        emulator = self._kwargs["emulator"] or KubernetesApiEmulator()
        self.emulator = emulator
        self._stop = asyncio.Event()
        server = kmock.Server(emulator, host=self._kwargs["host"], port=self._kwargs["port"] or None)
        async with emulator, server:
            self.port = server.port
            self.url = f"http://{self._kwargs['host']}:{server.port}"
            self._ready.set()
            await self._stop.wait()
            emulator.close_watches()
            await asyncio.sleep(0)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on the emulator's loop (state is only touched there) and return its result."""
        assert self.loop is not None
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:
                future.set_exception(exc)

        self.loop.call_soon_threadsafe(run)
        return future.result(timeout=30)

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None and self._thread is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(30)

    def __enter__(self) -> EmulatorThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def write_kubeconfig(path: Any, server_url: str, *, namespace: str = "default", token: str = "emulator-token") -> Any:
    """Write a kubeconfig for the emulator (a token user: kopf and clients need some credentials; the default
    token is the tests' administrator, one from ``KubernetesApiEmulator.service_account`` is authorized by RBAC)."""
    config = {
        "apiVersion": "v1", "kind": "Config", "preferences": {},
        "clusters": [{"name": "emulator", "cluster": {"server": server_url}}],
        "users": [{"name": "emulator", "user": {"token": token}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace}}],
        "current-context": "emulator",
    }
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(config, f)
    return path


def _main(argv: Iterable[str] | None = None) -> None:
    """``python -m tests.support.k8s_emulator [--port N] [--kubeconfig PATH]``: serve until Ctrl+C."""
    import argparse
    import time

    parser = argparse.ArgumentParser(description="Serve the test Kubernetes API emulator.")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--kubeconfig", default="emulator.kubeconfig")
    args = parser.parse_args(list(argv) if argv is not None else None)
    with EmulatorThread(port=args.port) as server:
        write_kubeconfig(args.kubeconfig, server.url)
        print(f"serving {server.url}; export KUBECONFIG={args.kubeconfig}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    _main()
