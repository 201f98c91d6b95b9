"""The one way a benchmark's figure is read: the median over rounds with an exact, distribution-free
interval, and a verdict from where that interval lies.

Every benchmark that reads a verdict runs its variants in rotated order (:func:`rotated_orders`: A B, B A,
A B, ... or A B C, B C A, C A B, ...), or, where they run as blocks back to back on one engine
(checkpoint-cost), in balanced orders (:func:`balanced_orders`), so drift of the machine during a run
falls on each variant alike (exactly alike when the rounds are a multiple of the variants), and stores
each round's figure (a ratio of two variants measured in the same round). From those rounds:

- the **median**, and a **90% interval** for it from the sign test (order statistics: the k-th lowest and
  the k-th highest round, k the largest for which the interval covers the median with at least 90%
  probability, whatever the distribution; :func:`median_interval`). With fewer than 5 rounds no such
  interval exists (4 rounds reach 87.5% at most): no verdict is read. From 5 to 7 rounds the interval is
  the lowest to the highest round (a verdict then needs every round on one side); from 8 rounds on it
  leaves out the extremes, so one outlying round no longer decides;
- against a **target** (``">= 1.3"``, ``"<= 1.02"``): *met* when the whole interval lies past it, *missed*
  when the whole interval lies short of it, otherwise *not shown* with the interval;
- against **1** (a ratio of two variants with no target): *gain* or *loss* when the whole interval lies on
  one side of 1 (``higher_is_better`` says which side is a gain; without it, *above 1* or *below 1*),
  otherwise *no gain or loss shown*.

There are no fixed noise bands and no "within noise" reading: a value near its target with rounds on both
sides is *not shown*, never met. Pure Python; nothing here imports torch.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from math import comb
from statistics import median
from typing import TypeVar

LEVEL = 0.90  # the interval's least coverage
MIN_ROUNDS = 5  # the fewest rounds with a 90% sign-test interval

T = TypeVar("T")
_COMPARE = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


def rotated_orders(variants: Sequence[T], rounds: int) -> list[list[T]]:
    """The order of the variants in each round: rotated by one each round (A B, B A, A B, ... for two;
    A B C, B C A, C A B, ... for three), so each variant runs first, and last, equally often."""
    n = len(variants)
    return [[variants[(r + i) % n] for i in range(n)] for r in range(rounds)]


def balanced_orders(variants: Sequence[T], rounds: int) -> list[list[T]]:
    """The order of the variants in each round, each variant following each other equally often within
    the orders and in each place equally often (a Williams design: over each ``n`` rounds for an even
    number ``n`` of variants, each ``2n`` for an odd one, the second ``n`` the first reversed). For rounds
    run back to back (blocks on one engine), where what one leaves behind (a disk's writeback, memory to
    free) falls on the next: within the orders of each whole cycle, that carry-over falls on every variant
    alike, where rotated orders put each variant after the same one nearly always. Not balanced: the joins
    between one order and the next (a variant may follow itself there), and a last, partial cycle."""
    n = len(variants)
    offsets, low, high = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...
    while len(offsets) < n:
        offsets.append(low)
        low += 1
        if len(offsets) < n:
            offsets.append(high)
            high -= 1
    rows = [[(r + offset) % n for offset in offsets] for r in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [[variants[i] for i in rows[r % len(rows)]] for r in range(rounds)]


def median_interval(values: Sequence[float], level: float = LEVEL) -> tuple[float, float, float] | None:
    """The sign test's interval for the median: ``(low, high, coverage)``, the k-th lowest and k-th highest
    values for the largest k whose coverage ``1 - 2 P(Binomial(n, 1/2) < k)`` is at least ``level``; None
    when no k reaches it (fewer than 5 values at 90%)."""
    ordered = sorted(values)
    n = len(ordered)
    best = None
    for k in range(1, n // 2 + 1):
        coverage = 1 - 2 * sum(comb(n, i) for i in range(k)) / 2**n
        if coverage < level:
            break
        best = (ordered[k - 1], ordered[n - k], coverage)
    return best


@dataclass(frozen=True)
class Verdict:
    """A figure over rounds and how it reads. ``word`` is one of met, missed, not shown (against a target)
    or gain, loss, no gain or loss shown (against 1), or "not shown: too few rounds"."""

    median: float
    low: float | None
    high: float | None
    coverage: float | None
    rounds: int
    word: str
    target: str = ""

    @property
    def interval(self) -> str:
        if self.low is None or self.high is None:
            return f"{self.rounds} round{'s' * (self.rounds != 1)}: no 90% interval"
        return f"90% interval {self._shown(self.low, low=True)}-{self._shown(self.high, low=False)}"

    @property
    def shown_median(self) -> str:
        """The median as the bounds are printed: 3 significant digits, more where 3 would read as the
        target's bound (without a target: 1 or 0) though it is not: 1.0152 against "<= 1.02" reads 1.015."""
        return self._shown(self.median, low=None)

    def _shown(self, value: float, low: bool | None) -> str:
        """``value`` to 3 significant digits, or more where 3 would read as the target's bound (without a
        target: 1 or 0) though it is not: 1.0151 against "<= 1.02" reads 1.015, not 1.02; or would put the
        interval's low bound above its median or its high bound below it: 1.007 below a median of 1.009
        reads 1.007, not 1.01."""
        marks = [_parse(self.target)[1]] if self.target and self.target != "-" else [1.0, 0.0]
        text = f"{value:.3g}"
        for digits in range(4, 8):
            misread = value not in marks and float(text) in marks
            crosses = low is not None and (float(text) > self.median if low else float(text) < self.median)
            if not misread and not crosses:
                break
            text = f"{value:.{digits}g}"
        return text

    def __str__(self) -> str:
        return f"{self.word} ({self.interval})"

    @classmethod
    def of(cls, found: dict) -> Verdict:
        """A verdict as :meth:`as_dict` recorded it in an artefact."""
        return cls(
            found["median"],
            found.get("low"),
            found.get("high"),
            found.get("coverage"),
            found["rounds"],
            found["verdict"],
            found.get("target") or "",
        )

    def as_dict(self) -> dict:
        return {
            "median": self.median,
            "low": self.low,
            "high": self.high,
            "coverage": self.coverage,
            "rounds": self.rounds,
            "verdict": self.word,
            "target": self.target,
        }


