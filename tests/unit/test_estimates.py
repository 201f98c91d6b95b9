"""The step engine's cost model (engine/estimates.py): a forward priced by its tokens, a line fitted to
what was measured, and a job's time to finish from its tokens and the token-steps ahead of it."""

from __future__ import annotations

import math

import pytest

from triton_diffusion.engine.estimates import MAX_SIZES, PROBE_AFTER, WorkTimes


def times_of(*forwards: tuple[int, float]) -> WorkTimes:
    """Measured forwards of (tokens, seconds), each of one job (the job count is not what is priced)."""
    times = WorkTimes()
    for tokens, seconds in forwards:
        times.forward_ran(1, tokens, seconds)
    return times


def test_nothing_measured_prices_nothing():
    times = WorkTimes()
    assert not times.measured and times.forward_s(1000) == 0.0
    assert times.finish_in(100, 10, 5000, 1000, False) == 0.0


def test_a_line_fitted_to_the_measurements_predicts_between_and_beyond_them():
    times = times_of((100, 1.1), (200, 1.2), (400, 1.4))  # 1 s fixed, 1 ms a token
    assert times.measured
    assert times.forward_s(300) == pytest.approx(1.3)  # between
    assert times.forward_s(800) == pytest.approx(1.8)  # beyond
    assert times.forward_s(10) == pytest.approx(1.01)  # below: the fixed part stays


def test_one_token_count_measured_scales_proportionally_above_it():
    times = times_of((100, 2.0))
    assert times.forward_s(300) == pytest.approx(6.0)
    assert times.forward_s(50) == pytest.approx(2.0)  # below: no slope known, the same


def test_the_fit_is_never_negative_nor_falling():
    falling = times_of((100, 2.0), (200, 1.0))  # noise: no evidence a forward costs less with more
    assert falling.forward_s(1000) == pytest.approx(1.5) and falling.forward_s(1) == pytest.approx(1.5)
    steep = times_of((100, 0.1), (200, 1.1))  # the line crosses 0 at 90 tokens: through the origin instead
    assert 0 < steep.forward_s(10) < steep.forward_s(100) < steep.forward_s(200)
    assert steep.forward_s(1) >= 0 and steep.forward_s(10) == pytest.approx(10 * steep.forward_s(1))


def test_forwards_of_the_same_jobs_are_priced_by_their_tokens():
    # Two jobs a forward either way; the larger sizes cost what their tokens do (a per-jobs table would
    # price both the same).
    times = WorkTimes()
    times.forward_ran(2, 100, 1.0)
    times.forward_ran(2, 1000, 10.0)
    assert times.forward_s(100) == pytest.approx(1.0) and times.forward_s(1000) == pytest.approx(10.0)
    assert times.forward_s(550) == pytest.approx(5.5)


def test_measurements_are_running_averages_over_a_bounded_table():
    times = times_of((100, 1.0), (100, 2.0))
    assert times.forward_s(100) == pytest.approx(1.2)  # smoothed, not replaced
    for tokens in range(1, 2 * MAX_SIZES):
        times.forward_ran(1, tokens, float(tokens))
    assert len(times.by_tokens) == MAX_SIZES and 1 not in times.by_tokens  # the least recent dropped


def test_a_jobs_finish_is_priced_by_its_tokens_and_the_token_steps_ahead():
    times = times_of((100, 1.0), (1000, 10.0))  # 10 ms a token
    # Alone: 10 forwards of its own 100 tokens.
    assert times.finish_in(100, 10, 0, 1000, started=True) == pytest.approx(10 * 1.0)
    # 9000 token-steps ahead share its 10 forwards: each full (1000 tokens).
    assert times.finish_in(100, 10, 9000, 1000, started=True) == pytest.approx(10 * 10.0)
    # 19000 ahead: 20 full forwards before it is done.
    assert times.finish_in(100, 10, 19000, 1000, started=True) == pytest.approx(20 * 10.0)
    # A job over the budget runs alone: its own steps, each a forward of its size.
    assert times.finish_in(2000, 5, 0, 1000, started=True) == pytest.approx(5 * 20.0)
    # Jobs after it that share its forwards make each larger (600 tokens), within the budget (1000).
    assert times.finish_in(100, 10, 0, 1000, True, alongside_tokens=500) == pytest.approx(10 * 6.0)
    assert times.finish_in(100, 10, 0, 1000, True, alongside_tokens=5000) == pytest.approx(10 * 10.0)
    # Start and decode, per job, unless it started.
    times.started(2, 1.0)
    times.finished(1, 0.25)
    assert times.finish_in(100, 1, 0, 1000, started=False) == pytest.approx(1.0 + 0.5 + 0.25)
    assert times.finish_in(100, 1, 0, 1000, started=True) == pytest.approx(1.0 + 0.25)


