"""Encoding and sending responses off the engine's thread, so the next step is not delayed.

One worker thread runs the handed-over work in order: a request's progress responses, handed over at
its steps, always go out before its FINAL response, handed over when it is done. Work that raises fails
its own request only (with an error FINAL, through its TrackedRequest). Work handed over after
:meth:`close` runs on the caller's thread, so nothing is dropped at shutdown.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from triton_diffusion.engine.requests import TrackedRequest
from triton_diffusion.errors import ErrorCode, RequestError

log = logging.getLogger("triton_diffusion")


class ResponseWorker:
    def __init__(self, name: str = "responses") -> None:
        self._queue: queue.Queue[tuple[TrackedRequest | None, Callable[[], None]] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, request: TrackedRequest | None, work: Callable[[], None]) -> None:
        """Run ``work`` on the response thread; ``request`` (None for metrics) fails if it raises."""
        with self._lock:
            if not self._closed and self._thread.is_alive():
                self._queue.put((request, work))
                return
        self._do(request, work)

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish what was handed over, then stop."""
        with self._lock:
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout_s)

    def fail_queued(self, error: RequestError) -> None:
        """Answer with ``error`` every request whose work is still queued (after a :meth:`close` that
        timed out: the process is about to leave)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[0] is not None:
                item[0].fail(error)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._do(*item)

    @staticmethod
    def _do(request: TrackedRequest | None, work: Callable[[], None]) -> None:
        if request is not None and request.ended:
            return
        try:
            work()
        except RequestError as error:  # a refused output (e.g. too large): its own code and message
            if request is not None:
                request.fail(error)
        except Exception as exc:  # noqa: BLE001  (an encoding failure fails this request only)
            if request is None:
                log.exception("response work failed")
                return
            log.exception("request %s: building its response failed", request.request_id)
            request.fail(RequestError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
