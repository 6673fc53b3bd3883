"""What an admin allows CR authors to do that reaches beyond their namespace (pure): hostPath models, which
Prometheus the operator reads for them, and the host paths an AcceleratorClass may mount.

`model.source.hostPath` schedules a worker pod that mounts a directory of the node, which any CR
author could point at the node's filesystem. It is allowed only under a path prefix the admin lists,
or in a namespace the admin lists (`pdfleet operator --allow-host-path / --allow-host-path-namespace`,
the chart's `operator.hostPath`); the chart also installs the same rule as a ValidatingAdmissionPolicy,
so the API server refuses such an object at admission and the operator refuses it again (a cluster
without the policy, an object admitted before it).
"""

from __future__ import annotations

import posixpath
import re
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

from pdfleet_operator.api import AcceleratorClassSpec, InferenceDeploymentSpec

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


def host_path_problem(
    spec: InferenceDeploymentSpec, namespace: str, prefixes: Sequence[str], namespaces: Sequence[str]
) -> str | None:
    """Why this deployment's hostPath model is not allowed here (None: no hostPath, or allowed)."""
    src = spec.model.source.host_path
    if src is None:
        return None
    path = src.path
    if (
        not path.startswith("/")
        or ".." in path.split("/")
        or posixpath.normpath(path) != (path.rstrip("/") or "/")
        or "//" in path
    ):
        return f"{FIELD}: {path!r} must be an absolute, normalized path"
    if namespace in namespaces or any(under(path, p) for p in prefixes):
        return None
    allowed = ", ".join(prefixes) or "none"
    return (
        f"{FIELD}: {path!r} is not under a host path the cluster admin allows (prefixes: {allowed}; "
        f"namespaces: {', '.join(namespaces) or 'none'}); use a PVC (model.source.pvc) or ask the admin"
    )


PROMETHEUS_FIELD = "spec.autoscaling.prometheusUrl"
DEFAULT_PORTS = {"http": 80, "https": 443}
# Characters a URL the operator fetches may hold: no whitespace, backslashes (some clients read them as '/') or
# controls, which parsers disagree on.
_URL_CHARS = re.compile(r"^[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]+$")


@dataclass(frozen=True)
class ParsedUrl:
    """A Prometheus URL as the operator compares it: scheme, lower-case host, port (None: unnamed) and path
    segments (percent-decoded; no empty, '.' or '..' segment)."""

    scheme: str
    host: str
    port: int | None
    segments: tuple[str, ...]

    @property
    def effective_port(self) -> int:
        return self.port if self.port is not None else DEFAULT_PORTS[self.scheme]


def parse_url(url: str) -> ParsedUrl:
    """ValueError naming what is wrong: not http(s), user info (`user@host`: the host is what follows the @), no
    host, a query or fragment, characters parsers disagree on, or a path that climbs ('..', '.', '//', an encoded
    '/')."""
    if not _URL_CHARS.match(url):
        raise ValueError("it holds characters a URL parser may read differently (whitespace, backslash, controls)")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"it is not a URL ({exc})") from None
    if parts.scheme not in DEFAULT_PORTS:
        raise ValueError(f"scheme {parts.scheme or '(none)'!r}: only http and https")
    if "@" in parts.netloc or parts.username is not None or parts.password is not None:
        raise ValueError("it carries user info (user@host): the host would be what follows the @")
    if not parts.hostname:
        raise ValueError("it names no host")
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ValueError("a Prometheus URL takes no query or fragment")
    raw = parts.path.strip("/")
    segments = tuple(urllib.parse.unquote(seg) for seg in raw.split("/")) if raw else ()
    if any(seg in ("", ".", "..") or "/" in seg or "\\" in seg for seg in segments):
        raise ValueError(f"path {parts.path!r} has an empty, '.', '..' or encoded-'/' segment")
    return ParsedUrl(parts.scheme, parts.hostname.lower().rstrip("."), port, segments)


def url_allowed(url: ParsedUrl, allowed: ParsedUrl) -> bool:
    """Whether `url` is under `allowed`: same scheme and host; the same port, or any port when `allowed` names
    none (a bare host covers its ports); `allowed`'s path segments first."""
    if (url.scheme, url.host) != (allowed.scheme, allowed.host):
        return False
    if allowed.port is not None and url.effective_port != allowed.effective_port:
        return False
    return url.segments[: len(allowed.segments)] == allowed.segments


