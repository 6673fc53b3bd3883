"""What an admin allows CR authors to do that reaches beyond their namespace (pure): today, hostPath models.

`model.source.hostPath` schedules a worker pod that mounts a directory of the node, which any CR
author could point at the node's filesystem. It is allowed only under a path prefix the admin lists,
or in a namespace the admin lists (`pdfleet operator --allow-host-path / --allow-host-path-namespace`,
the chart's `operator.hostPath`); the chart also installs the same rule as a ValidatingAdmissionPolicy,
so the API server refuses such an object at admission and the operator refuses it again (a cluster
without the policy, an object admitted before it).
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence

from pdfleet_operator.api import InferenceDeploymentSpec

FIELD = "spec.model.source.hostPath.path"


def normalize_prefix(prefix: str) -> str:
    """'/models/' -> '/models'; ValueError for a relative prefix (a prefix is a directory of the node)."""
    if not prefix.startswith("/"):
        raise ValueError(f"host path prefix {prefix!r} must be absolute")
    return posixpath.normpath(prefix) if prefix != "/" else "/"


def under(path: str, prefix: str) -> bool:
    """Whether `path` is `prefix` or inside it, by path segments ('/models' does not cover '/modelsx')."""
    prefix = normalize_prefix(prefix)
    return prefix == "/" or path == prefix or path.startswith(prefix + "/")


def host_path_problem(spec: InferenceDeploymentSpec, namespace: str, prefixes: Sequence[str],
                      namespaces: Sequence[str]) -> str | None:
    """Why this deployment's hostPath model is not allowed here (None: no hostPath, or allowed)."""
    src = spec.model.source.host_path
    if src is None:
        return None
    path = src.path
    if not path.startswith("/") or ".." in path.split("/") or posixpath.normpath(path) != (path.rstrip("/") or "/") \
            or "//" in path:
        return f"{FIELD}: {path!r} must be an absolute, normalized path"
    if namespace in namespaces or any(under(path, p) for p in prefixes):
        return None
    allowed = ", ".join(prefixes) or "none"
    return (f"{FIELD}: {path!r} is not under a host path the cluster admin allows (prefixes: {allowed}; "
            f"namespaces: {', '.join(namespaces) or 'none'}); use a PVC (model.source.pvc) or ask the admin")
