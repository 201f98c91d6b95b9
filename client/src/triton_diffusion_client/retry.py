"""Resending a request the server lost: after a crash (the launcher's supervisor restarts tritonserver),
a drain (a replica stopping, SIGTERM) or a broken connection.

Why it is safe to resend: every request carries a resume key (:func:`new_resume_key`; a caller may pass
its own). A server that checkpoints running jobs resumes a request resent with the same key and the same
fields from its last checkpoint instead of step 0; one that does not just runs it again; and a request
with a resume key and no seed draws its seed from the key, so either way the resend makes the same images.

What is resent (:func:`retryable`): a failure of the connection or the stream (gRPC UNAVAILABLE, the
stream cancelled or reset under the request: the server went away), a model process that died (Triton's
"Stub process ... is not healthy": the supervisor restarts the server), a model the server knows but has
not loaded yet (a restarted server: "... has no available versions"), a server being stopped ("Server is
stopping": the supervisor restarts it), and the server's own answers whose retry hint says ``resend`` or
``resume`` (:func:`hint_of`: a draining server's refusal, or its checkpoint of the job). Nothing else: a
request refused for what it is (INVALID_ARG), at capacity, past its deadline, failed inside the model, in
flight when the accelerator failed or the engine got stuck (it may be the cause), or refused by a model
shutting down (it may be unloaded on purpose) carries no hint and is answered at once. A server from
before retry hints (their drain answers carry none) is not resent to: upgrade servers first. Before a
resend the client waits, polling with backoff, for the server and the model to be ready again; the budget
is ``retries`` resends within the request's own total deadline (``timeout_s``).
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_RETRIES = 3
RESUME_KEY = re.compile(r"[A-Za-z0-9_-]{16,128}")
RESUME_KEY_FIELD = "resume_key"
# The backoff between readiness polls: a restart takes seconds (the models load again), a drain up to its
# drain time; polling faster only loads a server that is starting.
FIRST_WAIT_S = 0.1
MOST_WAIT_S = 2.0

# gRPC statuses of a stream or call that failed under the request, as tritonclient spells them.
_GONE = {"StatusCode.UNAVAILABLE", "StatusCode.CANCELLED"}
_BROKEN_WORDS = ("stream removed", "socket closed", "rst_stream", "connection reset", "goaway")
# A served error's retry hint: one JSON object (no nested braces) before the code's tag at the end.
_HINT = re.compile(r" retry=(\{[^{}]*\})(?= \[UNAVAILABLE\]\s*$)")
RESENDABLE = ("resend", "resume")  # the hints that say: send the same request again


def new_resume_key() -> str:
    """32 URL-safe characters (``[A-Za-z0-9_-]``), 192 random bits: no two requests share one."""
    return secrets.token_urlsafe(24)


def transport_failure(status: str | None, details: str) -> bool:
    """The connection or the stream failed under a request (the server went away or restarts): gRPC
    UNAVAILABLE or CANCELLED (this client cancels only streams it no longer reads), or a stream reset."""
    if status is None:
        return False
    status = status if status.startswith("StatusCode.") else f"StatusCode.{status}"
    if status in _GONE:
        return True
    return status in ("StatusCode.UNKNOWN", "StatusCode.INTERNAL") and any(
        word in details.lower() for word in _BROKEN_WORDS
    )


def hint_of(message: str) -> dict[str, Any] | None:
    """The retry hint a served error carries (``... retry={"retry":"resume","resume_key":"k","step":7}
    [UNAVAILABLE]``: ``triton_diffusion.errors.RetryHint``), or None: a message without one, or Triton's
    own. Read here only: the project's client and the OpenAI front decide by it, never by the words."""
    match = _HINT.search(message)
    if match is None:
        return None
    try:
        hint = json.loads(match.group(1))
    except ValueError:
        return None
    return hint if isinstance(hint, dict) and isinstance(hint.get("retry"), str) else None


def without_hint(message: str) -> str:
    """The message as a person reads it: the retry hint taken out (the code's tag stays)."""
    match = _HINT.search(message)
    return message if match is None else message[: match.start()] + message[match.end(1) :]


def retryable(status: str | None, message: str) -> bool:
    """Worth resending unchanged (the module's docstring says why each is). ``status`` is the gRPC
    status of a failed call or stream, None for an answer from the model. The server's own errors say so
    by their retry hint (``resend`` or ``resume``); only Triton's errors, which carry none, are read by
    their words (Triton's, not ours: rewording ours changes nothing here)."""
    if transport_failure(status, message):
        return True
    hint = hint_of(message)
    if hint is not None:  # read on UNAVAILABLE answers only (where the server puts them)
        return hint["retry"] in RESENDABLE
    if status is None and "Stub process" in message and "is not healthy" in message:
        return True  # a model process that died: the supervisor restarts the server
    if "has no available versions" in message:
        return True  # a server back up that is still loading the model (a name it does not know: "not found")
    return "Server is stopping" in message  # refused while the supervisor stops it to start it again


def unknown_resume_key(message: str) -> bool:
    """A server from before resume keys refused the field: resend without it (a plain rerun)."""
    return message.startswith(f"{RESUME_KEY_FIELD}: unknown field")


@dataclass
class RetryBudget:
    """One request's resends: at most ``retries`` of them, all within ``timeout_s`` of its start."""

    retries: int
    timeout_s: float
    resume_key: str | None
    clock: Callable[[], float] = time.monotonic
    attempts: int = 0  # requests sent (the first one included)
    resent: int = 0  # of them, resends after a failure
    failures: list[str] = field(default_factory=list)  # why each resend was needed
    started: float = 0.0

    def __post_init__(self) -> None:
        self.started = self.clock()

    @property
    def deadline(self) -> float:
        return self.started + self.timeout_s

    def left_s(self) -> float:
        return max(0.0, self.deadline - self.clock())

    def may_resend(self, status: str | None, message: str) -> bool:
        """Resend after this failure (and count it), or give up: not retryable, or the budget is spent."""
        if self.resent >= self.retries or self.left_s() <= 0:
            return False
        if not retryable(status, message):
            return False
        self.resent += 1
        self.failures.append(message)
        return True

    def timed_out(self) -> TimeoutError:
        last = f"; the last failure: {self.failures[-1][:200]}" if self.failures else ""
        return TimeoutError(
            f"no final response within {self.timeout_s} s ({self.attempts} attempts, {self.resent} "
            f"after a failure{last})"
        )


def wait_ready(
    ready: Callable[[], bool],
    deadline: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Poll ``ready()`` with backoff (it is asked after a first wait: the server that just failed is not
    back yet) until it says True (True) or ``deadline`` passes (False)."""
    wait = FIRST_WAIT_S
    while True:
        left = deadline - clock()
        if left <= 0:
            return False
        sleep(min(wait, left))
        if clock() < deadline and ready():
            return True
        wait = min(wait * 2, MOST_WAIT_S)


async def wait_ready_async(
    ready: Callable[[], Awaitable[bool]], deadline: float, clock: Callable[[], float] = time.monotonic
) -> bool:
    """:func:`wait_ready` on an event loop (the OpenAI front)."""
    wait = FIRST_WAIT_S
    while True:
        left = deadline - clock()
        if left <= 0:
            return False
        await asyncio.sleep(min(wait, left))
        if clock() < deadline and await ready():
            return True
        wait = min(wait * 2, MOST_WAIT_S)
