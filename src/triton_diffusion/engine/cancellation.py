"""Asking requests whether their client cancelled them, at most once per ``poll_s`` each: every ask is a
round trip to the server process (``request.is_cancelled()``). Used by both engines, between steps."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from triton_diffusion.engine.requests import Request
from triton_diffusion.errors import ErrorCode, RequestError

log = logging.getLogger("triton_diffusion")


class CancellationPolls:
    def __init__(self, poll_s: float = 0.0) -> None:
        self.poll_s = poll_s
        self._last: dict[int, float] = {}  # id(request) -> when it was last asked

    def end_cancelled(self, requests: Iterable[tuple[Request, str]]) -> list[Request]:
        """Ask each request not ended (once, and only when its last ask is ``poll_s`` old); end the ones
        cancelled with CANCELLED ("cancelled <where>", ``where`` given beside each request, such as
        "after step 3/8"). Returns the requests ended here."""
        now = time.perf_counter()
        asked: set[int] = set()
        ended = []
        for request, where in requests:
            key = id(request)
            if request.ended or key in asked or now - self._last.get(key, 0.0) < self.poll_s:
                continue
            asked.add(key)
            self._last[key] = now
            if request.is_cancelled():
                log.info("request %s cancelled %s", request.request_id, where)
                if request.end(RequestError(ErrorCode.CANCELLED, f"cancelled {where}")):
                    ended.append(request)
        return ended

    def forget(self, request: Request) -> None:
        self._last.pop(id(request), None)
