"""How a ``config.pbtxt`` parameter's text becomes a value: the parsers settings.py declares its
parameters with (a bad text is a load error naming the parameter: settings.py adds the name)."""

from __future__ import annotations

import json
from typing import Any


def parse_flag(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


# ---- parsers of the values that are not a plain number, flag or word: each raises ValueError saying what
# is expected; the caller names the key.
def parse_names(text: str) -> tuple[str, ...]:
    """``a,b,c`` -> ("a", "b", "c"), blanks dropped."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def parse_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(item) for item in parse_names(text))
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def parse_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """``WIDTHxHEIGHT,...`` -> ((width, height), ...)."""
    sizes = []
    for item in parse_names(text):
        width, x, height = item.lower().partition("x")
        if not (x and width.isdigit() and height.isdigit() and int(width) > 0 and int(height) > 0):
            raise ValueError(f"expected WIDTHxHEIGHT,..., got {item!r}")
        sizes.append((int(width), int(height)))
    return tuple(sizes)


def parse_row_caps(text: str) -> dict[str, int]:
    """``{"WIDTHxHEIGHT": images, "WIDTHxHEIGHTxFRAMES": images}`` -> the same, canonical keys."""
    raw = parse_json_object(text)
    caps: dict[str, int] = {}
    for size, cap in raw.items():
        parts = str(size).lower().split("x")
        if (
            not (2 <= len(parts) <= 3 and all(p.isdigit() for p in parts))
            or not isinstance(cap, int)
            or cap < 1
        ):
            expected = "'WIDTHxHEIGHT' or 'WIDTHxHEIGHTxFRAMES': positive int"
            raise ValueError(f"row cap {size!r}: {cap!r}: expected {expected}")
        caps["x".join(str(int(p)) for p in parts)] = cap
    return caps


def parse_lora_paths(text: str) -> dict[str, str]:
    """``{"name": "path", ...}``: each name 1-64 characters, no comma, colon or space."""
    paths = parse_json_object(text)
    if not all(isinstance(v, str) for v in paths.values()):
        raise ValueError('expected {"name": "path", ...}')
    for name in paths:
        if not name or any(c in name for c in ",: ") or len(name) > 64:
            raise ValueError(f"LoRA name {name!r}: 1-64 characters, no comma, colon or space")
    return paths


def parse_tiers(text: str) -> tuple[str, ...]:
    tiers = parse_names(text)
    if not tiers or len(set(tiers)) != len(tiers) or not all(t.isidentifier() for t in tiers):
        raise ValueError(
            f"expected distinct tier names, highest first (as priority,default,flex), got {text!r}"
        )
    return tiers


def parse_json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    return value


def parse_step_cache_text(text: str) -> Any:
    from triton_diffusion.errors import RequestError
    from triton_diffusion.step_cache_spec import parse_step_cache

    try:
        return parse_step_cache(text, field="step_cache")
    except RequestError as error:  # the request field's own message: a load error here
        raise ValueError(error.message) from None


def parse_degrade_tiers(text: str) -> dict[str, float]:
    """``{"TIER": share}`` with each share in (0, 1]: the least share of its steps a tier's request may run
    with under overload (settings.py checks the names against service_tiers)."""
    raw = parse_json_object(text)
    shares: dict[str, float] = {}
    for tier, share in raw.items():
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"degrade tier {tier!r}: {share!r}: expected a share of the steps in (0, 1]")
        shares[str(tier)] = float(share)
    return shares


def parse_degrade_step_cache(text: str) -> dict[str, str]:
    """``{"TIER": "fbc:0.2"}``: the step cache a tier's request may be given under overload when it sends
    no degrade_step_cache, each in its canonical text (settings.py checks the names against
    service_tiers; the model, the methods against its denoiser's)."""
    from triton_diffusion.errors import RequestError
    from triton_diffusion.step_cache_spec import parse_step_cache

    caches: dict[str, str] = {}
    for tier, cache in parse_json_object(text).items():
        try:
            spec = parse_step_cache(cache, field="degrade_step_cache") if isinstance(cache, str) else None
        except RequestError as error:
            raise ValueError(f"degrade_step_cache tier {tier!r}: {error.message}") from None
        if not spec:
            raise ValueError(
                f"degrade_step_cache tier {tier!r}: {cache!r}: expected a step cache such as fbc:0.2"
            )
        caches[str(tier)] = spec.text
    return caches


def typed_value(spec: Any, text: str, model: str) -> Any:
    """A parameter's text as its declared type (``spec``: its dataclass field), checked against its choices
    and sign; a bad text raises ValueError naming the model and the parameter."""
    kind = str(spec.type)
    try:
        if spec.metadata["parse"] is not None:
            return spec.metadata["parse"](text)
        if "bool" in kind:
            value: Any = parse_flag(text)
        elif "int" in kind:
            value = int(text)
        elif "float" in kind:
            value = float(text)
        else:
            value = text
    except (ValueError, TypeError) as exc:
        raise ValueError(f"model {model}: config parameter {spec.name!r}: {exc}") from None
    choices = spec.metadata["choices"]
    if choices and str(value).lower() not in choices:
        raise ValueError(
            f"model {model}: config parameter {spec.name!r} must be one of {', '.join(choices)}, got {text!r}"
        )
    if choices:
        value = str(value).lower()
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
        raise ValueError(f"model {model}: config parameter {spec.name!r} must be >= 0, got {text!r}")
    return value
