"""A request's life, tracked in one place: waiting, running, answered (exactly one FINAL). The engines see
it as data (engine/request_status.py's Request: its id, when it entered): they never call it, nor answer it.

Every path that answers a request (a result, a validation error, a cancellation, a failed forward,
shutdown), on whatever thread, goes through :meth:`TrackedRequest.finish` or :meth:`TrackedRequest.fail`.
The first caller claims the answer and sends it; later callers are no-ops. The request counts as
answered only after the send was tried: if sending the result raises (shared memory full, sender
closed), an error FINAL is sent in its place, so the client never hangs and no batch-mate is touched.

An engine decides an error without sending it; the host ends the request with it when it renders the
engine's report (:meth:`TrackedRequest.end`): the request counts as ended at once (nothing more is sent
for it: progress responses still queued for it are dropped), and the error goes out on the response
thread (:meth:`TrackedRequest.deliver`), in the order the engine decided it. Whoever calls :meth:`fail` on an
ended request that was not delivered yet (shutdown, the watchdog) sends the decided error, so a decision
is never lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any, Protocol

from triton_diffusion.errors import ErrorCode, RequestError

log = logging.getLogger("triton_diffusion")


class Stage(str, Enum):
    WAITING = "waiting"  # validated; waiting for a fused call or a place in the running set
    RUNNING = "running"  # in a fused call, or stepping in the step engine
    ENDED = "ended"  # an engine decided its error; the response thread sends it
    ANSWERED = "answered"  # its one FINAL response went out (or could not be sent at all)


class ResponseChannel(Protocol):
    """How a request is answered: a Triton response sender (serving/triton_io.py) or a test recorder."""

    def send_partial(self, outputs: Mapping[str, Any]) -> None: ...

    def send_final(self, outputs: Mapping[str, Any]) -> None: ...

    def send_error(self, error: RequestError) -> None: ...

    def is_cancelled(self) -> bool: ...


# Called once per request after its FINAL went out: (request, None) for a result, (request, code) for
# an error.
AnsweredHook = Callable[["TrackedRequest", ErrorCode | None], None]


class TrackedRequest:
    def __init__(
        self,
        request_id: str,
        channel: ResponseChannel,
        on_answered: AnsweredHook | None = None,
        entered: float | None = None,
        timeout_us: int = 0,
    ) -> None:
        self.request_id = request_id
        self.channel = channel
        self.entered = time.perf_counter() if entered is None else entered
        # Triton's per-request timeout (tritonclient's timeout=), counted from execute() entry: 0 for none.
        self.timeout_us = timeout_us
        self.stage = Stage.WAITING
        self._on_answered = on_answered
        self._lock = threading.Lock()
        self._claimed = False
        self._decided: RequestError | None = None  # ended by an engine, not delivered yet

    def __repr__(self) -> str:
        return f"TrackedRequest({self.request_id!r}, {self.stage.value})"

    @property
    def ended(self) -> bool:
        """True once an answer is claimed: nothing more should be computed or sent for this request."""
        return self._claimed

    @property
    def error(self) -> RequestError | None:
        """The error an engine decided (before and after it is delivered), or None."""
        return self._decided

    def start(self) -> None:
        with self._lock:  # never over an answer given meanwhile on another thread
            if self.stage is Stage.WAITING:
                self.stage = Stage.RUNNING

    def progress(self, outputs: Mapping[str, Any]) -> bool:
        """A non-final response. A send that raises fails the request (with an error FINAL if possible).
        Sent under the request's lock, so nothing can follow its FINAL from another thread."""
        with self._lock:
            if self._claimed:
                return False
            try:
                self.channel.send_partial(outputs)
                return True
            except Exception as exc:  # noqa: BLE001  (this request alone is affected)
                failure = exc
        log.warning("request %s: progress response failed: %s", self.request_id, failure)
        self.fail(RequestError(ErrorCode.INTERNAL, f"sending a progress response failed: {failure}"))
        return False

    def finish(self, outputs: Mapping[str, Any]) -> bool:
        """Answer with the result. Returns False when the request was answered already."""
        return self._answer(lambda: self.channel.send_final(outputs), None)

    def fail(self, error: RequestError) -> bool:
        """Answer with an error (an engine's decided one, if it ended the request and it is not out yet).
        Returns False when the request was answered already."""
        with self._lock:  # one critical section: an end() in between cannot leave it unanswered
            if self.stage is Stage.ENDED and self._decided is not None:
                error = self._decided  # the engine's decision goes out, not this one
            elif self._claimed:
                return False
            self._claimed = True
            code = self._send(lambda: self.channel.send_error(error)) or error.code
        self._answered(code)
        return True

    def end(self, error: RequestError) -> bool:
        """An engine decides this request's error: it counts as ended now; :meth:`deliver` sends it.
        Returns False when the request had ended or been answered already."""
        with self._lock:
            if self._claimed:
                return False
            self._claimed = True
            self._decided = error
            self.stage = Stage.ENDED
        return True

    def deliver(self) -> bool:
        """Send the error :meth:`end` decided (the response thread). Returns False if nothing was due."""
        with self._lock:
            if self.stage is not Stage.ENDED or self._decided is None:
                return False
            error = self._decided
            self._send(lambda: self.channel.send_error(error))
        self._answered(error.code)
        return True

    def is_cancelled(self) -> bool:
        """Ask the client side once; a failing query counts as not cancelled."""
        try:
            return bool(self.channel.is_cancelled())
        except Exception as exc:  # noqa: BLE001
            log.warning("request %s: cancellation query failed: %s", self.request_id, exc)
            return False

    def _answer(self, send: Callable[[], None], code: ErrorCode | None) -> bool:
        with self._lock:
            if self._claimed:
                return False
            self._claimed = True
            code = self._send(send) or code
        self._answered(code)
        return True

    def _send(self, send: Callable[[], None]) -> ErrorCode | None:
        """Send under the lock; returns INTERNAL if the answer could not go out (an error went instead)."""
        failed = None
        try:
            send()
        except Exception as exc:  # noqa: BLE001  (the result could not go out: an error FINAL instead)
            failed = ErrorCode.INTERNAL
            try:
                self.channel.send_error(RequestError(failed, f"sending the response failed: {exc}"))
            except Exception:  # noqa: BLE001  (nothing more can be done for this client)
                pass
            log.error("request %s: sending its final response failed: %s", self.request_id, exc)
        self.stage = Stage.ANSWERED
        return failed

    def _answered(self, code: ErrorCode | None) -> None:
        if self._on_answered is not None:
            try:
                self._on_answered(self, code)
            except Exception:  # noqa: BLE001  (metrics must never cost a request its answer)
                log.exception("request %s: answered hook failed", self.request_id)