def test_a_forward_is_priced_by_its_rows_and_tokens_once_three_pairs_not_on_a_line_are_measured():
    times = WorkTimes()
    plane = lambda rows, tokens: 0.002 + 0.0001 * tokens + 0.003 * rows  # noqa: E731
    times.forward_ran(1, 100, plane(1, 100), rows=1)
    times.forward_ran(2, 200, plane(2, 200), rows=2)
    assert times.forward_cost(3, 300) is None  # two pairs: no plane yet
    times.forward_ran(3, 300, plane(3, 300), rows=3)
    assert (
        times.forward_cost(4, 400) is None
    )  # three on one line (tokens = 100 x rows): rows and tokens unmixed
    times.forward_ran(2, 800, plane(2, 800), rows=2)  # more tokens for the same rows (a larger size)
    assert times.forward_cost(4, 1000) == pytest.approx(plane(4, 1000))
    assert times.forward_cost(1, 50) == pytest.approx(plane(1, 50))
    times.forward_ran(1, 100, 1.0)  # without rows: the token line only
    assert times.forward_cost(4, 1000) == pytest.approx(plane(4, 1000))


def test_a_calibration_keeps_the_plane_determined_whatever_the_traffic_measures():
    times = WorkTimes()
    plane = lambda rows, tokens: 0.002 + 0.0001 * tokens + 0.003 * rows  # noqa: E731
    for rows, tokens in ((1, 16), (4, 64), (1, 64), (4, 256)):
        times.calibrated(rows, tokens, plane(rows, tokens))
    for rows in range(1, MAX_SIZES + 10):  # traffic of one size: 64 tokens a row, on one line
        times.forward_ran(rows, 64 * rows, plane(rows, 64 * rows), rows=rows)
    assert (1, 16) in times.calibration and (1, 16) not in times.by_rows_tokens
    assert times.forward_cost(8, 8 * 16) == pytest.approx(plane(8, 8 * 16))


def test_the_cost_model_described_is_the_fits_the_engine_prices_by_in_milliseconds():
    times = WorkTimes()
    empty = times.describe()
    assert empty["forward_by_tokens"] is None and empty["forward_by_tokens_and_rows"] is None
    assert empty["token_counts_measured"] == 0 and empty["start_ms"] is None
    # Exact points of s = 0.01 + 2e-5 x tokens + 0.003 x rows: both fits recover it.
    for rows, tokens in ((1, 100), (2, 100), (2, 300), (4, 500)):
        times.by_rows_tokens[rows, tokens] = 0.01 + 2e-5 * tokens + 0.003 * rows
    for tokens in (100, 300):
        times.by_tokens[tokens] = 0.01 + 2e-5 * tokens
    times.started(2, 0.004)
    described = times.describe()
    assert described["forward_by_tokens"] == pytest.approx({"fixed_ms": 10.0, "per_1k_tokens_ms": 20.0})
    assert described["forward_by_tokens_and_rows"] == pytest.approx(
        {"fixed_ms": 10.0, "per_1k_tokens_ms": 20.0, "per_row_ms": 3.0}
    )
    assert described["start_ms"] == pytest.approx(2.0) and described["decode_ms"] is None
    assert (described["token_counts_measured"], described["pairs_measured"]) == (2, 4)
    assert times.forward_s(200) == pytest.approx(described["forward_by_tokens"]["fixed_ms"] / 1e3 + 0.004)


def test_the_cost_model_described_rests_on_a_calibration_alone_before_any_traffic():
    times = WorkTimes()
    for rows, tokens in ((1, 100), (2, 100), (2, 300)):
        times.calibrated(rows, tokens, 0.01 + 2e-5 * tokens + 0.003 * rows)
    described = times.describe()
    assert (described["pairs_calibrated"], described["pairs_measured"]) == (3, 0)
    assert described["forward_by_tokens_and_rows"] == pytest.approx(
        {"fixed_ms": 10.0, "per_1k_tokens_ms": 20.0, "per_row_ms": 3.0}
    )
    assert described["forward_by_tokens"] is None  # deadlines wait for the traffic's own forwards


def test_a_probe_comes_after_probe_after_idle_refusals_drops_the_estimate_and_a_forward_counts_again():
    times = WorkTimes()
    for tokens in (1, 8):
        times.forward_ran(tokens, tokens, 1.0)
    times.started(1, 0.5)
    times.finished(1, 0.5)
    assert [times.probe() for _ in range(PROBE_AFTER)] == [False] * PROBE_AFTER
    assert times.measured and times.forward_s(1) == 1.0  # kept until the probe
    assert times.probe()
    assert not times.measured and times.forward_s(1) == 0.0 and times.fixed_s == 0.0  # learned again
    times.forward_ran(1, 1, 0.1)
    assert times.forward_s(1) == 0.1
    assert [times.probe() for _ in range(PROBE_AFTER)] == [False] * PROBE_AFTER  # counted afresh
    times.forward_ran(1, 1, 0.1)  # a forward measured starts the count again
    assert [times.probe() for _ in range(PROBE_AFTER + 1)] == [False] * PROBE_AFTER + [True]


