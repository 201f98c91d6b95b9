"""The compatibility key: requests share a fused pipeline call only when their keys are equal."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from triton_diffusion.fields import FieldSet, Role


@dataclass(frozen=True)
class CompatibilityKey:
    """Every KEY field's value, plus the presence of each ``key_on_presence`` field, in declaration order."""

    items: tuple[tuple[str, Any], ...]

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.items).get(name, default)

    def first_difference(self, other: CompatibilityKey) -> str | None:
        """Name of the first field whose value differs, the way SGLang names its reject reason."""
        theirs = dict(other.items)
        for name, value in self.items:
            if theirs.get(name) != value:
                return name
        return None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.items)

    def __str__(self) -> str:
        return ",".join(f"{name}={value}" for name, value in self.items)


def presence_name(field_name: str) -> str:
    return f"has_{field_name}"


def compatibility_key(fields: FieldSet, values: Mapping[str, Any]) -> CompatibilityKey:
    items: list[tuple[str, Any]] = []
    for field in fields:
        if not field.supported:
            continue  # always its default: naming it would only make the key noisier
        if field.role is Role.KEY:
            items.append((field.name, values[field.name]))
        elif field.key_on_presence:
            items.append((presence_name(field.name), values[field.name] is not None))
    return CompatibilityKey(tuple(items))
