"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with their HTTP status.

Our models answer a bad request with a per-request INVALID_ARG whose message starts with the field's
name (``height: got 100000 (allowed: 64..512, multiple of 8)``, see ``triton_diffusion.errors``). Triton's
gRPC stream passes on the message but not the code, so :func:`from_triton_message` tells a field error
from a server error by that prefix: a name the model declares (its inputs, lower-cased), or an unknown
field the model refused by name. The message is kept exactly as the model wrote it.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"

# "name: rest" where name is what invalid_field() put first.
_FIELD_PREFIX = re.compile(r"^(?:\[request id: [^\]]*\] )?([A-Za-z_][A-Za-z0-9_]{0,63}): (.*)$", re.S)
# Messages of a server that is restarting, a model that is going away or full, and a request too big for
# the accelerator's memory right now: every UNAVAILABLE our models answer (serving/engine_host.py,
# engine/failures.py), and Triton's own words for a dead Python backend stub. A client may retry these.
_UNAVAILABLE_HINTS = (
    "is not healthy",  # Triton: "Stub process '...' is not healthy."
    "the model is restarting",  # a lost device, a stalled engine, a process leaving for a restart
    "the model is shutting down",  # unloading, or the engine thread ended
    "the model is at capacity",  # no room for the request within max_admission_wait_s
    "out of memory",  # "... failed: OutOfMemoryError: CUDA out of memory. ..." (alone it does not fit)
    "memoryerror",  # OutOfMemoryError, and a host MemoryError, whose message may be empty
    "unavailable",
)


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

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


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


def server_error(message: str) -> ApiError:
    return ApiError(500, message, SERVER_ERROR, None, "server_error")


def from_triton_message(
    message: str, fields: Collection[str], openai_names: Mapping[str, str] | None = None
) -> ApiError:
    """A model's per-request error as an ApiError: 400 naming the field when the message starts with one
    of the model's fields (or refuses an unknown one), 503 when the model or server is going away,
    499 for a cancelled request, 500 otherwise. ``openai_names`` maps a model field to the OpenAI
    parameter it came from (``num_images_per_prompt`` -> ``n``) for ``param``."""
    match = _FIELD_PREFIX.match(message)
    if match:
        name, rest = match.group(1), match.group(2)
        known = name.lower() in fields or name == "parameters"
        if known or rest.startswith("unknown field"):
            field = name.lower() if known else name
            return bad_request(message, (openai_names or {}).get(field, field))
    lowered = message.lower()
    if lowered.startswith("cancelled") or "cancelled" in lowered.split(":")[0]:
        return ApiError(499, message, INVALID_REQUEST, None, "cancelled")
    if any(hint in lowered for hint in _UNAVAILABLE_HINTS):
        return unavailable(message)
    return server_error(message)
