"""Request fields, declared once.

A :class:`Field` says what a request may send (name, type, default, limits) and how it takes part in
batching (:class:`Role`). Parsing, validation, the compatibility key, the Triton input declarations and
the reference tables (docs/reference/) are all derived from these declarations. Strict by default: a
field is part of the compatibility key unless it is declared per-row or applied after the split.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from triton_diffusion.errors import invalid_field, short_text


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


class Role(str, Enum):
    KEY = "key"  # one value for the whole fused call: requests differing here never share a call
    ROW = "row"  # differs per row inside one fused call (prompt, seed, ...)
    AFTER_SPLIT = "after_split"  # applied to each request's own output after the call (output format)


_TRITON_TYPES = {
    str: "TYPE_STRING",
    bytes: "TYPE_STRING",
    int: "TYPE_INT32",
    float: "TYPE_FP32",
    bool: "TYPE_BOOL",
}
_TYPE_NAMES = {str: "string", bytes: "byte string", int: "integer", float: "number", bool: "boolean"}
_ARTICLE = {str: "a", bytes: "a", int: "an", float: "a", bool: "a"}


@dataclass(frozen=True)
class Field:
    name: str
    type: type
    default: Any = None  # REQUIRED, None (may be absent) or a value
    role: Role = Role.KEY
    minimum: float | None = None
    maximum: float | None = None
    multiple_of: int | None = None
    remainder: int = 0  # with multiple_of: value % multiple_of must equal this (Wan frames: 4k+1)
    choices: tuple[Any, ...] | None = None
    max_length: int | None = None  # characters, for strings
    min_length: int | None = None  # characters, for strings
    pattern: str | None = None  # a regular expression a string must match in full ...
    pattern_text: str = ""  # ... as the allowed range says it in words
    allow_empty: bool = True
    # A ROW field whose mere presence switches the behaviour of a whole pipeline call (Flux true CFG
    # turns on when any row has a negative prompt): requests with and without it never share a call.
    key_on_presence: bool = False
    triton_type: str | None = None
    supported: bool = True  # False when the loaded pipeline cannot honour it
    doc: str = ""

    @property
    def input_name(self) -> str:
        return self.name.upper()

    @property
    def triton_data_type(self) -> str:
        return self.triton_type or _TRITON_TYPES[self.type]

    def configured(self, params: Mapping[str, str]) -> Field:
        """Apply ``default_<name>``, ``min_<name>``, ``max_<name>``, ``<name>_choices``,
        ``<name>_multiple_of`` and ``max_<name>_length`` from the model config's parameters."""
        changes: dict[str, Any] = {}
        if f"default_{self.name}" in params:
            changes["default"] = self._from_text(params[f"default_{self.name}"])
        for attr, param in (("minimum", f"min_{self.name}"), ("maximum", f"max_{self.name}")):
            if param in params:
                changes[attr] = float(params[param]) if self.type is float else int(params[param])
        if f"{self.name}_multiple_of" in params:
            changes["multiple_of"] = int(params[f"{self.name}_multiple_of"])
        if f"max_{self.name}_length" in params:
            changes["max_length"] = int(params[f"max_{self.name}_length"])
        if f"{self.name}_choices" in params:
            items = [c.strip() for c in params[f"{self.name}_choices"].split(",") if c.strip()]
            changes["choices"] = tuple(self._from_text(c) for c in items)
        field = replace(self, **changes)
        if field.default is not None and field.default is not REQUIRED:
            field.validate(field.default)  # a bad default is a config error, found at load time
        return field

    def _from_text(self, text: str) -> Any:
        if self.type is bool:
            return text.strip().lower() in ("1", "true", "yes", "on")
        return self.type(text)

    def describe(self) -> dict[str, Any]:
        """The field as MODEL_INFO tells clients: its type, default, what is allowed, whether it is served."""
        default = None if self.default is REQUIRED else self.default
        if isinstance(default, bytes):
            default = None
        return {
            "type": _TYPE_NAMES[self.type],
            "required": self.default is REQUIRED,
            "default": default,
            "allowed": self.allowed(),
            "minimum": self.minimum,
            "maximum": self.maximum,
            "multiple_of": self.multiple_of,
            "remainder": self.remainder,
            "choices": list(self.choices) if self.choices is not None else None,
            "supported": self.supported,
            "doc": self.doc,
        }

    def allowed(self) -> str:
        """The allowed range in words, used in error messages and in the docs."""
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        parts = []
        if self.minimum is not None and self.maximum is not None:
            parts.append(f"{_num(self.minimum)}..{_num(self.maximum)}")
        elif self.minimum is not None:
            parts.append(f">= {_num(self.minimum)}")
        elif self.maximum is not None:
            parts.append(f"<= {_num(self.maximum)}")
        if self.multiple_of and self.remainder:
            parts.append(f"{self.multiple_of}k+{self.remainder}")
        elif self.multiple_of:
            parts.append(f"multiple of {self.multiple_of}")
        if self.type in (str, bytes):
            if not self.allow_empty:
                parts.append("non-empty")
            if self.pattern is not None:
                parts.append(self.pattern_text or f"matching {self.pattern}")
            if self.min_length is not None:
                parts.append(f"at least {self.min_length} characters")
            if self.max_length is not None:
                parts.append(f"at most {self.max_length} {'characters' if self.type is str else 'bytes'}")
        return ", ".join(parts) or "any " + _TYPE_NAMES[self.type]

    def validate(self, value: Any) -> Any:
        """Return the value in its canonical Python type, or raise an INVALID_ARG RequestError."""
        if not self.supported:
            raise invalid_field(self.name, "is not supported by this model's pipeline")
        value = self._check_type(value)
        if self.type is str:
            nul = value.find("\0")
            if nul >= 0:  # before any length check: C code (Triton's among it) ends a text at its NUL
                raise invalid_field(
                    self.name,
                    f"contains a NUL character at position {nul} (allowed: no NUL, {self.allowed()})",
                )
            if not self.allow_empty and not value.strip():
                raise invalid_field(self.name, f"must not be empty (allowed: {self.allowed()})")
            if self.max_length is not None and len(value) > self.max_length:
                raise invalid_field(self.name, f"is {len(value)} characters long (allowed: {self.allowed()})")
            if self.min_length is not None and len(value) < self.min_length:
                raise invalid_field(self.name, f"is {len(value)} characters long (allowed: {self.allowed()})")
            if self.pattern is not None and re.fullmatch(self.pattern, value) is None:
                raise invalid_field(self.name, f"got {short_text(value)} (allowed: {self.allowed()})")
        if self.type is float and not math.isfinite(value):
            raise invalid_field(
                self.name, f"must be a finite number, got {value} (allowed: {self.allowed()})"
            )
        if self.choices is not None and value not in self.choices:
            raise invalid_field(self.name, f"got {short_text(value)} (allowed: {self.allowed()})")
        out_of_range = (self.minimum is not None and value < self.minimum) or (
            self.maximum is not None and value > self.maximum
        )
        not_multiple = bool(self.multiple_of) and value % self.multiple_of != self.remainder
        if out_of_range or not_multiple:
            raise invalid_field(self.name, f"got {short_text(value)} (allowed: {self.allowed()})")
        return value

    def _check_type(self, value: Any) -> Any:
        ok = {
            str: isinstance(value, str),
            bytes: isinstance(value, bytes),
            bool: isinstance(value, bool),
            int: isinstance(value, int) and not isinstance(value, bool),
            float: isinstance(value, (int, float)) and not isinstance(value, bool),
        }[self.type]
        if not ok:
            raise invalid_field(
                self.name,
                f"must be {_ARTICLE[self.type]} {_TYPE_NAMES[self.type]}, "
                f"got {type(value).__name__} {short_text(value)} (allowed: {self.allowed()})",
            )
        return float(value) if self.type is float else value


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 2**63 else str(x)


