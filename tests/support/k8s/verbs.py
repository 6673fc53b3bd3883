"""The verbs: create, update (PUT and status), patch (merge, JSON, strategic, server-side apply), delete, and
the reads (get, list with selectors); synchronous and atomic on the emulator's loop. Mixed into the emulator."""

from __future__ import annotations

import copy
import json
import secrets
import string
import uuid
from collections.abc import Callable
from typing import Any

from pdfleet_operator.api import admission as crd_admission
from tests.support.k8s.errors import ApiError, bad_request, conflict, invalid, not_found, unprocessable
from tests.support.k8s.patches import (
    deep_merge,
    delete_path,
    json_merge_patch,
    json_patch,
    leaf_paths,
    strategic_merge_patch,
)
from tests.support.k8s.resources import ApiResource
from tests.support.k8s.selectors import parse_field_selector, parse_label_selector


class VerbsMixin:
    """The API's verbs on the store."""

    def _create(
        self,
        res: ApiResource,
        namespace: str | None,
        body: Any,
        *,
        dry_run: bool = False,
        field_validation: str = "Warn",
        warnings: list[str] | None = None,
    ) -> dict:
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
                raise invalid(
                    res,
                    "",
                    [
                        crd_admission.FieldError(
                            "metadata.name", "FieldValueRequired", "Required value: name or generateName is required"
                        )
                    ],
                )
        key = self._key(res, namespace, meta["name"])
        if key in self._store:
            raise ApiError(
                409,
                "AlreadyExists",
                f'{res.group_resource} "{meta["name"]}" already exists',
                {"name": meta["name"], "group": res.group, "kind": res.plural},
            )
        for k in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
            meta.pop(k, None)
        if res.has_status:
            obj.pop("status", None)  # status is written through the /status subresource only
        obj = self._admit(res, obj, None, field_validation, warnings)
        meta = obj["metadata"]
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = self.clock.iso()
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

    def _update(
        self,
        res: ApiResource,
        namespace: str | None,
        name: str,
        body: Any,
        *,
        subresource: str | None = None,
        dry_run: bool = False,
        field_validation: str = "Warn",
        warnings: list[str] | None = None,
        old: dict | None = None,
    ) -> dict:
        warnings = warnings if warnings is not None else []
        key = self._key(res, namespace, name)
        if old is None:
            old = self._store.get(key)
            if old is None:
                raise not_found(res, name)
        new = self._normalize(res, body, namespace if res.namespaced else None, name)
        meta = new["metadata"]
        sent_rv = meta.get("resourceVersion")
        if sent_rv and sent_rv != old["metadata"]["resourceVersion"]:
            raise conflict(res, name)
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
                raise invalid(
                    res,
                    name,
                    [
                        crd_admission.FieldError(
                            "metadata.finalizers",
                            "FieldValueForbidden",
                            "Forbidden: no new finalizers can be added if the object is being deleted, "
                            f"found new finalizers {json.dumps(sorted(added))}",
                        )
                    ],
                )
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
        if meta.get("deletionTimestamp") and not meta.get("finalizers") and not meta.get("deletionGracePeriodSeconds"):
            # As kube-apiserver: emptying the finalizers of a deleting object deletes it (only DELETED is seen).
            self._store[key] = new
            return self._remove(key, new)
        self._put(key, new, "MODIFIED", old)
        if key[:2] == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self._register_crd(new)
        return copy.deepcopy(new)

    def _patch(
        self,
        res: ApiResource,
        namespace: str | None,
        name: str,
        patch_type: str,
        patch: Any,
        *,
        subresource: str | None = None,
        dry_run: bool = False,
        field_validation: str = "Warn",
        field_manager: str | None = None,
        warnings: list[str] | None = None,
    ) -> tuple[dict, bool]:
        """Returns (object, created)."""
        warnings = warnings if warnings is not None else []
        key = self._key(res, namespace, name)
        old = self._store.get(key)
        if patch_type == "apply":
            if not field_manager:
                raise bad_request("PATCH request with apply content type requires fieldManager")
            if not isinstance(patch, dict):
                raise bad_request("the apply configuration must be an object")
            if old is None:
                if subresource:
                    raise not_found(res, name)
                body = copy.deepcopy(patch)
                body.setdefault("metadata", {})["name"] = body.get("metadata", {}).get("name") or name
                if res.namespaced:
                    body["metadata"].setdefault("namespace", namespace)
                if body["metadata"]["name"] != name:
                    raise bad_request(
                        f"the name of the object ({body['metadata']['name']}) "
                        f"does not match the name on the URL ({name})"
                    )
                created = self._create(
                    res, namespace, body, dry_run=dry_run, field_validation=field_validation, warnings=warnings
                )
                if res.has_status and patch.get("status") is not None and not dry_run:
                    pass  # status in an apply on the main resource is ignored, as on a real server
                if not dry_run:
                    self._applied.setdefault(key, {})[field_manager] = copy.deepcopy(patch)
                return created, True
            merged = deep_merge(old, {k: v for k, v in patch.items()})
            previous = self._applied.get(key, {}).get(field_manager)
            if previous is not None:
                for path in leaf_paths(previous) - leaf_paths(patch):
                    if (
                        path
                        and path[0] not in ("apiVersion", "kind")
                        and path[:2] != ("metadata", "name")
                        and path[:2] != ("metadata", "namespace")
                    ):
                        still = any(p[: len(path)] == path for p in leaf_paths(patch))
                        if not still:
                            delete_path(merged, path)
            new = merged
            if "resourceVersion" not in (patch.get("metadata") or {}):
                new["metadata"].pop("resourceVersion", None)
            result = self._update(
                res,
                namespace,
                name,
                new,
                subresource=subresource,
                dry_run=dry_run,
                field_validation=field_validation,
                warnings=warnings,
                old=old,
            )
            if not dry_run:
                self._applied.setdefault(key, {})[field_manager] = copy.deepcopy(patch)
            return result, False
        if old is None:
            raise not_found(res, name)
        current = copy.deepcopy(old)
        try:
            if patch_type == "json":
                new = json_patch(current, patch)
            elif patch_type == "merge":
                new = json_merge_patch(current, patch)
            elif patch_type == "strategic":
                if res.crd is not None:
                    raise ApiError(
                        415,
                        "UnsupportedMediaType",
                        "the body of the request was in an unknown format - accepted media types include: "
                        "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml",
                    )
                new = strategic_merge_patch(current, patch)
            else:
                raise ApiError(
                    415, "UnsupportedMediaType", f"the body of the request was in an unknown format - {patch_type}"
                )
        except TypeError as exc:
            raise bad_request(str(exc)) from None
        except ValueError as exc:
            raise unprocessable(str(exc)) from None
        if not isinstance(new, dict):
            raise unprocessable("the patched object is not an object")
        # A resourceVersion that the patch itself sets acts as a precondition; otherwise the current one.
        patched_rv = (new.get("metadata") or {}).get("resourceVersion")
        if patched_rv != old["metadata"]["resourceVersion"]:
            if patched_rv:
                raise conflict(res, name)
        return self._update(
            res,
            namespace,
            name,
            new,
            subresource=subresource,
            dry_run=dry_run,
            field_validation=field_validation,
            warnings=warnings,
            old=old,
        ), False

    def _delete(
        self, res: ApiResource, namespace: str | None, name: str, options: dict, *, dry_run: bool = False
    ) -> tuple[dict, bool]:
        """Returns (object, gone_now)."""
        key = self._key(res, namespace, name)
        obj = self._store.get(key)
        if obj is None:
            raise not_found(res, name)
        pre = options.get("preconditions") or {}
        if pre.get("uid") and pre["uid"] != obj["metadata"]["uid"]:
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {res.group_resource} "{name}": '
                f"Precondition failed: UID in precondition: {pre['uid']}, UID in object meta: {obj['metadata']['uid']}",
            )
        if pre.get("resourceVersion") and pre["resourceVersion"] != obj["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {res.group_resource} "{name}": '
                f"Precondition failed: ResourceVersion in precondition: {pre['resourceVersion']}, "
                f"ResourceVersion in object meta: {obj['metadata']['resourceVersion']}",
            )
        if dry_run:
            return copy.deepcopy(obj), not obj["metadata"].get("finalizers")
        propagation = options.get("propagationPolicy")
        if propagation is None and options.get("orphanDependents") is True:
            propagation = "Orphan"
        result = self._delete_key(key, propagation=propagation, grace=options.get("gracePeriodSeconds"))
        return copy.deepcopy(result), key not in self._store

    # ---- reading -----------------------------------------------------------------------------

    def _matching(
        self,
        res: ApiResource,
        namespace: str | None,
        label_sel: Callable[[dict], bool] | None,
        field_sel: Callable[[dict], bool] | None,
    ) -> list[dict]:
        items = []
        for key in self._store.keys_of(res.group, res.plural):
            if res.namespaced and namespace and key[2] != namespace:
                continue
            obj = self._store[key]
            if self._selected(obj, label_sel, field_sel):
                items.append(self._as_version(res, obj))
        return items

    @staticmethod
    def _selected(
        obj: dict, label_sel: Callable[[dict], bool] | None, field_sel: Callable[[dict], bool] | None
    ) -> bool:
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
            raise not_found(res, name)
        return self._as_version(res, obj)

    def count_objects(
        self, res: ApiResource, namespace: str | None, predicate: Callable[[dict], bool]
    ) -> tuple[int, int]:
        """(objects of `res` in `namespace` for which `predicate` holds, all of them), reading the stored objects in
        place (no copies: the predicate must not change them). For pollers that only count (a benchmark waiting for
        500 objects must not spend the CPU it measures on copying them twice a second)."""
        keys = [
            k
            for k in self._store.keys_of(res.group, res.plural)
            if not (res.namespaced and namespace and k[2] != namespace)
        ]
        return sum(1 for k in keys if predicate(self._store[k])), len(keys)

    def list_objects(
        self,
        res: ApiResource,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict]:
        return self._matching(
            res,
            namespace,
            parse_label_selector(label_selector) if label_selector else None,
            parse_field_selector(field_selector) if field_selector else None,
        )
