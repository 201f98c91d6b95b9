"""Many requests at once, each on its own thread and gRPC stream, so the server's batcher can fuse them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def send_concurrently(
    send_one: Callable[..., Any],
    requests: Sequence[dict[str, Any]],
    url: str,
    model: str,
    timeout_s: float,
    on_event: Callable[[int, Any], bool | None] | None,
) -> list[Any]:
    """``send_one(request, request_id, url, model, timeout_s, callback)`` for every request at once, each
    on its own thread and stream; results in request order. ``on_event(index, event)`` gets each
    request's progress events (return True to cancel that request)."""
    if not requests:
        return []

    def callback_for(index: int) -> Callable[[Any], bool | None] | None:
        return None if on_event is None else lambda event: on_event(index, event)

    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        futures = [
            pool.submit(send_one, req, str(i), url, model, timeout_s, callback_for(i))
            for i, req in enumerate(requests)
        ]
        return [f.result() for f in futures]
