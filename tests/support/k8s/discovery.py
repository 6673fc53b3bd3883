"""Discovery and the other non-resource endpoints: ``/api``, ``/apis``, ``/api/v1``, ``/apis/<g>/<v>``,
``/version``, an empty ``/openapi/v2`` (kubectl then skips client-side validation), health. Mixed into the
emulator."""

from __future__ import annotations

import re

import aiohttp.web

from tests.support.k8s.errors import ApiError
from tests.support.k8s.resources import SUBRESOURCE_KINDS


class DiscoveryMixin:
    """What the emulator serves, as clients discover it."""

    def _serve_non_resource(self, path: str, method: str) -> aiohttp.web.StreamResponse | None:
        if method != "GET":
            return None
        if path in ("/healthz", "/readyz", "/livez"):
            return aiohttp.web.Response(text="ok", content_type="text/plain")
        if path == "/version":
            return self._json(
                {
                    "major": "1",
                    "minor": "33",
                    "gitVersion": "v1.33.0-pdfleet-emulator",
                    "gitCommit": "0000000000000000000000000000000000000000",
                    "gitTreeState": "clean",
                    "buildDate": "2025-01-01T00:00:00Z",
                    "goVersion": "go1.24",
                    "compiler": "gc",
                    "platform": "linux/amd64",
                }
            )
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
            return self._json(
                {
                    "kind": "APIVersions",
                    "versions": ["v1"],
                    "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}],
                }
            )
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
        return {
            "name": group,
            "versions": [{"groupVersion": f"{group}/{v}", "version": v} for v in versions],
            "preferredVersion": {"groupVersion": f"{group}/{versions[0]}", "version": versions[0]},
        }

    def _discovery_version(self, group: str, version: str) -> dict:
        resources = [r for r in self._api.values() if r.group == group and r.version == version]
        if not resources:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        entries = []
        for res in sorted(resources, key=lambda r: r.plural):
            entry = {
                "name": res.plural,
                "singularName": res.singular,
                "namespaced": res.namespaced,
                "kind": res.kind,
                "verbs": list(res.verbs),
            }
            if res.shortnames:
                entry["shortNames"] = list(res.shortnames)
            if res.categories:
                entry["categories"] = list(res.categories)
            entries.append(entry)
            for sub in sorted(res.subresources):
                verbs = ["get", "patch", "update"] if sub in ("status", "scale") else ["get"]
                sub_entry = {
                    "name": f"{res.plural}/{sub}",
                    "singularName": "",
                    "namespaced": res.namespaced,
                    "kind": res.kind,
                    "verbs": verbs,
                }
                other = SUBRESOURCE_KINDS.get((res.group, res.plural, sub))
                if other is not None:  # e.g. pods/eviction: kind Eviction of policy/v1, which kubectl drain looks for
                    sub_entry.update(group=other[0], version=other[1], kind=other[2], verbs=list(other[3]))
                entries.append(sub_entry)
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": entries,
        }
