"""The one verdict rule (scripts/verdicts.py): the median over rounds with the sign test's 90% interval;
met, missed or not shown against a target, gain, loss or neither against 1; no verdict from fewer than 5
rounds. The cases the old readings got wrong are here by name."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from verdicts import balanced_orders, median_interval, rotated_orders, verdict  # noqa: E402


def test_the_flux_mixed_sizes_rounds_never_read_as_met_or_within_noise():
    # Three rounds, two short of the 1.3 target: the old min-max rule read "within noise of the target".
    three = verdict([1.18, 1.52, 1.01], ">= 1.3")
    assert three.word.startswith("not shown") and three.low is None
    # With five rounds whose interval holds the target: not shown, never met.
    five = verdict([1.18, 1.52, 1.01, 1.35, 1.22], ">= 1.3")
    assert five.word == "not shown" and (five.low, five.high) == (1.01, 1.52)
    # Every round short of it: missed.
    assert verdict([1.18, 1.21, 1.01, 1.25, 1.22], ">= 1.3").word == "missed"


def test_a_consistent_14_percent_regression_reads_as_a_loss():
    # The old boundary rule ORed in a fixed ±15% band and read this as "within noise".
    rounds = [0.86, 0.85, 0.87, 0.86, 0.84]
    assert verdict(rounds).word == "loss"
    assert verdict([1 / r for r in rounds], higher_is_better=False).word == "loss"
    assert verdict([1 / r for r in rounds]).word == "gain"


def test_an_interval_that_holds_one_is_neither_gain_nor_loss():
    assert verdict([0.9, 1.1, 1.02, 0.97, 1.05]).word == "no gain or loss shown"


def test_met_only_when_the_whole_interval_is_past_the_target():
    assert verdict([1.001, 1.01, 1.015, 1.0, 1.012], "<= 1.02").word == "met"
    assert verdict([1.001, 1.01, 1.025, 1.0, 1.012], "<= 1.02").word == "not shown"
    assert verdict([1.21, 1.19, 1.25, 1.30, 1.06], "<= 1.02").word == "missed"


def test_from_eight_rounds_one_outlying_round_no_longer_decides():
    # Five to seven rounds: the interval is the lowest to the highest round.
    assert median_interval([0.5, 1.1, 1.12, 1.13, 2.0])[:2] == (0.5, 2.0)
    assert verdict([0.5, 1.1, 1.12, 1.13, 2.0], ">= 1.05").word == "not shown"
    # Ten rounds: the 2nd lowest to the 2nd highest (97.9%): the outliers 0.5 and 2.0 are left out.
    rounds = [0.5, 1.1, 1.12, 1.13, 1.15, 1.16, 1.18, 1.2, 1.22, 2.0]
    low, high, coverage = median_interval(rounds)
    assert (low, high) == (1.1, 1.22) and coverage > 0.9
    assert verdict(rounds, ">= 1.05").word == "met"


@pytest.mark.parametrize("n", range(1, 5))
def test_fewer_than_five_rounds_give_no_interval(n):
    assert median_interval([1.0 + i for i in range(n)]) is None


def test_the_interval_coverage_is_the_exact_binomial_one():
    low, high, coverage = median_interval([5, 1, 4, 2, 3])
    assert (low, high) == (1, 5) and coverage == pytest.approx(1 - 2 / 32)


def test_rotated_orders_put_each_variant_first_equally_often():
    assert rotated_orders(["A", "B"], 4) == [["A", "B"], ["B", "A"], ["A", "B"], ["B", "A"]]
    three = rotated_orders(["A", "B", "C"], 3)
    assert [order[0] for order in three] == ["A", "B", "C"]
    assert sorted(map(tuple, three)) == sorted({tuple(o) for o in three})


def test_an_interval_bound_never_reads_past_the_median_it_holds():
    """A bound that 3 significant digits would put on the median's other side gets more digits (15 rounds,
    median 1.009, low bound 1.007, which 3 digits print as 1.01); and the median, printed as the bounds
    are, never reads as the target's bound though it is not."""
    ratios = [0.969, 0.982, 1.005, 1.007, 1.007, 1.007, 1.009, 1.009, 1.017, 1.02, 1.022, 1.03, 1.031, 1.042]
    found = verdict([*ratios, 1.058], "<= 1.02")
    assert (found.median, found.low) == (1.009, 1.007)
    assert "90% interval 1.007-1.03" in str(found)  # not 1.01-1.03 beside a median of 1.009
    near = [0.99, 0.995, 1.0, 1.005, 1.008, 1.009, 1.01, 1.0112, 1.0113, 1.0113, 1.0113, 1.0114, 1.02, 1.03]
    high = verdict([*near, 1.04], "<= 1.02")  # a high bound of 1.0114 above a median of 1.0112
    assert (high.median, high.high) == (1.0112, 1.0114)
    assert "90% interval 1-1.0114)" in str(high)  # not 1-1.01, nor 1-1.011
    assert verdict([1.0152] * 5, "<= 1.02").shown_median == "1.015"  # not 1.02
    assert verdict([1.0152] * 5, "<= 1.05").shown_median == "1.02"


def carry_over(orders: list[list[str]]) -> tuple[Counter, Counter]:
    """How often each variant follows each other within a round, and runs in each place."""
    follows = Counter((a, b) for order in orders for a, b in zip(order, order[1:], strict=False))
    places = Counter((i, v) for order in orders for i, v in enumerate(order))
    return follows, places


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_balanced_orders_put_each_variant_after_each_other_and_in_each_place_equally_often(n):
    variants = [chr(ord("A") + i) for i in range(n)]
    cycle = n if n % 2 == 0 else 2 * n
    orders = balanced_orders(variants, cycle)
    follows, places = carry_over(orders)
    assert set(follows) == {(a, b) for a in variants for b in variants if a != b}
    assert len(set(follows.values())) == 1 and len(set(places.values())) == 1
    assert all(sorted(order) == variants for order in orders)
    assert balanced_orders(variants, 2 * cycle) == orders + orders  # then over again
    if n > 2:  # what they mend: rotated orders put each variant after the same one nearly always
        assert len(carry_over(rotated_orders(variants, cycle))[0]) < n * (n - 1)


def test_an_interval_bound_near_the_target_never_reads_as_the_target():
    """3 significant digits, more where 3 would print the target's bound (or 1, or 0, without a target)
    for a value that is not it: the reader checks the verdict against the printed interval."""
    ratios = [1.0245, 1.0151, 1.0415, 1.03, 1.01, 1.05, 1.02, 1.026, 1.04, 1.0, 1.06, 1.022, 1.035, 1.012]
    ratios.append(1.03)
    found = verdict(ratios, "<= 1.02")
    assert found.word == "not shown" and found.interval == "90% interval 1.015-1.04"
    assert verdict([0.9996, 1.0004, 1.0, 0.9998, 1.0002], None).interval == "90% interval 0.9996-1.0004"
    assert verdict([1.0, 1.1, 1.2, 1.15, 1.05], ">= 1.0").interval == "90% interval 1-1.2"  # it is 1