def seed_field(doc: str) -> Field:
    """The ``seed`` field every model has: per row, INT64, drawn by the server when absent."""
    return Field("seed", int, None, Role.ROW, minimum=0, maximum=2**63 - 1, triton_type="TYPE_INT64", doc=doc)


# An image-conditioned request, declared once: optional on text_to_image (a text-only request and an
# image-conditioned one share the step engine's forwards), ``image`` required on image_to_image. The
# decoded size of both images is limited by the model config (``max_image_pixels``), the output size by
# height and width.
SOURCE_IMAGE_FIELDS = (
    Field(
        "image",
        bytes,
        None,
        Role.ROW,
        max_length=20_000_000,
        doc="the source image: an encoded PNG, JPEG or WebP (base64 text is accepted too)",
    ),
    Field(
        "strength",
        float,
        None,
        minimum=0.0,
        maximum=1.0,
        doc="how much of the source is re-noised: 0 keeps it, 1 ignores it",
    ),
    Field(
        "mask_image",
        bytes,
        None,
        Role.ROW,
        max_length=20_000_000,
        doc="with image: inpaint where this mask is white, keep the source where it is black",
    ),
)


# A request that asks the model what it serves instead of generating: answered at once with MODEL_INFO (its
# kind, every field with its default and what is allowed, its tiers and step caches), so a client (the
# OpenAI front) is told, never guesses. Triton needs the required input (PROMPT) in it; its value is unused.
DESCRIBE_FIELD = Field(
    "describe",
    bool,
    False,
    Role.AFTER_SPLIT,
    doc="answer at once with MODEL_INFO (JSON: the model's kind, fields, defaults, limits, tiers, step "
    "caches) instead of generating",
)

