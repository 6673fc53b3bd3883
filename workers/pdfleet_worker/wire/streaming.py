"""HTTP plumbing shared by the worker and the router (torch-free): body limits, disconnect watching, SSE framing, the
SSE response that stops on disconnect, OpenAI error handlers."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from pdfleet_worker.wire import errors, json_body
from pdfleet_worker.wire.errors import RequestError

log = logging.getLogger("pdfleet.http")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientGone(Exception):
    """The client closed the connection before the answer was complete."""


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON; 413 past `limit` bytes (checked before and while reading), 400 if malformed
    or hostile (protocol.decode_json)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise RequestError(413, f"request body is {length} bytes; the limit is {limit}", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return json_body.decode_json(b"".join(chunks))


async def until_disconnect(request: Request, aw: Awaitable[Any]) -> Any:
    """Await `aw` unless the client disconnects first (then it is cancelled and ClientGone raised).
    Only after the body was read: the next receive() is the disconnect."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise ClientGone()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(Response):
    """SSE that stops its iterator (whose `finally` aborts the engine requests) the moment the
    client disconnects, not at the next token."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        headers: dict[str, str] | None = None,
        on_close: Callable[[], None] | None = None,
    ):
        """on_close runs after the iterator is closed, even if it never started (its own
        `finally` would not run then); it must be idempotent."""
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        state = {"gone": False, "finished": False}

        async def watch() -> None:
            await _disconnected(receive)
            if not state["finished"]:
                state["gone"] = True
                task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            state["finished"] = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            task.uncancel()
        except OSError:
            pass
        finally:
            state["finished"] = True
            watcher.cancel()
            await self.events.aclose()
            if self.on_close is not None:
                self.on_close()


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI error object (the router uses these too)."""

    @app.exception_handler(RequestError)
    async def request_error(request: Request, e: RequestError) -> Response:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's code for a closed client

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            errors.error_body(f"{request.method} {request.url.path}: {e.detail}", kind),
            status_code=e.status_code,
            headers=getattr(e, "headers", None),
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> Response:
        return JSONResponse(errors.error_body(str(e)), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> Response:
        return internal_error_response(request.method, request.url.path, e)


def internal_error_response(method: str, path: str, e: BaseException) -> Response:
    """A bug's 500: the details go to the log only (an exception's text may hold the request, an
    internal request or an address), the client gets an id to quote."""
    incident = uuid.uuid4().hex[:12]
    log.error("unhandled error on %s %s (incident %s)", method, path, incident, exc_info=e)
    return JSONResponse(
        errors.error_body(f"internal server error (incident {incident})", "server_error"), status_code=500
    )
