"""The request log (:class:`LoggedRequest`): each request as the emulator understood it, so tests can count
writes, list the verbs a client used, who sent each request and which objects each list or watch carried."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})


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
        return {
            "application/merge-patch+json": "merge",
            "application/json-patch+json": "json",
            "application/strategic-merge-patch+json": "strategic",
            "application/apply-patch+yaml": "apply",
        }.get(self.content_type, self.content_type)


def object_ref(obj: dict) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or ''}/{meta.get('name')}"