# A crash loses no work (recovery/resumes.py): a client names its request with a key of its own, and a
# resend after the model restarted resumes from the last checkpoint of that request instead of starting
# over. Not in the compatibility key, nor in the result cache's (it decides no pixel); where the request
# gives no seed, its seed is derived from the key, so a resend draws the same noise.
RESUME_FIELD = Field(
    "resume_key",
    str,
    None,
    Role.ROW,
    min_length=16,
    max_length=128,
    pattern=r"[A-Za-z0-9_-]+",
    pattern_text="letters, digits, _ and -",
    doc="a key the client makes up (16-128 letters, digits, _ or -, e.g. a UUID), the same on "
    "a resend: where the model writes checkpoints (checkpoint_every_steps) a resend after a crash resumes "
    "from the request's last one (BATCH resumed_from_step); without a seed, the seed is derived from the "
    "key; a model without checkpoints ignores it",
)

# How urgent a request is, read by the step engine's scheduler (engine/ordering.py): its service tier and
# its deadline. Not in the compatibility key: they decide order, never what is computed.
SERVICE_FIELDS = (
    Field(
        "service_tier",
        str,
        None,
        Role.ROW,
        max_length=64,
        doc="the request's service tier, one of the model's service_tiers (default: priority, default, flex; "
        "highest first); not Triton's request priority, which never reaches a Python model",
    ),
    Field(
        "timeout",
        int,
        None,
        Role.ROW,
        minimum=1,
        maximum=86_400_000_000,
        triton_type="TYPE_INT64",
        doc="the request's deadline in microseconds from its arrival, as Triton's request timeout "
        "(tritonclient's timeout=, which over gRPC arrives as that and over HTTP as this parameter)",
    ),
)


