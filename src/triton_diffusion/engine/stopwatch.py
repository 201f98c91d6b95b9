"""Seconds of the engine's work as the device spends them, not as the host waits for them.

On a GPU a forward's call returns once its kernels are queued: the host's clock around it measures the
launch, and the next call that waits for the device (a decode's copy to the host) absorbs every forward
queued before it. The cost model (engine/estimates.py), which deadlines, refusals, the drain and the
packing gate price by, must see what each piece of work costs the device, so on CUDA a span is two events
on the device's stream, and its seconds are the time between them on the device's own timeline (idle gaps
while the host launches included, work queued before the span left out). The engine never waits for
them: :meth:`Stopwatch.settle`, at the top of each engine step, records the spans the device has passed,
in order. On a CPU the host's clock is the device's, and a span is recorded when it stops.

What it leaves out on a GPU: work queued on the device and not yet run is in no span yet (the host runs
at most a few forwards ahead of it: the launch queue is bounded), so an estimate made meanwhile prices it
as the steps those jobs have left, not as time the device still owes. The events sit on the device's
current stream, which the engine thread's forwards and CUDA graph replays use; another thread's copies
on that stream (a preview's) can fall inside a span, a little.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("triton_diffusion")

# Spans waiting for the device, past which the oldest is waited for: the device is never more than a
# few forwards behind the host, so this only bounds what a stuck device could pile up.
MOST_PENDING = 64


class Event(Protocol):
    """What a span needs of a device event (``torch.cuda.Event(enable_timing=True)``)."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end: Any) -> float:
        """Milliseconds from this event to ``end``."""


class Stopwatch:
    """Starts and stops spans of the engine's work; each stopped span's device seconds go to its
    ``record`` callback, at once on a CPU, later (:meth:`settle`) on a GPU."""

    def __init__(self, events: Callable[[], Event] | None = None):
        self.events = events  # None: the host's clock (a CPU)
        self.pending: deque[tuple[Event, Event, Callable[[float], None]]] = deque()

    @classmethod
    def on(cls, device: object) -> Stopwatch:
        """For a model on ``device`` (a torch device or its name; None: a CPU)."""
        if device is None:
            return cls()
        import torch

        if torch.device(str(device)).type != "cuda":
            return cls()
        index = torch.device(str(device)).index

        def event() -> Event:
            return _CudaEvent(torch.cuda.Event(enable_timing=True), index)

        return cls(event)

    def start(self) -> tuple[float, Event | None]:
        """A span begins: a mark to :meth:`stop` it with."""
        began = None
        if self.events is not None:
            began = self.events()
            began.record()
        return time.perf_counter(), began

    def stop(self, mark: tuple[float, Event | None], record: Callable[[float], None]) -> float:
        """The span of ``mark`` ends: ``record`` gets its device seconds (at once, or at a later
        :meth:`settle`). Returns its host seconds (what the caller waited)."""
        host_s = time.perf_counter() - mark[0]
        began = mark[1]
        if began is None or self.events is None:
            record(host_s)
            return host_s
        ended = self.events()
        ended.record()
        self.pending.append((began, ended, record))
        if len(self.pending) > MOST_PENDING:
            self.settle(wait=True, most=len(self.pending) - MOST_PENDING)
        return host_s

    def settle(self, wait: bool = False, most: int | None = None) -> None:
        """Record the spans the device has passed, oldest first (with ``wait``, waiting for them; ``most``
        at most). A device that fails here drops what is pending: the next forward raises its error."""
        done = 0
        while self.pending and (most is None or done < most):
            began, ended, record = self.pending[0]
            try:
                if not wait and not ended.query():
                    return
                ended.synchronize()
                seconds = began.elapsed_time(ended) / 1000
            except Exception as exc:  # noqa: BLE001  (the device's error belongs to the engine's forward)
                log.warning("stopwatch: %d span(s) dropped (%s)", len(self.pending), exc)
                self.pending.clear()
                return
            self.pending.popleft()
            record(seconds)
            done += 1


class _CudaEvent:
    """A CUDA event recorded on its device's current stream (the engine thread's)."""

    def __init__(self, event: Any, index: int | None):
        self.event, self.index = event, index

    def record(self) -> None:
        import torch

        self.event.record(torch.cuda.current_stream(self.index))

    def query(self) -> bool:
        return bool(self.event.query())

    def synchronize(self) -> None:
        self.event.synchronize()

    def elapsed_time(self, end: Any) -> float:
        return float(self.event.elapsed_time(end.event))
