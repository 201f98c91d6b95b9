"""The stall watchdog: notices an engine that has work but has reported nothing for ``stall_s`` (or 5x its
slowest step, if longer): a deadlock, or a kernel that never returns. Its thread then calls ``on_stall``
once (the worker answers what the engine holds UNAVAILABLE and the process exits, so the launcher's
supervisor restarts the server)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("triton_diffusion")

# The slowest step seen, times this, is the stall bound when it is longer than stall_s.
STALL_FACTOR = 5


class StallWatchdog:
    def __init__(
        self,
        stall_s: float,
        watched: Callable[[], bool],
        on_stall: Callable[[str], None],
        name: str = "engine-watchdog",
    ) -> None:
        self.stall_s = stall_s
        self.watched = watched  # while this is true (the engine's thread lives), keep watching
        self.on_stall = on_stall
        self.slowest_step_s = 0.0
        self._started: float | None = None  # monotonic time of the last beat while in a step
        self._thread = threading.Thread(target=self._watch, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def step_started(self) -> None:
        self._started = time.monotonic()

    def step_ended(self) -> None:
        self._started = None  # idle (or restarting) is never a stall

    def beat(self) -> None:
        """The engine reported progress (a step, or a denoising step inside a fused call)."""
        now = time.monotonic()
        started = self._started
        if started is not None:
            self.slowest_step_s = max(self.slowest_step_s, now - started)
            self._started = now

    def bound_s(self) -> float:
        return max(self.stall_s, STALL_FACTOR * self.slowest_step_s)

    def _watch(self) -> None:
        period = min(1.0, self.stall_s / 4)
        while self.watched():
            time.sleep(period)
            started = self._started
            if started is None or time.monotonic() - started <= self.bound_s():
                continue
            stalled = time.monotonic() - started
            error = f"the engine reported nothing for {stalled:.0f} s (bound {self.bound_s():.0f} s)"
            log.critical("%s: it is stuck; answering what it holds and exiting for a restart", error)
            self.on_stall(error)
            return
