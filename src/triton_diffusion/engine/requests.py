"""A request's life, tracked in one place: waiting, running, answered (exactly one FINAL).

Every path that answers a request (a result, a validation error, a cancellation, a failed pipeline call,
shutdown), on whatever thread, goes through :meth:`TrackedRequest.finish` or :meth:`TrackedRequest.fail`.
The first caller claims the answer and sends it; later callers are no-ops. The request counts as
answered only after the send was tried: if sending the result raises (shared memory full, sender
closed), an error FINAL is sent in its place, so the client never hangs and no batch-mate is touched.
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
    ) -> None:
        self.request_id = request_id
        self.channel = channel
        self.entered = time.perf_counter() if entered is None else entered
        self.stage = Stage.WAITING
        self._on_answered = on_answered
        self._lock = threading.Lock()
        self._claimed = False

    def __repr__(self) -> str:
        return f"TrackedRequest({self.request_id!r}, {self.stage.value})"

    @property
    def ended(self) -> bool:
        """True once an answer is claimed: nothing more should be computed or sent for this request."""
        return self._claimed

    def start(self) -> None:
        if not self._claimed:
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
        """Answer with an error. Returns False when the request was answered already."""
        return self._answer(lambda: self.channel.send_error(error), error.code)

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
            try:
                send()
            except Exception as exc:  # noqa: BLE001  (the result could not go out: an error FINAL instead)
                code = ErrorCode.INTERNAL
                try:
                    self.channel.send_error(RequestError(code, f"sending the response failed: {exc}"))
                except Exception:  # noqa: BLE001  (nothing more can be done for this client)
                    pass
                log.error("request %s: sending its final response failed: %s", self.request_id, exc)
            self.stage = Stage.ANSWERED
        if self._on_answered is not None:
            try:
                self._on_answered(self, code)
            except Exception:  # noqa: BLE001  (metrics must never cost a request its answer)
                log.exception("request %s: answered hook failed", self.request_id)
        return True
