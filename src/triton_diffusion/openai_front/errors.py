"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with their HTTP status.

Every error our models send ends with its code as a stable tag (``width: got 4096 (allowed: 64..512,
multiple of 8) [INVALID_ARG]``; ``triton_diffusion.errors.code_of``): Triton's gRPC stream carries the
message but not the code, so the model puts the code in the message. :func:`from_triton_message` maps
that code to the HTTP status and shows the message without the tag; a field error (INVALID_ARG) starts
with the field's name, which becomes ``param``.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

from triton_diffusion_client.retry import hint_of, without_hint

from triton_diffusion.errors import ErrorCode, code_of

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"

# "name: rest" where name is what invalid_field() put first (Triton may put the request id before it).
_FIELD_PREFIX = re.compile(r"^(?:\[request id: [^\]]*\] )?([A-Za-z_][A-Za-z0-9_]{0,63}): (.*)$", re.S)
# Triton's own words for a dead Python backend stub ("Stub process '...' is not healthy."): the only
# untagged message the front tells apart (see _untagged). A client may retry it.
_TRITON_UNAVAILABLE = ("is not healthy",)


class ApiError(Exception):
    """An error answered to the client; ``status`` is the HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.retry: dict[str, Any] | None = None  # the model's retry hint, where it gave one

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {
            "message": self.message,
            "type": self.error_type,
            "param": self.param,
            "code": self.code,
        }
        if self.retry is not None:  # beside OpenAI's four keys: {"retry": "resend" | "resume", ...}
            error["retry"] = self.retry
        return {"error": error}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, INVALID_REQUEST, param, code)


def field_error(field: str, message: str, param: str | None = None) -> ApiError:
    """A 400 worded like our models' own field errors: ``field: message``."""
    return bad_request(f"{field}: {message}", param or field)


def model_not_found(name: str) -> ApiError:
    return ApiError(
        404, f"model {name!r} does not exist or is not ready", INVALID_REQUEST, "model", "model_not_found"
    )


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, SERVER_ERROR, None, "service_unavailable")


def too_large(message: str) -> ApiError:
    return ApiError(413, message, INVALID_REQUEST, None, "request_too_large")


def bad_gateway(message: str) -> ApiError:
    """502: Triton answered, but not as our models do (a stream that ended early)."""
    return ApiError(502, message, SERVER_ERROR, None, "bad_gateway")


def no_final() -> ApiError:
    """502 for a stream Triton ended without a FINAL response: never a silent end of an answer."""
    return bad_gateway("Triton ended the stream without a FINAL response")


def server_error(message: str) -> ApiError:
    return ApiError(500, message, SERVER_ERROR, None, "server_error")


def from_triton_message(
    message: str, fields: Collection[str], openai_names: Mapping[str, str] | None = None
) -> ApiError:
    """A model's per-request error as an ApiError, its status from the message's tag: INVALID_ARG 400
    (``param``: the field the message starts with, when the model declares it or refused it as unknown),
    UNAVAILABLE 503 (retry later), CANCELLED 499, INTERNAL 500. ``openai_names`` maps a model field to the
    OpenAI parameter it came from (``num_images_per_prompt`` -> ``n``) for ``param``."""
    code = code_of(message)
    if code is None:
        return _untagged(message)
    hint = hint_of(message)
    text = without_hint(message).rstrip()
    text = text[: text.rindex("[")].rstrip()  # the tag is for the front, not the client
    if code is ErrorCode.INVALID_ARG:
        return bad_request(text, _param(text, fields, openai_names or {}))
    if code is ErrorCode.UNAVAILABLE:
        refused = unavailable(text)
        # Machine-readable, in the body. Only "resend": the key the model names is the front's own (it
        # refuses a client's), so an OpenAI client's resend is a new request that starts over.
        refused.retry = {"retry": "resend"} if hint is not None else None
        return refused
    if code is ErrorCode.CANCELLED:
        return ApiError(499, text, INVALID_REQUEST, None, "cancelled")
    return server_error(text)


def _param(text: str, fields: Collection[str], openai_names: Mapping[str, str]) -> str | None:
    """The OpenAI parameter a field error is about: the field its message starts with, when the model
    declares it (or refused it as unknown: the name the client sent), as the parameter it came from."""
    match = _FIELD_PREFIX.match(text)
    if match is None:
        return None
    name, rest = match.group(1), match.group(2)
    if name.lower() in fields or name == "parameters":
        return openai_names.get(name.lower(), name.lower())
    return name if rest.startswith("unknown field") else None


def _untagged(message: str) -> ApiError:
    """A message without a tag is not one of our models' (they tag every error): Triton's own, which only
    its words can classify. A dead stub is worth a retry (the supervisor restarts the server); anything
    else is a 500."""
    lowered = message.lower()
    if any(words in lowered for words in _TRITON_UNAVAILABLE):
        return unavailable(message)
    return server_error(message)
