"""Degrading for the load offered (engine/overload.py): a cut only where arrivals are shown to ask more than
the engine serves, the lowest tier first, and none once the load has passed; and where the load leaves
headroom, nobody newly degraded for a deadline either (one cut before keeps what it needs)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.unit.recording import tracked
from tests.unit.test_degradation import allowance, degradable, forwards_of, harness
from tests.unit.test_degradation_cache import cacheable
from tests.unit.test_degradation_cache import harness as cache_harness
from tests.unit.test_scheduler import DEFAULT, FLEX, PRIORITY
from tests.unit.test_step_engine import Spec
from triton_diffusion.engine.degradation import StepsCut
from triton_diffusion.engine.jobs import Job
from triton_diffusion.engine.overload import LEAST, Arrival, OfferedLoad, arrival_of, overload_cut
from triton_diffusion.errors import ErrorCode


def served(load: OfferedLoad, forwards: int = LEAST + 1, full: bool = True) -> OfferedLoad:
    """Forwards of 2 token-steps, 0.1 s apart: the engine serves 20 token-steps a second."""
    for i in range(forwards):
        load.served(i * 0.1, 2, 0.0, full)
    return load


def evenly(load: OfferedLoad, count: int, start: float, span_s: float, tier: int = FLEX, images: int = 1):
    """``count`` jobs of 10 token-steps (0.5 s of the engine's time), 8 of them spare, over ``span_s``
    seconds from ``start``, ``images`` to a request."""
    for i in range(count):
        at = start + i * span_s / count
        load.arrived(Arrival(at, f"r{start}-{i // images}", tier, 10, 8))
    return load


def test_no_overload_below_what_the_engine_serves_with_too_few_arrivals_or_forwards_or_where_not_shown():
    assert evenly(served(OfferedLoad()), 40, 0.0, 60.0).overload(60.0, 0.0) is None  # 20 s of work in 60 s
    assert evenly(served(OfferedLoad()), LEAST - 1, 0.0, 1.0).overload(1.0, 0.0) is None  # too few to tell
    # 1.2 x what it serves over 40 requests: within two standard errors of 1, not shown.
    assert evenly(served(OfferedLoad()), 40, 0.0, 20 / 1.2).overload(20 / 1.2, 0.0) is None
    few = evenly(served(OfferedLoad(), LEAST - 1), 40, 0.0, 10.0)
    assert few.overload(10.0, 0.0) is None  # 2 x, but too few forwards served to tell


def test_a_requests_images_are_one_count_in_the_error():
    # 128 jobs at 1.4 x: shown as 128 requests of one image, not as 32 requests of 4.
    span = 128 * 0.5 / 1.4
    assert evenly(served(OfferedLoad()), 128, 0.0, span).overload(span, 0.0) is not None
    assert evenly(served(OfferedLoad()), 128, 0.0, span, images=4).overload(span, 0.0) is None


def test_a_burst_that_has_passed_cuts_nobody():
    load = evenly(served(OfferedLoad()), 96, 0.0, 4.0)  # 48 s of work in 4 s
    assert load.overload(4.0, 0.0) is not None
    evenly(load, 32, 4.0, 20.0)  # then 16 s in 20 s: the newest 32 ask less than the engine serves
    assert load.overload(24.0, 0.0) is None


def test_only_full_forwards_after_a_full_one_count_less_the_starts_and_decodes_run_between():
    load = served(OfferedLoad(), 10, full=False)
    assert not load.forwards
    load.served(5.0, 2, 1.0, True)
    load.served(5.2, 2, 1.15, True)  # a decode and a start of 0.15 s ran in these 0.2 s: 0.05 s of steps
    load.served(5.3, 2, 1.15, True)
    load.served(5.4, 2, 1.2, False)  # not full: it and the wait before the next are not counted
    load.served(9.0, 2, 1.3, True)
    load.served(9.1, 2, 1.3, True)
    assert [(round(g - s, 6), t) for g, s, t in load.forwards] == [(0.05, 2), (0.1, 2), (0.1, 2)]


def test_a_start_recorded_a_forward_late_comes_out_of_the_windows_time_whole():
    """On a GPU a start's seconds reach spent_s a step or more after it ran (engine/stopwatch.py): taken
    out of a later, shorter interval, the window still loses all of it (a clamp per interval would drop
    the part above that interval, and read the engine as slower than it is)."""
    lagging, on_time = OfferedLoad(), OfferedLoad()
    for load, spent in ((lagging, (0.0, 0.0, 0.3, 0.3)), (on_time, (0.0, 0.3, 0.3, 0.3))):
        for now, spent_s in zip((0.0, 0.5, 0.6, 1.1), spent, strict=True):
            load.served(now, 2, spent_s, True)  # intervals of 0.5, 0.1, 0.5 s; a 0.3 s start in the first
    assert [round(g - s, 6) for g, s, _ in lagging.forwards] == [0.5, -0.2, 0.5]
    steps_s = [round(sum(g - s for g, s, _ in load.forwards), 6) for load in (lagging, on_time)]
    assert steps_s == [0.8, 0.8]


def test_a_load_not_shown_by_its_bound_cuts_nobody_even_where_its_newest_arrivals_are_above_1():
    # 128 one-image requests at 1.15 x what the engine serves: the newest 32 alone are above 1 and the
    # excess over 90% is positive, but two standard errors below it is 0.95: not shown.
    span = 128 * 0.5 / 1.15
    load = evenly(served(OfferedLoad()), 128, 0.0, span)
    assert load.overload(span, 0.0) is None


def test_overload_shown_takes_the_excess_from_the_lowest_tier_first():
    load = served(OfferedLoad())
    for i in range(40):  # 20 flex and 20 default jobs of 0.5 s in 10 s: 2 x
        load.arrived(Arrival(i * 0.25, f"r{i}", FLEX if i % 2 else DEFAULT, 10, 8))
    overload = load.overload(10.0, 0.0)
    assert overload is not None and overload.load == pytest.approx(2.0) and overload.arrivals == 40
    # 11 s above 90% of the 10 s: flex gives up all it can (20 x 0.4 s), default 3 s of its 8.
    assert overload.shares[FLEX] == pytest.approx(1.0) and overload.shares[DEFAULT] == pytest.approx(3 / 8)
    cut = overload_cut(allowance(10, 2), overload.shares[DEFAULT], overload)
    assert cut is not None and (cut.steps, cut.asked) == (7, 10)  # 3 of its 8 spare steps, at least
    assert cut.reason.startswith("overload: 2.00 x what the engine serves")
    assert overload_cut(allowance(10, 2), 0.0, overload) is None


def test_a_start_and_a_decode_count_in_the_load_but_cannot_be_given_up():
    load = evenly(served(OfferedLoad()), 40, 0.0, 20.0)  # 40 x (0.5 s + 0.5 s) in 20 s: 2 x
    overload = load.overload(20.0, 0.5)
    assert overload is not None and overload.load == pytest.approx(2.0)
    assert overload.shares[FLEX] == pytest.approx(1.0)  # 22 s to give up, 16 s spare: all of it


def test_a_job_without_a_deadline_or_an_allowance_gives_up_nothing():
    job = Job(tracked("a"), Spec(steps=10), planned_steps=10, shape="S", tokens=3)
    assert (arrival_of(job).work, arrival_of(job).spare) == (30, 0)
    allowed = Job(tracked("b"), Spec(steps=10), planned_steps=10, shape="S", tokens=3, deadline=5.0)
    allowed.spec = replace(allowed.spec, steps_allowed=allowance(10, 2))
    assert arrival_of(allowed).spare == 24
    allowed.spec = replace(allowed.spec, deadline=None)
    assert arrival_of(allowed).spare == 0


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


def test_the_scheduler_cuts_waiting_jobs_for_an_overload_and_gives_the_steps_back_once_it_passed():
    h = harness(max_running=2, max_per_forward=2)
    h.measure(0.1)
    jobs = flood(h, span_s=10.0, count=100)  # 50 s of work in 10 s; the engine serves 2 per 0.1 s
    for _ in range(LEAST):
        h.step()
    assert all(job.queue.cut is None for job in jobs)  # too few forwards measured yet
    h.step()
    h.step()
    waiting = [job for job in jobs if job.run.total_steps == 0]
    assert waiting and all(job.queue.cut is not None for job in waiting)
    # 50 s of work over 13.4 s: 37.9 s above 90% of it, of 40 s flex can give up: 95% of its steps.
    assert all(job.queue.cut.steps == 2 and job.queue.cut.reason.startswith("overload") for job in waiting)
    assert all(job.queue.cut is None for job in jobs if job.run.total_steps)  # started ones keep theirs
    h.clock.now += 100.0  # nothing more arrives: the load has passed (the deadlines have not)
    h.step()
    still = [job for job in jobs if job.run.total_steps == 0 and not job.status.ended]
    assert still and all(job.queue.cut is None for job in still)


@pytest.mark.parametrize("span_s", [100.0, 49.2])
def test_no_job_is_cut_for_the_load_where_arrivals_fit_what_the_engine_serves(span_s):
    h = harness(max_running=2, max_per_forward=2)
    h.measure(0.1)
    # 50 s of work in 103.4 s, or in 52.6 s: 0.95 of what the engine serves (above its 90%).
    jobs = flood(h, span_s=span_s, count=100)
    for _ in range(LEAST + 2):
        h.step()
    assert all(job.queue.cut is None for job in jobs)


def test_a_newcomer_cut_for_the_load_is_still_refused_where_it_is_late_even_so():
    h = harness(max_running=2, max_per_forward=2)
    h.measure(0.1)
    flood(h, span_s=10.0, count=100)
    for _ in range(LEAST + 1):
        h.step()
    late = degradable(h, "late", FLEX, 10, 2, deadline_s=0.3)  # the queue ahead of it: many seconds
    h.add(late)
    h.step()
    assert late.queue.cut is not None and late.queue.cut.rule == "overload"  # cut for the load, and yet:
    assert late.request.channel.finals and late.request.channel.finals[0].code is ErrorCode.UNAVAILABLE


def test_a_higher_tier_is_cut_for_the_load_only_after_the_lower_ones_give_all_they_can():
    h = harness(max_running=2, max_per_forward=2)
    h.measure(0.1)
    flex = flood(h, span_s=20.0, count=100)
    default = [degradable(h, f"d{i}", DEFAULT, 10, 2, deadline_s=1000.0) for i in range(10)]
    h.add(*default)  # they go first: by the engine's step 34, some still wait
    for _ in range(LEAST + 2):
        h.step()
    # 55 s of work in 23.4 s: 33.9 s above 90% of it, flex alone gives up 40 s.
    assert any(job.run.total_steps == 0 for job in default), "no default job was still waiting"
    assert all(job.queue.cut is None for job in default)
    assert all(job.queue.cut is not None for job in flex if job.run.total_steps == 0)


# ---- headroom: unless the load offered is shown above CUT_TARGET of what the engine serves -------------
# 40 requests of one image alike: two standard errors are 2 / sqrt(40) of the work, so the window's
# lower bound is above 0.9 from a load of 0.9 / (1 - 2 / sqrt(40)) = 1.316 x what the engine serves.
def test_headroom_is_a_load_not_shown_above_the_cut_target_over_enough_arrivals_and_forwards():
    assert evenly(served(OfferedLoad()), 40, 0.0, 60.0).headroom(60.0, 0.0)  # 20 s of work in 60 s
    assert evenly(served(OfferedLoad()), 40, 0.0, 20 / 1.31).headroom(20 / 1.31, 0.0)
    assert not evenly(served(OfferedLoad()), 40, 0.0, 20 / 1.32).headroom(20 / 1.32, 0.0)
    assert evenly(served(OfferedLoad()), LEAST, 0.0, 60.0).headroom(60.0, 0.0)
    assert not evenly(served(OfferedLoad()), LEAST - 1, 0.0, 60.0).headroom(60.0, 0.0)  # too few to tell
    assert len(served(OfferedLoad(), LEAST).forwards) == LEAST - 1
    assert not evenly(served(OfferedLoad(), LEAST), 40, 0.0, 60.0).headroom(60.0, 0.0)
    # A start and a decode count: 40 x (0.5 s + 1 s) in 30 s is 2 x, 40 x 0.5 s in 30 s 0.67 x.
    assert evenly(served(OfferedLoad()), 40, 0.0, 30.0).headroom(30.0, 0.0)
    assert not evenly(served(OfferedLoad()), 40, 0.0, 30.0).headroom(30.0, 1.0)


def test_a_burst_below_capacity_now_and_then_is_headroom():
    """Fails if a burst a load below capacity brings is read as no room (the rule before read the
    window's and the newest 32 arrivals' point estimates): 0.74 x over the window, its newest 32 at 1.4 x."""
    load = evenly(served(OfferedLoad()), 96, 0.0, 48 / 0.64)  # 48 s of work at 0.64 x
    evenly(load, LEAST, 48 / 0.64, 16 / 1.4)  # then 16 s at 1.4 x: 64 s in 86.4 s, 0.74 x
    now = 48 / 0.64 + 16 / 1.4
    assert load.headroom(now, 0.0)


def test_a_burst_after_a_quiet_spell_is_no_headroom():
    load = evenly(served(OfferedLoad()), 96, 0.0, 600.0)  # 48 s of work in 600 s
    assert load.headroom(600.0, 0.0)
    evenly(load, LEAST, 600.0, 2.0)  # then 16 s of work in 2 s: the window still asks 0.1 x
    assert not load.headroom(602.0, 0.0)


def rise_to(load: float, arrivals: int) -> bool:
    """Whether the engine has headroom after 128 arrivals at 0.3 x what it serves, then ``arrivals`` at
    ``load`` x (each 0.5 s of its time, one image a request, evenly spaced)."""
    offered, now = served(OfferedLoad()), 0.0
    for count, rate in ((128, 0.3), (arrivals, load)):
        evenly(offered, count, now, count * 0.5 / rate)
        now += count * 0.5 / rate
    return offered.headroom(now, 0.0)


def test_a_rise_to_1_5x_after_a_quieter_spell_is_no_headroom_once_its_newest_64_show_it():
    """The newest 32 arrivals at 1.5 x do not show it (1.5 x (1 - 2 / sqrt(32)) is 0.97), the newest 64
    do (1.125): fails if only the newest 32 are looked at, or if the window alone decides (its bound is
    above 0.9 from about the 117th arrival of the rise)."""
    assert rise_to(1.5, 60)
    assert not rise_to(1.5, 64)
    assert rise_to(2.0, 28) and not rise_to(2.0, 32)  # a sharper rise: its newest 32 show it


def test_a_requests_images_are_one_count_in_the_headrooms_bound():
    # 40 jobs at 2 x: shown above 0.9 as 40 requests of one image, not as 10 requests of 4.
    assert not evenly(served(OfferedLoad()), 40, 0.0, 10.0).headroom(10.0, 0.0)
    assert evenly(served(OfferedLoad()), 40, 0.0, 10.0, images=4).headroom(10.0, 0.0)


def offered_before(h, span_s: float) -> None:
    """40 earlier arrivals of 0.5 s of the engine's time each, over the last ``span_s`` seconds, and the
    full forwards the engine served up to now, on the harness's clock (2 token-steps each 0.1 s)."""
    load = h.engine.scheduler.offered
    for i in range(LEAST + 1):
        load.served(h.clock.now - (LEAST - i) * 0.1, 2, h.engine.times.spent_s, True)
    evenly(load, 40, h.clock.now - span_s, span_s)


@pytest.mark.parametrize("span_s, degraded", [(60.0, False), (20 / 0.95, False), (20 / 1.5, True)])
def test_a_late_job_is_not_degraded_where_the_load_offered_leaves_headroom(span_s, degraded):
    """Fails if a job is degraded while the load leaves headroom: the same late job is cut where the load
    offered is shown above 0.9 x what the engine serves (about 1.5 x), not at about 0.95 x."""
    h = harness(max_running=4, max_per_forward=4)
    h.measure(0.5)
    offered_before(h, span_s)
    tight = degradable(h, "tight", DEFAULT, 8, 1, deadline_s=2.0)  # 8 x 0.5 s against 2 s: late
    h.add(tight)
    h.step(0.1)
    if degraded:
        assert tight.queue.cut is not None and tight.queue.cut.steps == 3
    else:  # run as it asked: refused for its deadline, as without an allowance
        assert tight.queue.cut is None
        assert tight.request.channel.finals[0].code is ErrorCode.UNAVAILABLE


def frozen(h):
    """The harness's estimate frozen at what it measured: the fake forwards' own timings are not taken."""
    times = h.engine.times
    times.forward_ran = times.started = times.finished = lambda *args, **kwargs: None
    return h


def cut_then_headroom(step_s: float):
    """A job cut for its own deadline (8 steps behind 8 others, 1 to 8 allowed, 6 s), then 40 arrivals
    over the last minute: the load leaves headroom. Engine steps of ``step_s`` seconds from there."""
    h = harness(max_running=1, max_per_forward=1)
    h.measure(0.5)
    frozen(h)
    h.add(h.job("ahead", DEFAULT, 8))
    h.step(0.1)
    later = degradable(h, "later", DEFAULT, 8, 1, deadline_s=6.0)  # behind 8 steps: late at 8
    h.add(later)
    h.step(0.1)
    assert later.queue.cut is not None and later.run.total_steps == 0
    offered_before(h, 60.0)
    while h.engine.active:
        assert later.run.total_steps or h.engine.scheduler.offered.headroom(h.clock.now + step_s, 0.0)
        h.step(step_s)
    return h, later


def test_a_job_cut_before_the_load_left_headroom_keeps_its_cut_where_it_needs_it_and_finishes_in_time():
    """A job let in on its cut is not given back steps that would make it expire: each step as long as
    the estimate says, the queue ahead drains no sooner."""
    h, later = cut_then_headroom(0.5)
    assert later.queue.cut is not None and forwards_of(h, "later") == later.queue.cut.steps < 8
    assert not isinstance(later.request.channel.finals[0], Exception)


def test_a_job_cut_before_the_load_left_headroom_is_given_back_what_it_asked_where_that_is_in_time():
    """Steps shorter than the estimate: the queue ahead drains early, and 8 steps fit within 90% of the
    time left."""
    h, later = cut_then_headroom(0.1)
    assert later.queue.cut is None and forwards_of(h, "later") == 8
    assert not isinstance(later.request.channel.finals[0], Exception)


def cut_for_a_later_one(headroom: bool):
    """``first`` (4 steps, 1 to 4 allowed, 2.8 s) and ``second`` (4 steps, no fewer, 3.5 s) waiting behind
    a running job with one step left; the second late unless the first is cut to 1 step. With
    ``headroom``, the load leaves headroom from the step they are decided at."""
    h = harness(max_running=1, max_per_forward=1, max_paused=0)
    h.measure(0.5)
    frozen(h)
    h.add(h.job("front", PRIORITY, 2))
    h.step(0.1)
    first = degradable(h, "first", DEFAULT, 4, 1, deadline_s=2.8)
    second = h.job("second", DEFAULT, 4, deadline_s=3.5)
    h.add(first, second)
    if headroom:
        offered_before(h, 60.0)
    h.step(0.1)
    return h, first, second


def test_no_job_is_cut_for_a_later_ones_deadline_where_the_load_leaves_headroom():
    h, first, second = cut_for_a_later_one(headroom=False)
    assert first.queue.cut is not None and first.queue.cut.rule == "room"
    assert not second.request.channel.finals  # let in on that cut
    h, first, second = cut_for_a_later_one(headroom=True)
    assert first.queue.cut is None
    assert second.request.channel.finals[0].code is ErrorCode.UNAVAILABLE  # refused, as without degradation


def test_a_cut_made_for_a_later_job_is_kept_when_the_load_then_leaves_headroom():
    """The later job was let in on that cut: given back, it would run late and expire."""
    h, first, second = cut_for_a_later_one(headroom=False)
    cut = first.queue.cut
    offered_before(h, 60.0)
    while h.engine.active:
        h.step(0.5)
    assert first.queue.cut == cut and forwards_of(h, "first") == cut.steps
    assert not isinstance(second.request.channel.finals[0], Exception)


@pytest.mark.parametrize("span_s, cached", [(60.0, False), (20 / 0.95, False), (20 / 1.5, True)])
def test_a_running_job_late_is_given_no_cache_where_the_load_offered_leaves_headroom(span_s, cached):
    h = cache_harness(max_running=2, max_per_forward=2)
    offered_before(h, span_s)
    late = cacheable(h, "late", DEFAULT, 8, deadline_s=4.5)
    h.add(late)
    h.step(0.1)  # 4.0 s of 4.4 s left: admitted
    h.step(1.0)  # 7 steps left, 3.5 s, of 3.4 s left: late
    assert (late.queue.cache_given is not None) is cached
    assert h.adapter.caches == ([("late", 1)] if cached else [])


def test_with_headroom_and_no_cut_made_the_walk_and_the_overload_are_not_looked_at(monkeypatch):
    """Both would change nothing there (headroom is a load not shown above 0.9: no overload; no job is newly
    cut, and none was cut before): fails if the scheduler prices every held job at each step anyway (a
    per-step cost; no goodput effect of it was shown)."""
    h = harness(max_running=1, max_per_forward=1)
    h.measure(0.5)
    h.add(h.job("ahead", DEFAULT, 8))
    h.step(0.1)
    waiting = degradable(h, "waiting", DEFAULT, 8, 1, deadline_s=600.0)
    h.add(waiting)
    h.step(0.1)
    offered_before(h, 60.0)
    scheduler = h.engine.scheduler
    walked: list[object] = []
    held_back = scheduler._held_back_s
    monkeypatch.setattr(scheduler, "_held_back_s", lambda *a: walked.append(a) or held_back(*a))
    monkeypatch.setattr(scheduler.offered, "overload", lambda *a: pytest.fail("overload looked for"))
    h.step(0.1)
    assert scheduler.offered.headroom(h.clock.now, 0.0) and waiting.run.total_steps == 0
    assert not walked
    waiting.queue.cut = StepsCut(4, 4, 8, "deadline: test", "deadline")  # one cut before: walked again
    h.step(0.1)
    assert walked


def test_the_view_is_read_once_an_instant_and_again_after_an_arrival_or_a_full_forward(monkeypatch):
    """The scheduler looks at the load several times an engine step: the view of an instant (and a start
    and decode's seconds) is kept until something is recorded. Fails if the view is read again each call,
    if a stale view outlives an arrival or a full forward, or if it disagrees with overload() and
    headroom()."""
    load = evenly(served(OfferedLoad()), 96, 0.0, 4.0)  # 48 s of work in 4 s: overload shown
    overload, headroom = load.view(4.0, 0.0)
    assert overload == load.overload(4.0, 0.0) and overload is not None and not headroom
    quiet = evenly(served(OfferedLoad()), 40, 0.0, 60.0)  # 20 s of work in 60 s
    reads = []
    monkeypatch.setattr(quiet, "headroom", lambda *a: reads.append(a) or OfferedLoad.headroom(quiet, *a))
    assert quiet.view(60.0, 0.0) == (None, True) and quiet.view(60.0, 0.0) == (None, True)
    assert len(reads) == 1  # read once for the instant
    # A start and decode of 2 s a job: 100 s of work in 60 s, another reading.
    assert quiet.view(60.0, 2.0)[1] is False and len(reads) == 2
    assert quiet.view(60.0, 0.0) == (None, True) and len(reads) == 3
    evenly(quiet, 40, 59.0, 1.0)  # a burst of 40 requests in the last second, read at the same instant
    assert quiet.view(60.0, 0.0) == (None, False) and len(reads) == 4
    slow = evenly(OfferedLoad(), 40, 0.0, 20.0)
    assert slow.view(20.0, 0.0) == (None, False)  # no forwards yet: too few to tell
    served(slow)  # forwards recorded (nothing arrived): read again at the same instant
    assert slow.view(20.0, 0.0) == (None, True)
