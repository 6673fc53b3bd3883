"""SSE keep-alive comments (`: keep-alive`) while a stream waits for its next event, so that proxies with idle timeouts keep long-TTFT streams open; the worker's and the router's streams wrap their events with it. OpenAI clients skip comment lines (the SSE spec: a line starting with a colon). No torch."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

KEEP_ALIVE = b": keep-alive\n\n"
DEFAULT_INTERVAL_S = 10.0

T = TypeVar("T")


def is_comment(event: bytes) -> bool:
    """An SSE event that is only a comment (a heartbeat): no data for the client's parser."""
    return event.startswith(b":")


async def with_heartbeats(events: AsyncIterator[bytes], interval_s: float) -> AsyncIterator[bytes]:
    """`events`, with KEEP_ALIVE yielded each time `interval_s` passes without one (0: never). Closing this
    iterator closes `events` (its `finally` runs: the engine request is aborted, the upstream closed)."""
    if interval_s <= 0:
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()
        return
    it = events.__aiter__()
    pending: asyncio.Future[bytes] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield KEEP_ALIVE
                continue
            task, pending = pending, None
            try:
                event = task.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        if pending is not None:
            # NOTE: the inner iterator is suspended inside `pending`: it must finish (cancelled) before
            # aclose(), which refuses a generator that is still running.
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await events.aclose()


async def wait_or_beat(aw: Awaitable[T], interval_s: float) -> tuple[asyncio.Future[T], bool]:
    """Start `aw` and wait up to `interval_s` for it: (its future, whether it finished). A caller that gets False
    answers with a stream of heartbeats until the future settles (`beat_until`)."""
    fut = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({fut}, timeout=interval_s if interval_s > 0 else None)
    except BaseException:
        fut.cancel()
        raise
    return fut, bool(done)


async def beat_until(fut: asyncio.Future, interval_s: float) -> AsyncIterator[bytes]:
    """KEEP_ALIVE every `interval_s` until `fut` is done (the caller then reads its result)."""
    while not fut.done():
        done, _ = await asyncio.wait({fut}, timeout=interval_s)
        if not done:
            yield KEEP_ALIVE
