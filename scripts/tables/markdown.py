"""Markdown for the figure blocks: tables, numbers and how a ratio reads against its target and the
machine's noise. Pure functions of plain values; nothing here imports torch."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

# Run to run, one benchmark on this project's 2-core CPU host moves by about ±15% (measured: the same code
# twice, minutes apart). A single run's ratio of two variants inside that band says nothing either way.
SINGLE_RUN_NOISE = 0.15

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


def reading(
    label: str,
    value: float,
    target: str,
    noise: float = SINGLE_RUN_NOISE,
    spread: Sequence[float] | None = None,
) -> str:
    """How a ratio reads: met or missed against its target (within noise of the target where its rounds'
    spread holds the target: neither), and "within noise" when it compares two variants and 1 lies within
    its rounds' spread (``spread``: the lowest and highest round), or, for a single run, within ``noise``
    of it: never a gain or a loss then."""
    met = target_met(value, target)
    words = [] if met is None else ["met" if met else "missed"]
    if spread is not None:
        low, high = spread
        parts = target.split()
        if met is not None and low <= float(parts[1]) <= high:
            words = ["within noise of the target"]  # its rounds fall on both sides: neither met nor missed
        words.append(f"rounds {low:.2f}-{high:.2f}")
        if low <= 1.0 <= high:
            words.append("within noise of 1")
    elif " / " in label and abs(value - 1.0) <= noise:
        words.append(f"within noise of 1 (±{noise:.0%})")
    return ", ".join(words) or "-"


def ratio_rows(
    ratios: dict[str, Sequence[Any]],
    noise: float = SINGLE_RUN_NOISE,
    spreads: dict[str, Sequence[float]] | None = None,
) -> list[list[str]]:
    spreads = spreads or {}
    return [
        [label, f"**{number(value)}**", target, reading(label, value, target, noise, spreads.get(label))]
        for label, (value, target) in ratios.items()
    ]
