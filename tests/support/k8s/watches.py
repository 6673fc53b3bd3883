"""Watches: initial ADDED events or the history after a resourceVersion (410 Gone once compacted), selectors
translating changes into ADDED/DELETED as the real API does, Table watches, ``timeoutSeconds``, the bookmark
that ends ``sendInitialEvents``. Mixed into the emulator."""

from __future__ import annotations

import asyncio
import json

import aiohttp.web

from tests.support.k8s.errors import bad_request
from tests.support.k8s.requestlog import LoggedRequest, object_ref
from tests.support.k8s.resources import ApiResource
from tests.support.k8s.selectors import parse_field_selector, parse_label_selector
from tests.support.k8s.store import Event

JSON = "application/json"
CLOSE = object()  # put on a watch's queue: end the stream


class WatchesMixin:
    """Watch streams."""

    async def _serve_watch(
        self,
        raw: aiohttp.web.BaseRequest,
        res: ApiResource,
        namespace: str | None,
        query: dict[str, str],
        table: bool,
        entry: LoggedRequest | None = None,
    ) -> aiohttp.web.StreamResponse:
        label_sel = parse_label_selector(query["labelSelector"]) if query.get("labelSelector") else None
        field_sel = parse_field_selector(query["fieldSelector"]) if query.get("fieldSelector") else None
        rv_param = query.get("resourceVersion") or ""
        send_initial = query.get("sendInitialEvents") == "true"
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        if rv_param and rv_param != "0" and not rv_param.isdigit():
            raise bad_request(f"invalid resource version: {rv_param!r}")

        def selected(obj: dict | None) -> bool:
            if obj is None:
                return False
            if res.namespaced and namespace and obj["metadata"].get("namespace") != namespace:
                return False
            return self._selected(obj, label_sel, field_sel)

        def translate(event: Event) -> tuple[str, dict] | None:
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
        response = aiohttp.web.StreamResponse(
            status=200, headers={"Content-Type": JSON, "Cache-Control": "no-cache, private"}
        )
        first_table = True

        async def send(type_: str, obj: dict) -> None:
            nonlocal first_table
            if table and type_ not in ("BOOKMARK", "ERROR"):
                payload = self._table(
                    res, [self._as_version(res, obj)], query.get("includeObject"), with_columns=first_table
                )
                first_table = False
            elif type_ in ("BOOKMARK", "ERROR"):
                payload = obj
            else:
                payload = self._as_version(res, obj)
            if entry is not None and type_ not in ("BOOKMARK", "ERROR"):
                entry.objects.append(object_ref(obj))
            await response.write(json.dumps({"type": type_, "object": payload}).encode() + b"\n")

        try:
            await response.prepare(raw)
            if entry is not None:
                entry.status = 200  # streaming from now on
            if gone:
                await send(
                    "ERROR",
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Failure",
                        "message": f"too old resource version: {rv_param} ({self._compacted_rv})",
                        "reason": "Expired",
                        "code": 410,
                    },
                )
                await response.write_eof()
                return response
            for type_, obj in initial:
                await send(type_, obj)
            if send_initial:
                await send(
                    "BOOKMARK",
                    {
                        "kind": res.kind,
                        "apiVersion": res.api_version,
                        "metadata": {
                            "resourceVersion": str(self._rv),
                            "annotations": {"k8s.io/initial-events-end": "true"},
                        },
                    },
                )
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
                if event is CLOSE:
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
            queue.put_nowait(CLOSE)
