"""The host's side of aborts (engine/request_status.py's AbortSource): which held requests an engine must
drop.

A request the host ended already (a bug while rendering it, the watchdog) is dropped at once, with the
host's error. Whether a
client cancelled is asked at most once per ``poll_s`` per request, since every ask is a round trip to the
server process (``request.is_cancelled()``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import cast

from triton_diffusion.engine.request_status import Abort, Request
from triton_diffusion.errors import ErrorCode, RequestError
from triton_diffusion.serving.requests import TrackedRequest


class ClientAborts:
    def __init__(self, poll_s: float = 0.0) -> None:
        self.poll_s = poll_s
        # When each held request was last asked, by id(); kept for the requests held at the last call only.
        self._last: dict[int, float] = {}

    def aborted(self, held: Sequence[Request]) -> list[Abort]:
        now = time.perf_counter()
        aborts = []
        last, self._last = self._last, {}
        for request in held:
            tracked = cast(TrackedRequest, request)  # the host's jobs hold its own requests
            if tracked.ended:
                error = tracked.error or RequestError(ErrorCode.INTERNAL, "the request was answered")
                aborts.append(Abort(request, error))
                continue
            asked = last.get(id(request), float("-inf"))
            if now - asked >= self.poll_s:
                asked = now
                if tracked.is_cancelled():
                    aborts.append(Abort(request))
            self._last[id(request)] = asked
        return aborts
