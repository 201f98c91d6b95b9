"""Per-request errors, kept free of Triton imports so the batching logic can be tested without a server."""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """The subset of ``pb_utils.TritonError`` codes this project answers with. What each means to a
    client (docs/reference/errors.md is generated from these lines):

    INVALID_ARG: the request itself is wrong (a field unknown, malformed, out of its limits or not
        supported by the model's pipeline); the message starts with the field's name and says what is
        allowed. Sending it again unchanged fails again; its batch-mates are not affected.
    UNAVAILABLE: the model cannot serve it now: at capacity (no room within max_admission_wait_s), out
        of memory for this request alone, a deadline the engine estimates it cannot meet or that passed,
        a model unloading or restarting after a failed accelerator or a stuck engine. Retry later.
    CANCELLED: the client cancelled the request (or went away); nobody reads the answer.
    INTERNAL: the model failed on this request alone (a forward or pipeline call that fails with it
        and not without it); its batch-mates are answered normally.
    """

    INVALID_ARG = "INVALID_ARG"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"
    CANCELLED = "CANCELLED"


class RequestError(Exception):
    """An error that belongs to one request and is sent back on that request's stream only."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


def code_of(message: str) -> ErrorCode | None:
    """The code a served error message carries as its tag (serving/triton_io.py ``tagged_message``), or
    None for a message without one (Triton's own errors)."""
    text = message.rstrip()
    if text.endswith("]") and "[" in text:
        tag = text[text.rindex("[") + 1 : -1]
        if tag in ErrorCode.__members__:
            return ErrorCode(tag)
    return None


def invalid_field(field: str, message: str) -> RequestError:
    return RequestError(ErrorCode.INVALID_ARG, f"{field}: {message}")


def short_text(value: object, limit: int = 40) -> str:
    """What a client sent, quoted for an error message: escaped, and cut to ``limit`` characters so a
    megabyte of input never comes back as a megabyte of error."""
    if isinstance(value, (str, bytes)):
        shown = repr(value[:limit])
        return shown if len(value) <= limit else f"{shown}... ({len(value)} long)"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
