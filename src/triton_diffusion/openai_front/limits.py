"""Limits on what a request may make the front read, applied before anything is parsed.

A body is read only up to its limit (a larger Content-Length is refused before the first byte), JSON is
checked for nesting depth on the raw bytes before ``json.loads`` sees it, and multipart bodies are parsed
with caps on files, fields and part sizes. Every size a request controls has a limit here or in the
model's field declarations.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.datastructures import FormData
from starlette.requests import Request

from triton_diffusion.openai_front.errors import bad_request, too_large

# A JSON string, escapes included: removed before brackets are counted. Written so that no input makes
# it backtrack (linear time on any body): the unrolled loop has one way to match each byte, and the closing
# quote is optional, so an unterminated string (which json.loads refuses anyway) ends the match at the end
# of the body instead of failing and being retried from every later quote (quadratic: 40 KB of ``\"``
# took 10 s on the event loop).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.S)


@dataclass(frozen=True)
class Limits:
    max_json_bytes: int = 1 << 20  # prompts are at most a few thousand characters
    max_json_depth: int = 32
    max_multipart_bytes: int = 24 << 20  # two images of up to 10 MB each, and the form fields
    max_multipart_files: int = 2  # image and mask
    max_multipart_fields: int = 64
    max_form_field_bytes: int = 64 << 10
    max_n: int = 10  # images per request, before the model's own limit
    max_partial_images: int = 3  # OpenAI's range is 0..3
    max_chat_messages: int = 256
    request_timeout_s: float = 600.0  # the longest one Triton request may take


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, refused with 413 once it would pass ``max_bytes`` (by its Content-Length, or while
    reading when there is none)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("Content-Length is not a number", None, "invalid_request")
        if int(declared) > max_bytes:
            raise too_large(f"the request body is {int(declared)} bytes (allowed: at most {max_bytes} bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large(f"the request body is larger than {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def json_depth(body: bytes) -> int:
    """How deeply arrays and objects nest in a JSON text, counted without parsing it (a deep body would
    exhaust a recursive parser; Triton's HTTP front end crashes on one)."""
    brackets = np.frombuffer(_JSON_STRING.sub(b'""', body), dtype=np.uint8)
    if brackets.size == 0:
        return 0
    opens = (brackets == ord("[")) | (brackets == ord("{"))
    closes = (brackets == ord("]")) | (brackets == ord("}"))
    return int(np.cumsum(opens.astype(np.int64) - closes.astype(np.int64)).max(initial=0))


def parse_json_object(body: bytes, limits: Limits) -> dict[str, Any]:
    """The body as a JSON object, after the depth check; 400 for anything else."""
    depth = json_depth(body)
    if depth > limits.max_json_depth:
        raise bad_request(
            f"the JSON body nests {depth} levels deep (allowed: at most {limits.max_json_depth})",
            None,
            "invalid_json",
        )
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as exc:  # ValueError: also an integer of too many digits
        raise bad_request(f"the body is not valid JSON ({str(exc)[:80]})", None, "invalid_json") from None
    if not isinstance(value, dict):
        raise bad_request("the JSON body must be an object", None, "invalid_json")
    return value


async def parse_form(body: bytes, content_type: str, limits: Limits) -> FormData:
    """A multipart (or url-encoded) body, already read within its size limit, parsed with caps on files,
    fields and the size of each non-file part."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "headers": [(b"content-type", content_type.encode("latin-1"))]}
    try:
        return await Request(scope, receive).form(
            max_files=limits.max_multipart_files,
            max_fields=limits.max_multipart_fields,
            max_part_size=limits.max_form_field_bytes,
        )
    except Exception as exc:  # noqa: BLE001  (starlette raises its own errors for every malformed body)
        detail = getattr(exc, "detail", None) or str(exc) or type(exc).__name__
        raise bad_request(
            f"the multipart body cannot be read: {str(detail)[:120]}", None, "invalid_form"
        ) from None
