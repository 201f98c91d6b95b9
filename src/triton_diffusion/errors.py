"""Per-request errors, kept free of Triton imports so the batching logic can be tested without a server."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum


class ErrorCode(str, Enum):
    """The subset of ``pb_utils.TritonError`` codes this project answers with. What each means to a
    client (docs/reference/errors.md is generated from these lines):

    INVALID_ARG: the request itself is wrong (a field unknown, malformed, out of its limits or not
        supported by the model's pipeline); the message starts with the field's name and says what is
        allowed. Sending it again unchanged fails again; its batch-mates are not affected.
    UNAVAILABLE: the model cannot serve it now: at capacity (no room within max_admission_wait_s), out
        of memory for this request alone, a deadline the engine estimates it cannot meet or that passed,
        a model unloading or restarting after a failed accelerator or a stuck engine. A later try may
        succeed; the project's clients resend at once only what carries a retry hint (a drain).
    CANCELLED: the client cancelled the request (or went away); nobody reads the answer.
    INTERNAL: the model failed on this request alone (a forward or pipeline call that fails with it
        and not without it); its batch-mates are answered normally.
    """

    INVALID_ARG = "INVALID_ARG"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"
    CANCELLED = "CANCELLED"


class Retry(str, Enum):
    """What a client may do about an error (its :class:`RetryHint`): the protocol, where the words are not.

    RESEND: send the same request again (the same fields and resume key) once the server is ready: a
        draining server refused it, or stopped it unfinished with nothing checkpointed, or the model
        began restarting (the accelerator failed, the engine got stuck) before it was handed to the engine.
        (A request the engine held then gets no hint: it may be the cause, and each resend would restart
        the model for everyone; nor one refused by a model shutting down: it may be unloaded on purpose,
        and a client would wait for it in vain.)
    RESUME: as RESEND, and a checkpoint of it was written under ``resume_key`` at ``step``: the resend
        goes on from there.
    The project's clients do not resend an error without a hint (some still say "retry later": at
    capacity, out of memory, a deadline; a later try, not the same one at once).
    """

    RESEND = "resend"
    RESUME = "resume"


@dataclass(frozen=True)
class RetryHint:
    """The machine-readable part of an error a client may act on. It travels at the end of the error's
    message, before the code's tag (``draining: ... retry={"retry":"resume","resume_key":"k","step":7}
    [UNAVAILABLE]``; :func:`tagged_message`), one JSON object without nested braces,
    read by ``triton_diffusion_client.retry.hint_of`` (the project's client and the OpenAI front): rewording
    the message changes nothing a client does."""

    retry: Retry
    resume_key: str | None = None
    step: int | None = None

    def text(self) -> str:
        fields = {"retry": self.retry.value, "resume_key": self.resume_key, "step": self.step}
        given = {k: v for k, v in fields.items() if v is not None}
        return "retry=" + json.dumps(given, separators=(",", ":"))


RESEND = RetryHint(Retry.RESEND)


class RequestError(Exception):
    """An error that belongs to one request and is sent back on that request's stream only; ``hint``: what
    a client may do about it (None: nothing but fix the request or give up)."""

    def __init__(self, code: ErrorCode, message: str, hint: RetryHint | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


def tagged_message(error: RequestError) -> str:
    """The error's message with its code as a stable tag at the end (``width: got 4096 (allowed: ...)
    [INVALID_ARG]``): Triton's gRPC stream carries the message but not the code, so a client reads the
    code from the tag (:func:`code_of`) instead of guessing it from the words. An error a client may
    resend carries its retry hint before the tag (:class:`RetryHint`)."""
    if error.hint is not None:
        return f"{error.message} {error.hint.text()} [{error.code.value}]"
    return f"{error.message} [{error.code.value}]"


def code_of(message: str) -> ErrorCode | None:
    """The code a served error message carries as its tag (:func:`tagged_message`), or
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