def verdict(
    values: Sequence[float],
    target: str | None = None,
    higher_is_better: bool | None = True,
    neutral: float = 1.0,
) -> Verdict:
    """How ``values`` (one figure per round) read: against ``target`` (``">= 1.3"``) when given, else
    against 1 (a gain where the interval lies above 1 and ``higher_is_better``; "above 1" or "below 1"
    where ``higher_is_better`` is None: a ratio whose better side the caller does not know). ``neutral``
    is 0 for a difference or an overhead rather than a ratio."""
    if not values:
        raise ValueError("a verdict needs at least one round")
    middle = median(values)
    found = median_interval(values)
    target = (target or "").strip()
    if found is None:
        return Verdict(middle, None, None, None, len(values), "not shown: too few rounds", target)
    low, high, coverage = found
    if target and target != "-":
        sign, bound = _parse(target)
        if _COMPARE[sign](low, bound) and _COMPARE[sign](high, bound):
            word = "met"
        elif not _COMPARE[sign](low, bound) and not _COMPARE[sign](high, bound):
            word = "missed"
        else:
            word = "not shown"
    elif low > neutral or high < neutral:
        above = low > neutral
        if higher_is_better is None:
            word = f"above {neutral:g}" if above else f"below {neutral:g}"
        else:
            word = "gain" if above == higher_is_better else "loss"
    else:
        word = "no gain or loss shown"  # the interval holds the neutral value
    return Verdict(middle, low, high, coverage, len(values), word, target)


def _parse(target: str) -> tuple[str, float]:
    parts = target.split()
    if len(parts) != 2 or parts[0] not in _COMPARE:
        raise ValueError(f"a target reads like '>= 1.3', not {target!r}")
    return parts[0], float(parts[1])
