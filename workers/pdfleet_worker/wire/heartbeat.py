"""SSE keep-alive comments (`: keep-alive`) while a stream waits for its next event, so that proxies with idle timeouts
keep long-TTFT streams open; the worker's and the router's streams wrap their events with it. OpenAI clients skip
comment lines (the SSE spec: a line starting with a colon). No torch."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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
    # NOTE: one reader task per stream and one timer that reads the time of the last event, not a task per event
    # racing a timeout: that cost ~57 us an event, this ~11 us (the shared 2-core machine); the router relays
    # every token through it.
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue(maxsize=8)
    last = loop.time()
    handle: asyncio.TimerHandle | None = None

    async def read() -> None:
        try:
            async for event in events:
                await queue.put(event)
            await queue.put(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # handed to the consumer, which raises it
            await queue.put(_Failed(e))

    def tick() -> None:
        nonlocal last, handle
        now = loop.time()
        if now - last >= interval_s and queue.empty():
            queue.put_nowait(KEEP_ALIVE)
            last = now
        due = last + interval_s
        handle = loop.call_at(due if due > now else now + interval_s, tick)

    reader = asyncio.ensure_future(read())
    handle = loop.call_at(last + interval_s, tick)
    try:
        while True:
            item = await queue.get()
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.error
            last = loop.time()
            yield item
    finally:
        if handle is not None:
            handle.cancel()
        reader.cancel()
        with contextlib.suppress(BaseException):
            await reader
        await events.aclose()


_END = object()


@dataclasses.dataclass
class _Failed:
    error: BaseException


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
