"""HTTP: the emulator's entry point (replacing kmock's, whose path parser knows no PUT and crashes on
``/api/v1/namespaces``), the request log entry, body decoding, RBAC and user-defined kmock reactions first,
then dispatch of each verb to the store. Mixed into the emulator."""

from __future__ import annotations

import json
import traceback
from typing import Any

import aiohttp.web
import kmock
import yaml
from kmock._internal import apps as _kmock_apps
from kmock._internal import rendering as _kmock_rendering

from pdfleet_operator.api import admission as crd_admission
from tests.support.k8s.errors import ApiError, Forbidden, bad_request, invalid
from tests.support.k8s.rbac import REQUESTER
from tests.support.k8s.requestlog import WRITE_VERBS, LoggedRequest, object_ref

JSON = "application/json"


class HttpMixin:
    """Serving requests."""

    _ACTIONS = {
        "get": kmock.action.FETCH,
        "list": kmock.action.LIST,
        "watch": kmock.action.WATCH,
        "create": kmock.action.CREATE,
        "update": kmock.action.UPDATE,
        "patch": kmock.action.UPDATE,
        "delete": kmock.action.DELETE,
        "deletecollection": kmock.action.DELETE,
    }

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
            verb = (
                ("watch" if watch else "get" if parsed["name"] else "list")
                if method == "GET"
                else {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method)
                or (("delete" if parsed["name"] else "deletecollection") if method == "DELETE" else None)
            )
            fields = dict(
                action=self._ACTIONS.get(verb or ""),
                resource=kmock.resource(parsed["group"], parsed["version"], parsed["plural"]),
                namespace=parsed["namespace"],
                name=parsed["name"],
                subresource=parsed["subresource"],
            )
        request = kmock.Request(
            id=len(self._requests),
            raw_request=raw_request,
            url=raw_request.url,
            method=raw_request.method,
            params=dict(raw_request.query),
            headers=dict(raw_request.headers),
            cookies=dict(raw_request.cookies),
            body=body,
            text=body.decode("utf-8", "replace"),
            data=data,
            **fields,
        )
        self._requests.append(request)
        try:
            return await self._handle(request)
        except _kmock_rendering.StreamingError as exc:  # a user-defined streaming reaction failed mid-way
            response = exc.args[0]
            await self._stream_error(exc.__cause__ or exc, response)
            await response.write_eof()
            return response
        except Exception as exc:
            return self._json(
                ApiError(
                    500, "InternalError", f"emulator error: {exc!r}", {"causes": [{"message": traceback.format_exc()}]}
                ).status(),
                status=500,
            )

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        assert raw is not None
        entry = self._log_entry(request)
        self.log.append(entry)
        who = self._requester(raw)
        REQUESTER.set(who)  # (always: aiohttp serves a keep-alive connection's requests in one task)
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
            response = self._json(
                ApiError(
                    500, "InternalError", f"emulator error: {exc!r}", {"causes": [{"message": traceback.format_exc()}]}
                ).status(),
                status=500,
            )
        entry.status = response.status
        return response

    @staticmethod
    def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> aiohttp.web.Response:
        return aiohttp.web.Response(
            body=json.dumps(body).encode(), status=status, content_type=JSON, headers=headers or {}
        )

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
        return {
            "group": group,
            "version": version,
            "namespace": namespace,
            "legacy_watch": legacy_watch,
            "plural": rest[0] if rest else None,
            "name": rest[1] if len(rest) > 1 else None,
            "subresource": rest[2] if len(rest) > 2 else None,
        }

    def _log_entry(self, request: kmock.Request) -> LoggedRequest:
        raw = request._raw_request
        assert raw is not None
        query = dict(raw.query)
        parsed = self._split_path(raw.path)
        method = raw.method.upper()
        entry = LoggedRequest(
            method=method,
            path=raw.path,
            verb=None,
            query=query,
            content_type=(raw.headers.get("Content-Type") or "").split(";")[0].strip() or None,
            user_agent=raw.headers.get("User-Agent"),
        )
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
            raise ApiError(
                415,
                "UnsupportedMediaType",
                "the emulator does not speak protobuf (send JSON: e.g. use `kubectl apply` rather than "
                "`kubectl create <typed resource>`)",
            )
        if not body:
            return None
        try:
            if content_type and "yaml" in content_type:
                # NOTE: JSON first: clients send apply patches as JSON (a YAML document), and PyYAML's pure-Python
                # parser took most of the emulator's CPU at 500 deployments; libyaml's when the body is YAML.
                try:
                    return json.loads(body)
                except ValueError:
                    return yaml.load(body, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
            return json.loads(body)
        except (ValueError, yaml.YAMLError) as exc:
            if quiet:
                return None
            raise bad_request(f"the body of the request could not be decoded: {exc}") from None

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
        query = entry.query
        dry_run = "All" in raw.query.getall("dryRun", [])
        if (res.group, res.plural, sub) == ("", "pods", "eviction") and entry.verb == "create":
            body = self._decode(request.body, entry.content_type)
            dry_run = dry_run or "All" in (((body or {}).get("deleteOptions") or {}).get("dryRun") or [])
            return self._json(self.evict_pod(namespace or "default", name, body, dry_run=dry_run), 201)
        if sub is not None and sub != "status":
            raise ApiError(405, "MethodNotAllowed", f"the emulator does not serve the {sub} subresource")
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
            entry.objects = [object_ref(o) for o in items]
            if table:
                return self._json(self._table(res, items, query.get("includeObject")))
            return self._json(
                {
                    "apiVersion": res.api_version,
                    "kind": f"{res.kind}List",
                    "metadata": {"resourceVersion": str(self._rv)},
                    "items": items,
                }
            )
        if entry.verb == "get":
            obj = self.get_object(res, namespace, name)
            if table:
                return self._json(self._table(res, [obj], query.get("includeObject")))
            return self._json(obj)

        body = self._decode(request.body, entry.content_type)
        if entry.verb == "create":
            if name:
                raise ApiError(
                    405, "MethodNotAllowed", "the server does not allow this method on the requested resource"
                )
            obj = self._create(
                res, namespace, body, dry_run=dry_run, field_validation=field_validation, warnings=warnings
            )
            return self._json(self._as_version(res, obj), 201, self._warning_headers(warnings))
        if entry.verb == "update":
            sent_rv = ((body.get("metadata") or {}) if isinstance(body, dict) else {}).get("resourceVersion")
            if res.crd is not None and isinstance(body, dict) and not sent_rv:
                # Custom resources do not allow unconditional updates (AllowUnconditionalUpdate is false).
                raise invalid(
                    res,
                    name or "",
                    [
                        crd_admission.FieldError(
                            "metadata.resourceVersion",
                            "FieldValueInvalid",
                            "Invalid value: 0x0: must be specified for an update",
                        )
                    ],
                )
            obj = self._update(
                res,
                namespace,
                name,
                body,
                subresource=sub,
                dry_run=dry_run,
                field_validation=field_validation,
                warnings=warnings,
            )
            return self._json(self._as_version(res, obj), 200, self._warning_headers(warnings))
        if entry.verb == "patch":
            patch_type = entry.patch_type
            if patch_type not in ("merge", "json", "strategic", "apply"):
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    "the body of the request was in an unknown format - accepted media types include: "
                    "application/json-patch+json, application/merge-patch+json, "
                    "application/apply-patch+yaml, application/strategic-merge-patch+json",
                )
            if body is None:
                raise bad_request("the patch body is empty")
            obj, created = self._patch(
                res,
                namespace,
                name,
                patch_type,
                body,
                subresource=sub,
                dry_run=dry_run,
                field_validation=field_validation if patch_type != "apply" or "fieldValidation" in query else "Strict",
                field_manager=query.get("fieldManager"),
                warnings=warnings,
            )
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
                return self._json(
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Success",
                        "details": {
                            "name": name,
                            "group": res.group,
                            "kind": res.plural,
                            "uid": obj.get("metadata", {}).get("uid"),
                        },
                    }
                )
            return self._json(self._as_version(res, obj))
        if entry.verb == "deletecollection":
            options = body if isinstance(body, dict) else {}
            items = self.list_objects(res, namespace, query.get("labelSelector"), query.get("fieldSelector"))
            deleted = []
            for item in items:
                key = self._key(res, item["metadata"].get("namespace"), item["metadata"]["name"])
                if key in self._store and not dry_run:
                    self._delete_key(
                        key,
                        propagation=options.get("propagationPolicy") or query.get("propagationPolicy"),
                        grace=options.get("gracePeriodSeconds", query.get("gracePeriodSeconds")),
                    )
                deleted.append(item)
            return self._json(
                {
                    "apiVersion": res.api_version,
                    "kind": f"{res.kind}List",
                    "metadata": {"resourceVersion": str(self._rv)},
                    "items": deleted,
                }
            )
        raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")

    @staticmethod
    def _warning_headers(warnings: list[str]) -> dict[str, str]:
        if not warnings:
            return {}
        return {"Warning": ", ".join("299 - " + json.dumps(w) for w in warnings)}
