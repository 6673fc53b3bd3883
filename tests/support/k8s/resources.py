"""Served resources: what one group/version/plural is (:class:`ApiResource`), the built-in ones from kmock's
bundled discovery dump of a real cluster, and Kubernetes' version ordering; used by the registry and discovery."""

from __future__ import annotations

import functools
import gzip
import importlib.resources
import json
import re
from dataclasses import dataclass, field

# Subresources whose discovery entry names another kind (group/version) than the resource's own, as
# kube-apiserver lists them (kubectl drain looks for pods/eviction of kind Eviction in policy/v1).
SUBRESOURCE_KINDS = {("", "pods", "eviction"): ("policy", "v1", "Eviction", ["create"])}


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


CRD_VERBS = ["delete", "deletecollection", "get", "list", "patch", "create", "update", "watch"]


@functools.lru_cache(maxsize=1)
def bundled_discovery() -> list[dict]:
    """kmock's bundled discovery dump of a real cluster's built-in resources."""
    data = importlib.resources.files("kmock._internal").joinpath("resources.json.gz").read_bytes()
    return json.loads(gzip.decompress(data))


def builtin_resources() -> list[ApiResource]:
    result = []
    for doc in bundled_discovery():
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
            result.append(
                ApiResource(
                    group=group,
                    version=version,
                    plural=entry["name"],
                    kind=entry["kind"],
                    singular=entry.get("singularName") or entry["kind"].lower(),
                    namespaced=bool(entry.get("namespaced")),
                    verbs=list(entry.get("verbs") or []),
                    shortnames=list(entry.get("shortNames") or []),
                    categories=list(entry.get("categories") or []),
                    subresources=subs.get(entry["name"], set()),
                )
            )
    return result


VERSION_RE = re.compile(r"^v(\d+)(?:(alpha|beta)(\d+))?$")


def version_priority(version: str) -> tuple:
    """Kubernetes' version ordering: GA > beta > alpha, higher numbers first, then others."""
    m = VERSION_RE.match(version)
    if not m:
        return (3, 0, 0, version)
    major, stage, minor = int(m.group(1)), m.group(2), int(m.group(3) or 0)
    rank = {None: 0, "beta": 1, "alpha": 2}[stage]
    return (rank, -major, -minor, version)