def test_a_packed_forward_is_priced_by_what_packed_forwards_measured_over_the_plane_and_never_bends_it():
    times = WorkTimes()
    plane = lambda rows, tokens: 0.002 + 0.0001 * tokens + 0.003 * rows  # noqa: E731
    for rows, tokens in ((1, 16), (4, 64), (1, 64)):
        times.forward_ran(rows, tokens, plane(rows, tokens), rows=rows)
    assert times.forward_cost(8, 512, packed=True) == pytest.approx(plane(8, 512))  # none measured: as one
    # A new grid's first packed forward is its warm-up: left out.
    times.forward_ran(8, 512, 10 * plane(8, 512), rows=8, packed=True)
    assert times.packed_factor is None
    # Then packed forwards measured at 1.5x and 2.5x the plane's price (their masked attention is slower).
    times.forward_ran(8, 512, 1.5 * plane(8, 512), rows=8, packed=True)
    times.forward_ran(8, 384, 9.0, rows=8, packed=True)  # (8, 384)'s warm-up
    times.forward_ran(8, 384, 2.5 * plane(8, 384), rows=8, packed=True)
    assert (8, 512) not in times.by_rows_tokens and (8, 384) not in times.by_rows_tokens
    assert times.packed_factor == pytest.approx((1.5 + 2.5) / 2)  # each pair over the plane, their mean
    assert times.forward_cost(16, 768) == pytest.approx(plane(16, 768))  # by size: the plane alone
    assert times.forward_cost(16, 768, packed=True) == pytest.approx(2.0 * plane(16, 768))
    assert times.describe()["packed_over_plane"] == pytest.approx(2.0)
    assert {512, 384} <= times.by_tokens.keys()  # the line that deadlines price by counts every forward
    # Against the plane as it is now: measured at twice the old plane, the plane now twice as dear.
    for rows, tokens in ((1, 16), (4, 64), (1, 64)):
        times.by_rows_tokens[rows, tokens] = 2 * plane(rows, tokens)
    assert times.packed_factor == pytest.approx(1.0)


def test_forwards_of_one_size_since_the_last_packed_one_are_counted():
    times = WorkTimes()
    times.forward_ran(2, 64, 0.01, rows=2)
    times.forward_ran(2, 64, 0.01, rows=2)
    assert times.since_packed == 2
    times.forward_ran(4, 256, 0.02, rows=4, packed=True)
    assert times.since_packed == 0
    times.forward_ran(2, 64, 0.01)  # without rows (the request-level engine's): not a forward of the fit
    assert times.since_packed == 0


def test_the_host_publishes_the_packed_factor_beside_the_forward_cost():
    """The cost model's metrics (serving/engine_host.py): the plane's parts in seconds, and what packed
    forwards took over it as its own gauge once one was measured (none before); NaN once unknown again."""
    from triton_diffusion.serving.engine_host import EngineHost

    published: dict[tuple, float] = {}

    class Metrics:
        def set(self, name: str, value: float, **labels: str) -> None:
            published[(name, *sorted(labels.items()))] = value

    host = object.__new__(EngineHost)  # _record_cost reads nothing but its metrics and what it set
    host.metrics, host._cost_parts, host._ratio_set = Metrics(), set(), False
    times = WorkTimes()
    plane = lambda rows, tokens: 0.002 + 0.0001 * tokens + 0.003 * rows  # noqa: E731
    for rows, tokens in ((1, 16), (4, 64), (1, 64)):
        times.forward_ran(rows, tokens, plane(rows, tokens), rows=rows)
    host._record_cost(times.describe())
    ratio = ("triton_diffusion_packed_forward_cost_ratio",)
    per_row = ("triton_diffusion_forward_cost_seconds", ("fit", "tokens_and_rows"), ("part", "per_row"))
    assert published[per_row] == pytest.approx(0.003) and ratio not in published
    for seconds in (9.0, 1.5 * plane(8, 512)):  # its pair's warm-up, then one measured
        times.forward_ran(8, 512, seconds, rows=8, packed=True)
    host._record_cost(times.describe())
    assert published[ratio] == pytest.approx(1.5)
    # Unknown again (a plane the fit cannot determine): each gauge it set reads NaN, not its last value.
    host._record_cost({**times.describe(), "forward_by_tokens_and_rows": None, "packed_over_plane": None})
    assert math.isnan(published[ratio]) and math.isnan(published[per_row])
    tokens = ("triton_diffusion_forward_cost_seconds", ("fit", "tokens"), ("part", "per_token"))
    assert published[tokens] > 0  # the line is still known
