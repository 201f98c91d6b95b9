"""The one answer path: encoding and sending responses off the engine's thread, so the next step is not
delayed.

One worker thread runs the handed-over work in order: a request's progress responses, handed over at
its steps, always go out before its FINAL response, handed over when it is done; an error an engine
decided (a failed forward, a cancellation, a deadline) is delivered in the same order
(:meth:`ResponseWorker.deliver`). Work that raises fails its own request only (with an error FINAL,
through its TrackedRequest). Work handed over after :meth:`close` runs on the caller's thread, so nothing
is dropped at shutdown.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from triton_diffusion.errors import ErrorCode, RequestError
from triton_diffusion.serving.requests import TrackedRequest

log = logging.getLogger("triton_diffusion")


@dataclass(frozen=True)
class _Work:
    request: TrackedRequest | None  # None: metrics
    run: Callable[[], object]  # what it returns is not read
    delivery: bool = False  # an engine's decided error: runs although the request has ended


class ResponseWorker:
    def __init__(self, name: str = "responses") -> None:
        self._queue: queue.Queue[_Work | None] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, request: TrackedRequest | None, work: Callable[[], None]) -> None:
        """Run ``work`` on the response thread, unless ``request`` has ended by then; ``request`` (None for
        metrics) fails if it raises."""
        self._put(_Work(request, work))

    def deliver(self, request: TrackedRequest) -> None:
        """Send the error an engine decided for ``request`` (TrackedRequest.end), in order."""
        self._put(_Work(request, request.deliver, delivery=True))

    def _put(self, work: _Work) -> None:
        with self._lock:
            if not self._closed and self._thread.is_alive():
                self._queue.put(work)
                return
        self._do(work)

    def flush(self, timeout_s: float) -> bool:
        """Wait until what was handed over so far is done (sent), at most ``timeout_s``. False on time."""
        done = threading.Event()
        self._put(_Work(None, done.set))
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 30.0) -> bool:
        """Finish what was handed over, then stop. False where ``timeout_s`` ended the wait first."""
        with self._lock:
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def fail_queued(self, error: RequestError) -> None:
        """Answer every request whose work is still queued (after a :meth:`close` that timed out: the
        process is about to leave): with ``error``, or the error an engine decided for it."""
        while True:
            try:
                work = self._queue.get_nowait()
            except queue.Empty:
                return
            if work is not None and work.request is not None:
                work.request.fail(error)

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            self._do(work)
            # Not kept while waiting for the next: a request referenced from here is never released, and
            # Triton's unload waits for every request of the model (a stop then took its whole exit timeout).
            del work

    @staticmethod
    def _do(work: _Work) -> None:
        request = work.request
        if request is not None and request.ended and not work.delivery:
            return
        try:
            work.run()
        except RequestError as error:  # a refused output (e.g. too large): its own code and message
            if request is not None:
                request.fail(error)
        except Exception as exc:  # noqa: BLE001  (an encoding failure fails this request only)
            if request is None:
                log.exception("response work failed")
                return
            log.exception("request %s: building its response failed", request.request_id)
            request.fail(RequestError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
