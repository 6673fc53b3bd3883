"""What an admin allows CR authors to do that reaches beyond their namespace (pure): hostPath models, and
which Prometheus the operator reads for them.

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


PROMETHEUS_FIELD = "spec.autoscaling.prometheusUrl"


def prometheus_url_problem(url: str, default_url: str | None, allowed: Sequence[str]) -> str | None:
    """Why the operator will not read `url` for a deployment (None: it may).

    A CR's own prometheusUrl would make the operator fetch any URL a CR author names (and copy its
    errors into the status): only the operator's own --prometheus-url and the admin's allowed prefixes
    (--allow-prometheus-url, matched on whole path segments) are read.
    """
    if default_url is not None and url.rstrip("/") == default_url.rstrip("/"):
        return None
    for prefix in allowed:
        p = prefix.rstrip("/")
        rest = url[len(p):] if url.startswith(p) else None
        # Whole segments: "http://prom:9090" covers ".../api", not "http://prom:90901"; a prefix naming only a
        # host ("http://127.0.0.1") covers its ports too.
        host_only = "/" not in p.split("://", 1)[-1]
        if rest is not None and (rest in ("", "/") or rest[0] == "/" or (rest[0] == ":" and host_only and ":" not in
                                                                           p.split("://", 1)[-1])):
            return None
    return (f"{PROMETHEUS_FIELD}: {url} is not a Prometheus the operator may read (its --prometheus-url, or "
            f"--allow-prometheus-url prefixes: {', '.join(allowed) or 'none'}); not fetched")
