"""Degrading for the load offered (engine/overload.py): a cut only where arrivals are shown to exceed the
engine's time, the lowest tier first, and none while the engine has room."""

from __future__ import annotations

import pytest

from tests.unit.test_degradation import allowance, degradable, harness
from tests.unit.test_scheduler import DEFAULT, FLEX, PRIORITY
from triton_diffusion.engine.overload import LEAST, Arrival, OfferedLoad, overload_cut


def offered(count: int, span_s: float, tier: int = FLEX, steps: int = 10, fewest: int = 2) -> OfferedLoad:
    load = OfferedLoad()
    for i in range(count):
        load.arrived(Arrival(i * span_s / count, tier, 1, 2, steps, fewest))
    return load


def per_forward(tokens: int) -> float:
    return 0.1  # a forward of any size: 0.1 s, so a job's step (1 of a 2-token budget) is 0.05 s


def test_no_overload_below_the_engines_time_with_too_few_arrivals_or_where_it_is_not_shown():
    assert offered(40, 60.0).overload(60.0, per_forward, 0.0) is None  # 20 s of work in 60 s
    assert offered(LEAST - 1, 1.0).overload(1.0, per_forward, 0.0) is None  # too few to tell
    # 1.2 x the engine's time over 40 arrivals: within two standard errors of 1, not shown.
    assert offered(40, 20 / 1.2).overload(20 / 1.2, per_forward, 0.0) is None


def test_overload_shown_takes_the_excess_from_the_lowest_tier_first():
    load = OfferedLoad()
    for i in range(40):  # 20 flex and 20 default jobs of 10 steps (0.5 s each) in 10 s: 2 x the time
        load.arrived(Arrival(i * 0.25, FLEX if i % 2 else DEFAULT, 1, 2, 10, 2))
    overload = load.overload(10.0, per_forward, 0.0)
    assert overload is not None and overload.load == pytest.approx(2.0) and overload.arrivals == 40
    # 11 s above 90% of the 10 s: flex gives up all it can (20 x 8 steps x 0.05 s = 8 s), default 3 s of 8.
    assert overload.shares[FLEX] == pytest.approx(1.0) and overload.shares[DEFAULT] == pytest.approx(3 / 8)
    cut = overload_cut(allowance(10, 2), overload.shares[DEFAULT], overload)
    assert cut is not None and (cut.steps, cut.asked) == (7, 10)  # 3 of its 8 spare steps, at least
    assert "overload: 2.00 x" in cut.reason
    assert overload_cut(allowance(10, 2), 0.0, overload) is None


def test_a_start_and_a_decode_count_in_the_load_but_cannot_be_cut():
    # 40 jobs of 10 steps with 0.5 s fixed each, in 20 s: (20 + 20) / 20 = 2 x; the cut needs 40 - 18 s.
    overload = offered(40, 20.0).overload(20.0, per_forward, 0.5)
    assert overload is not None and overload.load == pytest.approx(2.0)
    assert overload.shares[FLEX] == pytest.approx(1.0)  # 16 s spare, 22 s to give up: all of it


def flood(h, span_s: float, count: int = 40) -> list:
    """``count`` flex jobs that allow 10 -> 2 steps, arrived evenly over the last ``span_s`` seconds, with
    a deadline the queue alone does not threaten."""
    jobs = []
    for i in range(count):
        job = degradable(h, f"j{i}", FLEX, 10, 2, deadline_s=1000.0)
        job.request.entered = h.clock.now - span_s + i * span_s / count
        jobs.append(job)
    h.add(*jobs)
    return jobs


def test_the_scheduler_cuts_waiting_jobs_for_an_overload_only_once_the_engine_is_full():
    h = harness(max_running=2, max_per_forward=2)
    h.measure(0.1)
    jobs = flood(h, span_s=10.0)  # 40 x 0.5 s of work in 10 s: 2 x the engine's time
    h.step()  # the engine is empty when this step is decided: nobody is cut, two are admitted
    assert all(job.queue.cut is None for job in jobs)
    h.step()  # full now: the waiting jobs are cut for the load
    waiting = [job for job in jobs if job.run.total_steps == 0]
    assert waiting and all(job.queue.cut is not None for job in waiting)
    # 20 s of work in 10.2 s: 10.8 s above 90% of 16 s spare: each gives up at least 68% of 8 steps.
    assert all(job.queue.cut.steps == 4 and job.queue.cut.reason.startswith("overload") for job in waiting)
    assert all(job.queue.cut is None for job in jobs if job.run.total_steps)  # started ones keep theirs


@pytest.mark.parametrize("span_s", [40.0, 100.0])
def test_no_job_is_cut_for_the_load_where_arrivals_fit_the_engines_time(span_s):
    h = harness(max_running=2, max_per_forward=2)
    h.measure(0.1)
    jobs = flood(h, span_s=span_s)  # 20 s of work in 40 s or 100 s
    for _ in range(3):
        h.step()
    assert all(job.queue.cut is None for job in jobs)


def test_a_higher_tier_is_cut_for_the_load_only_after_the_lower_ones_give_all_they_can():
    h = harness(max_running=2, max_per_forward=2)
    h.measure(0.1)
    flex = flood(h, span_s=10.0, count=36)
    urgent = degradable(h, "urgent", PRIORITY, 10, 2, deadline_s=1000.0)
    h.add(urgent)
    h.step()
    h.step()
    # 37 x 0.5 s in 10 s: 9.5 s above 90%, flex alone gives up to 36 x 0.4 s: priority is not cut.
    assert urgent.queue.cut is None
    assert any(job.queue.cut is not None for job in flex)
