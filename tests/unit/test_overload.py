"""Degrading for the load offered (engine/overload.py): a cut only where arrivals are shown to exceed the
engine's time, the lowest tier first, and none while the engine has room."""

from __future__ import annotations

import pytest

from tests.unit.test_degradation import allowance, degradable, harness
from tests.unit.test_scheduler import DEFAULT, FLEX
from triton_diffusion.engine.overload import LEAST, Arrival, OfferedLoad, overload_cut


def offered(count: int, span_s: float, tier: int = FLEX, steps: int = 10, fewest: int = 2) -> OfferedLoad:
    """``count`` arrivals of one token and ``steps`` steps, evenly over ``span_s`` seconds, and an engine
    that served 20 token-steps a second while full (``LEAST`` forwards of 2, 0.1 s apart)."""
    load = OfferedLoad()
    for i in range(count):
        load.arrived(Arrival(i * span_s / count, tier, 1, steps, fewest))
    serve(load, LEAST + 1)
    return load


def serve(load: OfferedLoad, forwards: int, full: bool = True) -> None:
    for i in range(forwards):
        load.served(i * 0.1, 2, full)


def test_no_overload_below_what_the_engine_serves_with_too_few_arrivals_or_forwards_or_where_not_shown():
    assert offered(40, 60.0).overload(60.0) is None  # 400 token-steps in 60 s, 20 a second served
    assert offered(LEAST - 1, 1.0).overload(1.0) is None  # too few arrivals to tell
    # 1.2 x what it serves over 40 arrivals: within two standard errors of 1, not shown.
    assert offered(40, 20 / 1.2).overload(20 / 1.2) is None
    few = OfferedLoad()
    for i in range(40):
        few.arrived(Arrival(i * 0.25, FLEX, 1, 10, 2))
    serve(few, LEAST - 1)
    assert few.overload(10.0) is None  # too few forwards served to tell


def test_only_forwards_while_full_after_a_full_one_count_as_served():
    load = OfferedLoad()
    serve(load, 10, full=False)
    assert not load.forwards
    load.served(5.0, 2, True)
    load.served(5.1, 2, True)
    load.served(5.2, 2, False)  # not full: it and the wait before the next are not counted
    load.served(9.0, 2, True)
    assert list(load.forwards) == [(pytest.approx(0.1), 2)]


def test_overload_shown_takes_the_excess_from_the_lowest_tier_first():
    load = OfferedLoad()
    for i in range(40):  # 20 flex and 20 default jobs of 10 token-steps in 10 s: 40 a second, 2 x
        load.arrived(Arrival(i * 0.25, FLEX if i % 2 else DEFAULT, 1, 10, 2))
    serve(load, LEAST + 1)
    overload = load.overload(10.0)
    assert overload is not None and overload.load == pytest.approx(2.0) and overload.arrivals == 40
    # 220 token-steps above 90% of the 180 served in 10 s: flex gives up all it can (20 x 8), default 60
    # of its 160.
    assert overload.shares[FLEX] == pytest.approx(1.0) and overload.shares[DEFAULT] == pytest.approx(60 / 160)
    cut = overload_cut(allowance(10, 2), overload.shares[DEFAULT], overload)
    assert cut is not None and (cut.steps, cut.asked) == (7, 10)  # 3 of its 8 spare steps, at least
    assert cut.reason.startswith("overload: 2.00 x what the engine serves")
    assert overload_cut(allowance(10, 2), 0.0, overload) is None


def flood(h, span_s: float, count: int) -> list:
    """``count`` flex jobs that allow 10 -> 2 steps, arrived evenly over the last ``span_s`` seconds, with
    a deadline the queue alone does not threaten."""
    jobs = []
    for i in range(count):
        job = degradable(h, f"j{i}", FLEX, 10, 2, deadline_s=1000.0)
        job.request.entered = h.clock.now - span_s + i * span_s / count
        jobs.append(job)
    h.add(*jobs)
    return jobs


def test_the_scheduler_cuts_waiting_jobs_for_an_overload_once_it_has_measured_it():
    h = harness(max_running=2, max_per_forward=2)
    h.measure(0.1)
    jobs = flood(h, span_s=10.0, count=100)  # 1000 token-steps in 10 s; the engine serves 2 per 0.1 s
    for _ in range(LEAST):
        h.step()
    assert all(job.queue.cut is None for job in jobs)  # too few forwards measured yet
    h.step()
    h.step()
    waiting = [job for job in jobs if job.run.total_steps == 0]
    assert waiting and all(job.queue.cut is not None for job in waiting)
    # 1000 token-steps over 13.4 s against 20 a second: 759 above 90% of it, of 800 flex can give up.
    assert all(job.queue.cut.steps == 2 and job.queue.cut.reason.startswith("overload") for job in waiting)
    assert all(job.queue.cut is None for job in jobs if job.run.total_steps)  # started ones keep theirs


def test_no_job_is_cut_for_the_load_where_arrivals_fit_what_the_engine_serves():
    h = harness(max_running=2, max_per_forward=2)
    h.measure(0.1)
    jobs = flood(h, span_s=100.0, count=40)  # 400 token-steps in 100 s: 4 a second
    for _ in range(LEAST + 4):
        h.step()
    assert all(job.queue.cut is None for job in jobs)


def test_a_higher_tier_is_cut_for_the_load_only_after_the_lower_ones_give_all_they_can():
    h = harness(max_running=2, max_per_forward=2)
    h.measure(0.1)
    flex = flood(h, span_s=20.0, count=100)
    default = [degradable(h, f"d{i}", DEFAULT, 10, 2, deadline_s=1000.0) for i in range(10)]
    h.add(*default)  # they go first: by the engine's step 34, some still wait
    for _ in range(LEAST + 2):
        h.step()
    # 1100 token-steps in 23.4 s: 679 above 90% of what it served (20 a second), flex alone gives up 800.
    assert any(job.run.total_steps == 0 for job in default), "no default job was still waiting"
    assert all(job.queue.cut is None for job in default)
    assert all(job.queue.cut is not None for job in flex if job.run.total_steps == 0)
