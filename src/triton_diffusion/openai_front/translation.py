"""OpenAI request values to our model fields: what every endpoint shares (image_translation.py,
video_translation.py and text_translation.py build their requests with it). Pure: no I/O.

Our own fields travel through the client's ``extra_body`` as top-level keys and go to the model as they
are; the model validates them (the field declarations in ``triton_diffusion.fields``) and its error
names the field. The front checks only what it must before Triton sees a request: the OpenAI parameters
it translates itself, values that cannot be a Triton parameter (lists, objects, integers past 64 bits),
field names the model does not have, and form fields (multipart sends text) converted to the types the
model's MODEL_INFO gives its fields.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from triton_diffusion.errors import RequestError, short_text
from triton_diffusion.fields import Field, FieldSet
from triton_diffusion.openai_front.errors import bad_request, field_error
from triton_diffusion.openai_front.triton_bridge import ModelInfo

INT64_RANGE = (-(2**63), 2**63 - 1)
_SIZE = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")
_INTEGER = re.compile(r"^[+-]?[0-9]{1,20}$")
_BOOLEANS = {
    "true": True,
    "1": True,
    "yes": True,
    "on": True,
    "false": False,
    "0": False,
    "no": False,
    "off": False,
}

# Our fields that Triton's gRPC front reads itself (a request's timeout, in microseconds): a value of
# another type is refused by Triton in its own words, untagged (a 500), so the front checks it first.
READ_BY_TRITON = ("timeout",)
# Fields the front never sends for a client: ``describe`` asks a model for its MODEL_INFO (the front's own
# catalog), not for a result; ``resume_key`` is the front's own (triton_bridge.py): one from a client
# could name another client's checkpointed job, and resume it.
FRONT_ONLY_FIELDS = {
    "describe": "the front asks each model for its catalog itself",
    "resume_key": "the front gives every request its own and resends it after a server restart",
}


# ---- values -------------------------------------------------------------------------------------------
def scalar_value(name: str, value: Any) -> Any:
    """A JSON value that can be a Triton request parameter (string, integer, number, boolean); the model
    checks its type and range. None means absent."""
    if value is None or isinstance(value, (str, bool, float)):
        return value
    if isinstance(value, int):
        if not INT64_RANGE[0] <= value <= INT64_RANGE[1]:
            raise field_error(name, f"got {short_text(value)} (allowed: a 64-bit integer at most)")
        return value
    raise field_error(name, f"must be a single value, got {type(value).__name__} {short_text(value)}")


def form_value(name: str, text: str, field_type: str) -> Any:
    """A multipart form field (always text) as the field's type in MODEL_INFO (integer, number, boolean;
    anything else stays text)."""
    if field_type == "integer":
        if not _INTEGER.match(text.strip()):
            raise field_error(name, f"must be an integer, got {short_text(text)}")
        return scalar_value(name, int(text))
    if field_type == "number":
        try:
            return float(text)
        except ValueError:
            raise field_error(name, f"must be a number, got {short_text(text)}") from None
    if field_type == "boolean":
        if text.strip().lower() not in _BOOLEANS:
            raise field_error(name, f"must be a boolean (true or false), got {short_text(text)}")
        return _BOOLEANS[text.strip().lower()]
    return text


def check_field_names(names: list[str], info: ModelInfo) -> None:
    """Refuse a field the model does not declare with the model's own message (did-you-mean included),
    before the request leaves; the model would say the same."""
    unknown = [name for name in names if name not in info.fields]
    if not unknown:
        return
    declared = FieldSet(Field(name, str) for name in info.fields)
    try:
        declared.parse({unknown[0]: None})
    except RequestError as error:
        raise bad_request(error.message, unknown[0] if len(unknown[0]) <= 64 else None) from None


def model_fields(
    extras: Mapping[str, Any], info: ModelInfo, set_by_front: Mapping[str, str], from_form: bool
) -> dict[str, Any]:
    """Our own fields sent beside the OpenAI parameters (the client's ``extra_body``), as Triton request
    parameters of the right type. OpenAI's ``service_tier`` is the model's field of that name and goes
    as it is; its "auto" means the model's default tier, so nothing is sent."""
    fields: dict[str, Any] = {}
    for name in extras:
        if name in set_by_front:
            raise field_error(name, f"is set by the OpenAI front (send {set_by_front[name]} instead)")
        if name in FRONT_ONLY_FIELDS:
            raise field_error(name, f"is not sent through the OpenAI front ({FRONT_ONLY_FIELDS[name]})")
    extras = {k: v for k, v in extras.items() if not (k == "service_tier" and v == "auto")}
    check_field_names(list(extras), info)
    for name, value in extras.items():
        converted = form_value(name, value, info.field_type(name)) if from_form else scalar_value(name, value)
        if converted is not None and name in READ_BY_TRITON:
            described = info.fields.get(name) or {}
            low, high = described.get("minimum"), described.get("maximum")
            low = 0 if low is None else low  # 0: no timeout, to Triton and to the model
            high = INT64_RANGE[1] if high is None else high
            converted = integer_param(name, converted, low, high, False)
        if converted is not None:
            fields[name] = converted
    return fields


def integer_param(name: str, value: Any, low: int, high: int, from_form: bool) -> int:
    if from_form and isinstance(value, str):
        value = form_value(name, value, "integer")
    if not isinstance(value, int) or isinstance(value, bool):
        raise field_error(name, f"must be an integer, got {type(value).__name__} {short_text(value)}")
    if not low <= value <= high:
        raise field_error(name, f"got {short_text(value)} (allowed: {low}..{high})")
    return value


def boolean_param(name: str, value: Any, from_form: bool) -> bool:
    if from_form and isinstance(value, str):
        value = form_value(name, value, "boolean")
    if not isinstance(value, bool):
        raise field_error(name, f"must be a boolean, got {type(value).__name__} {short_text(value)}")
    return value


def text_param(name: str, value: Any) -> str:
    if value is None:
        raise field_error(name, "is required")
    if not isinstance(value, str):
        raise field_error(name, f"must be a string, got {type(value).__name__} {short_text(value)}")
    return value


def parse_size(value: Any) -> tuple[int, int] | None:
    """OpenAI's ``size``: "WIDTHxHEIGHT" -> (width, height); "auto" or absent -> None (the model's
    default, or for edits the source image's size). The model checks the limits."""
    if value is None or value == "auto":
        return None
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise field_error(
            "size", f"must be 'WIDTHxHEIGHT' (e.g. '512x512') or 'auto', got {short_text(value)}"
        )
    return int(match.group(1)), int(match.group(2))


def agreed_size(parameters: dict[str, Any], size: tuple[int, int] | None) -> str | None:
    """OpenAI's ``size`` into ``width`` and ``height``; where it is absent, those sent as our own fields
    stay (the model checks them); both sent: they must agree. The size as "WxH" when known."""
    if size is None:
        width, height = parameters.get("width"), parameters.get("height")
        return f"{width}x{height}" if isinstance(width, int) and isinstance(height, int) else None
    text = f"{size[0]}x{size[1]}"
    for name, value in zip(("width", "height"), size, strict=True):
        agree(parameters, name, value, f"size {text}")
        parameters[name] = value
    return text


def agree(parameters: Mapping[str, Any], name: str, expected: Any, source: str) -> None:
    """A field sent both as our own and through an OpenAI parameter must say the same."""
    if name in parameters and parameters[name] != expected:
        raise field_error(
            name, f"got {short_text(parameters[name])}, but {source} gives {expected} (send one of them)"
        )


def openai_names(names: Mapping[str, str], sent: set[str]) -> dict[str, str]:
    """The model fields that came from OpenAI parameters the client sent (``sent``), by field."""
    return {field_name: param for field_name, param in names.items() if param in sent}


def model_name(value: Any, default: str) -> str:
    if value is None:
        return default
    if not isinstance(value, str) or not value or len(value) > 128:
        raise field_error("model", f"must be a model name, got {short_text(value)}")
    return value
