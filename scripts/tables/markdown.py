"""Markdown for the figure blocks: tables, numbers and how a ratio reads against its target (through
scripts/verdicts.py). Pure functions of plain values; nothing here imports torch."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

from verdicts import verdict

_COMPARE = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def number(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "missed"
    return f"{value:.{digits}g}"


def percent(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}%"


def target_met(value: float, target: str) -> bool | None:
    """Whether ``value`` meets a target such as ``'>= 0.95'``; None for no target (``'-'``)."""
    parts = target.split()
    if len(parts) != 2 or parts[0] not in _COMPARE:
        return None
    return _COMPARE[parts[0]](value, float(parts[1]))


def reading(value: float, target: str, rounds: Sequence[float] | None = None) -> str:
    """How a figure reads (scripts/verdicts.py, the one rule): from its rounds, the median's 90% interval
    against the target, or against 1 for a ratio with no target; a figure without its rounds (one run, or
    an artefact that kept only a summary) has no verdict."""
    if not rounds:
        return "one run: no verdict" if target_met(value, target) is not None else "-"
    return str(verdict(rounds, target if target_met(value, target) is not None else None, None))


def ratio_rows(
    ratios: dict[str, Sequence[Any]], rounds: dict[str, Sequence[float]] | None = None
) -> list[list[str]]:
    rounds = rounds or {}
    return [
        [label, f"**{number(value)}**", target, reading(value, target, rounds.get(label))]
        for label, (value, target) in ratios.items()
    ]
