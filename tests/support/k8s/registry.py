"""The resource registry: built-in resources and the custom resources applied CRDs serve (names kubectl
resolves, versions, CRD status). Mixed into the emulator."""

from __future__ import annotations

import copy

from tests.support.k8s.errors import ApiError
from tests.support.k8s.resources import CRD_VERBS, VERSION_RE, ApiResource, version_priority


class RegistryMixin:
    """Which resources the emulator serves."""

    def resource_for(self, group: str, version: str, plural: str) -> ApiResource:
        res = self._api.get((group, version, plural))
        if res is None:
            raise ApiError(
                404, "NotFound", "the server could not find the requested resource", {"group": group, "kind": plural}
            )
        return res

    def find_resource(self, name: str) -> ApiResource:
        """Resolve what kubectl would: ``infdep``, ``inferencedeployments.pdfleet.io``, ``Deployment``,
        ``deploy.apps``."""
        wanted = name.strip()
        group: str | None = None
        if "." in wanted:
            wanted, group = wanted.split(".", 1)
            if VERSION_RE.match(group.split(".")[0]):  # plural.version.group
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
        candidates.sort(key=lambda r: (r.crd is not None, r.group != "", r.group, version_priority(r.version)))
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
            versions.sort(key=version_priority)
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
                group=spec["group"],
                version=entry["name"],
                plural=names["plural"],
                kind=names["kind"],
                singular=names.get("singular") or names["kind"].lower(),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                verbs=list(CRD_VERBS),
                shortnames=list(names.get("shortNames") or []),
                categories=list(names.get("categories") or []),
                subresources=subs,
                crd=crd,
            )
            self._api[(res.group, res.version, res.plural)] = res

    def _unregister_crd(self, crd: dict, *, keep_objects: bool) -> None:
        spec = crd["spec"]
        group, plural = spec["group"], spec["names"]["plural"]
        for key in [k for k, r in self._api.items() if r.group == group and r.plural == plural and r.crd is not None]:
            del self._api[key]
        if not keep_objects:
            for key in self._store.keys_of(group, plural):
                obj = self._store[key]
                self._remove(key, obj)

    def _crd_status(self, crd: dict) -> dict:
        names = copy.deepcopy(crd["spec"]["names"])
        names.setdefault("singular", names["kind"].lower())
        names.setdefault("listKind", names["kind"] + "List")
        now = self.clock.iso()
        return {
            "acceptedNames": names,
            "conditions": [
                {
                    "type": "NamesAccepted",
                    "status": "True",
                    "reason": "NoConflicts",
                    "message": "no conflicts found",
                    "lastTransitionTime": now,
                },
                {
                    "type": "Established",
                    "status": "True",
                    "reason": "InitialNamesAccepted",
                    "message": "the initial names have been accepted",
                    "lastTransitionTime": now,
                },
            ],
            "storedVersions": [v["name"] for v in crd["spec"].get("versions") or [] if v.get("storage")],
        }