def merge_parameters(
    tensors: Mapping[str, Any], parameters: Mapping[str, Any], fields: FieldSet
) -> dict[str, Any]:
    """What a request sent: the fields read from its input tensors, with its request parameters added by
    lower-case name (a field's tensor is its name in upper case; a parameter's name counts without case).
    A field sent twice is refused, naming both: as a tensor and as a parameter, or as two parameters whose
    names differ only by case (``height`` and ``HEIGHT``). A bytes field sent as a (base64) string
    parameter becomes its UTF-8 bytes."""
    merged = dict(tensors)
    sent_as: dict[str, str] = {}
    for name, value in parameters.items():
        canonical = name.lower()
        shown = canonical if len(canonical) <= 64 and canonical.isprintable() else short_text(canonical)
        if canonical in sent_as:
            both = f"{short_text(sent_as[canonical], 64)} and {short_text(name, 64)}"
            raise invalid_field(
                shown, f"sent twice, as request parameters whose names differ only by case: {both}"
            )
        if canonical in tensors:
            raise invalid_field(shown, "sent both as an input tensor and as a request parameter")
        sent_as[canonical] = name
        if canonical in fields and fields[canonical].type is bytes and isinstance(value, str):
            value = value.encode("utf-8")
        merged[canonical] = value
    return merged


class FieldSet:
    """The fields one model accepts, in declaration order."""

    def __init__(self, fields: Iterable[Field]) -> None:
        self._fields = {f.name: f for f in fields}

    def __iter__(self) -> Iterator[Field]:
        return iter(self._fields.values())

    def __getitem__(self, name: str) -> Field:
        return self._fields[name]

    def __contains__(self, name: object) -> bool:
        return name in self._fields

    def configured(self, params: Mapping[str, str], unsupported: Iterable[str] = ()) -> FieldSet:
        """Defaults and limits from the model config; ``unsupported`` fields are refused when sent."""
        unsupported = set(unsupported)
        fields = [f.configured(params) for f in self]
        return FieldSet(replace(f, supported=False) if f.name in unsupported else f for f in fields)

    def parse(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        """Validate what a request sent and fill in defaults. Raises RequestError(INVALID_ARG)."""
        for name in raw:
            if name not in self._fields:
                hint = self.closest_name(name) if len(name) <= 64 else None
                suggestion = f"; did you mean {hint!r}?" if hint else ""
                shown = name if len(name) <= 64 and name.isprintable() else short_text(name)
                raise invalid_field(shown, f"unknown field{suggestion} (known: {', '.join(self._fields)})")
        values: dict[str, Any] = {}
        for field in self:
            if raw.get(field.name) is not None:
                values[field.name] = field.validate(raw[field.name])
            elif field.default is REQUIRED:
                raise invalid_field(
                    field.name,
                    f"is required: send input {field.input_name} or parameter {field.name} "
                    f"(allowed: {field.allowed()})",
                )
            else:
                values[field.name] = field.default
        return values

    def closest_name(self, name: str) -> str | None:
        """The declared name a misspelt one most likely meant: close as a whole ("heigth"), or close to
        one of its parts ("steps" -> "num_inference_steps")."""
        whole = difflib.get_close_matches(name.lower(), list(self._fields), n=1)
        if whole:
            return whole[0]
        parts: dict[str, str] = {}
        for f in self:  # a part two names share suggests the first declared (steps: num_inference_steps)
            for part in f.name.split("_"):
                if len(part) > 3:
                    parts.setdefault(part, f.name)
        # A part that only begins another ("step" of step_cache, "steps") would outscore it for a plural.
        distinct = [p for p in parts if not any(q != p and q.startswith(p) for q in parts)]
        close = difflib.get_close_matches(name.lower(), distinct, n=1, cutoff=0.75)
        return parts[close[0]] if close else None

    def markdown_table(self) -> str:
        """The request-field reference (docs/reference/fields.md), straight from the declarations."""
        lines = [
            "| field (parameter / input tensor) | type | default | allowed | batching role | meaning |",
            "|---|---|---|---|---|---|",
        ]
        for f in self:
            if f.default is REQUIRED:
                default = "required"
            elif f.default is None:
                # KEY fields always get a value at load time: from config.pbtxt or the pipeline itself.
                default = "from config / pipeline" if f.role is Role.KEY else "none"
            else:
                default = repr(f.default)
            role = f.role.value + (" (presence is in the key)" if f.key_on_presence else "")
            lines.append(
                f"| `{f.name}` / `{f.input_name}` | {f.triton_data_type} | {default} "
                f"| {f.allowed()} | {role} | {f.doc} |"
            )
        return "\n".join(lines)