def prometheus_url_problem(url: str, default_url: str | None, allowed: Sequence[str]) -> str | None:
    """Why the operator will not read `url` for a deployment (None: it may).

    A CR's own prometheusUrl would make the operator fetch any URL a CR author names (and copy its errors into the
    status): only the operator's own --prometheus-url and the admin's allowed prefixes (--allow-prometheus-url) are
    read, compared as parsed URLs (scheme, host, port, path segments), never as strings:
    `http://prometheus.monitoring:9090@evil.example/api` starts with an allowed string and is a request to
    evil.example, so user info is refused outright.
    """
    try:
        parsed = parse_url(url)
    except ValueError as exc:
        return f"{PROMETHEUS_FIELD}: {url!r}: {exc}; not fetched"
    if default_url is not None:
        try:
            own = parse_url(default_url)
        except ValueError:
            own = None
        if own is not None and (own.scheme, own.host, own.effective_port, own.segments) == (
            parsed.scheme,
            parsed.host,
            parsed.effective_port,
            parsed.segments,
        ):
            return None
    for prefix in allowed:
        try:
            if url_allowed(parsed, parse_url(prefix)):
                return None
        except ValueError:
            continue  # the operator refuses bad prefixes at start (normalize_url_prefix); none reaches here
    return (
        f"{PROMETHEUS_FIELD}: {url} is not a Prometheus the operator may read (its --prometheus-url, or "
        f"--allow-prometheus-url prefixes: {', '.join(allowed) or 'none'}); not fetched"
    )


def check_url_prefix(prefix: str) -> str:
    """An --allow-prometheus-url prefix, checked as parse_url checks a CR's URL; ValueError naming what is wrong."""
    parse_url(prefix)
    return prefix


# --- AcceleratorClass host paths ---------------------------------------------------------------------------

# Node paths no class may mount: the node's identity, credentials and control (a container runtime socket is a
# root shell on the node), and trees that contain them. A path above one of them would expose it too.
SENSITIVE_HOST_PATHS = (
    "/proc",
    "/sys",
    "/dev",
    "/boot",
    "/root",
    "/home",
    "/run",
    "/var/run",
    "/var/lib/kubelet",
    "/var/lib/docker",
    "/var/lib/containerd",
    "/var/lib/etcd",
    "/var/log",
    "/etc/kubernetes",
    "/etc/shadow",
    "/etc/gshadow",
    "/etc/sudoers",
    "/etc/ssh",
    "/etc/pki",
    "/etc/ssl/private",
)
# Container paths a class mount may not cover: the image's own system and pdfleet's volumes.
RESERVED_MOUNTS = (
    "/proc",
    "/sys",
    "/dev",
    "/etc/pdfleet",
    "/var/run/pdfleet",
    "/models",
    "/tmp",
    "/var/cache/pdfleet",
    "/home/pdfleet",
)
SYSTEM_MOUNTS = (
    "/",
    "/bin",
    "/sbin",
    "/lib",
    "/lib64",
    "/usr",
    "/usr/bin",
    "/usr/lib",
    "/usr/local",
    "/etc",
    "/var",
    "/opt",
    "/usr/local/bin",
    "/usr/local/lib",
)


@dataclass(frozen=True)
class Problem:
    """What is wrong with one field."""

    field: str
    message: str


def _normalized(path: str) -> bool:
    return (
        path.startswith("/")
        and "//" not in path
        and ".." not in path.split("/")
        and posixpath.normpath(path) == (path.rstrip("/") or "/")
    )


def _overlaps(path: str, roots: Sequence[str]) -> str | None:
    """The root `path` is, is inside, or contains."""
    for root in roots:
        if under(path, root) or under(root, path):
            return root
    return None


def class_volume_problems(cls: AcceleratorClassSpec) -> list[Problem]:
    """Why a class's host-path volumes may not be mounted: a path that is not absolute and normalized, that is, holds
    or lies in a sensitive path of the node, or a mount over the container's system or pdfleet's own volumes.
    Mounts are always read-only (kube.render). Classes are written by cluster admins only (RBAC); these rules hold
    for them too, like the hostPath rules hold for CR authors."""
    out = []
    for i, v in enumerate(cls.volumes):
        field, path = f"spec.volumes[{i}].hostPath.path", v.host_path.path
        if not _normalized(path):
            out.append(Problem(field, f"{path!r} must be an absolute, normalized path"))
        elif path == "/" or (hit := _overlaps(path, SENSITIVE_HOST_PATHS)) is not None:
            out.append(
                Problem(
                    field,
                    f"{path!r} exposes the node's {'root' if path == '/' else hit} (credentials, "
                    f"devices or the container runtime): mount the vendor's files one by one",
                )
            )
    names = {v.name for v in cls.volumes}
    for i, m in enumerate(cls.volume_mounts):
        field, path = f"spec.volumeMounts[{i}].mountPath", m.mount_path
        if m.name not in names:
            out.append(Problem(f"spec.volumeMounts[{i}].name", f"{m.name!r} names no spec.volumes entry"))
        if not _normalized(path):
            out.append(Problem(field, f"{path!r} must be an absolute, normalized path"))
        elif path in SYSTEM_MOUNTS or (hit := _overlaps(path, RESERVED_MOUNTS)) is not None:
            out.append(Problem(field, f"{path!r} would cover the container's {path if path in SYSTEM_MOUNTS else hit}"))
    return out
