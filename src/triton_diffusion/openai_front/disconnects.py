"""Streaming answers to the client: server-sent events, and a client that goes away cancels its Triton
request.

Starlette neither cancels a handler nor (with ASGI 2.4 servers) a streaming body when the connection
closes; it notices only at the next write. These helpers race the work against the client's
``http.disconnect`` and cancel the work, whose ``finally`` cancels the gRPC call and so the Triton
request: its rows leave the engine at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Mapping
from typing import Any, Protocol, TypeVar

import anyio
from starlette.requests import Request

from triton_diffusion.openai_front.errors import ApiError, bad_gateway, no_final


class _Response(Protocol):
    @property
    def final(self) -> bool:
        """Whether it is the request's FINAL response."""


T = TypeVar("T")
R = TypeVar("R", bound=_Response)  # a Triton response (triton_bridge.TritonResponse)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer


def sse(data: Mapping[str, Any] | str, event: str | None = None) -> bytes:
    """One server-sent event."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


def error_event(error: ApiError) -> bytes:
    """An error after the stream began (the status line is sent): the openai client raises it."""
    return sse(error.body(), "error")


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


async def final_response(request: Request, responses: AsyncGenerator[R, None]) -> tuple[bool, R | None]:
    """The stream's FINAL response (``final`` set), or (False, None) when the client left first; the
    stream is closed either way. A stream that ends without one is a 502."""

    async def final() -> R:
        async with contextlib.aclosing(responses):
            async for response in responses:
                if response.final:
                    return response
        raise no_final()

    return await until_disconnected(request, final())


async def first_response(request: Request, responses: AsyncGenerator[R, None]) -> tuple[bool, R | None]:
    """The stream's first response (what decides between a plain 4xx and a stream), or (False, None) when
    the client left first, the stream then closed. A stream that ends without any response is a 502."""
    answered, first = await until_disconnected(request, anext(responses, None))
    if not answered or first is None:
        await responses.aclose()
    if answered and first is None:
        raise bad_gateway("Triton ended the stream without any response")
    return answered, first


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
