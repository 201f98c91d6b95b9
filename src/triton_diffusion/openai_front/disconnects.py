"""A client that goes away cancels its Triton request.

Starlette neither cancels a handler nor (with ASGI 2.4 servers) a streaming body when the connection
closes; it notices only at the next write. These helpers race the work against the client's
``http.disconnect`` and cancel the work, whose ``finally`` cancels the gRPC call and so the Triton
request: its rows leave the engine at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import anyio
from starlette.requests import Request

T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _cancel(task: asyncio.Future) -> None:
    """Cancel ``task`` and wait for it to finish (its ``finally`` blocks cancel the gRPC call)."""
    if task.done():
        if not task.cancelled():
            task.exception()  # seen by the caller already, or of no interest once the client left
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):  # the client is gone: nobody to tell
        await task


async def until_disconnected(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run ``work``; (True, result), or (False, None) when the client disconnected first (the work is
    cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Shielded: when the server cancels this handler, the cleanup must still run to the end.
        with anyio.CancelScope(shield=True):
            await _cancel(watcher)
            if not task.done():
                await _cancel(task)  # the client went away first
    if task.cancelled():
        return False, None
    return True, task.result()


async def stream_until_disconnected(request: Request, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Yield ``events`` until they end or the client disconnects; either way they are closed. Starlette
    may also cancel this generator when it sees the disconnect first: the cleanup is shielded."""
    watcher = asyncio.ensure_future(_disconnected(request))
    pending: asyncio.Future | None = None
    try:
        while True:
            pending = asyncio.ensure_future(events.__anext__())
            await asyncio.wait({pending, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not pending.done():
                return  # the client went away: the finally below cancels the pending read
            try:
                chunk = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield chunk
    finally:
        with anyio.CancelScope(shield=True):
            await _cancel(watcher)
            if pending is not None:
                await _cancel(pending)
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()
