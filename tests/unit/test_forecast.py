"""The forecast of the work arriving while a job runs (engine/forecast.py; config ``deadline_estimate``
``arrivals``): its rates, its fixed point, and the scheduler refusing or cutting on a fake clock where the
held work alone says in time. Every expected time is worked out here by hand from the fake forward's
0.5 s."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.unit.test_scheduler import FLEX, PRIORITY, Harness
from triton_diffusion.engine.degradation import steps_allowed
from triton_diffusion.engine.forecast import ROUNDS, Arrivals, Coming
from triton_diffusion.errors import ErrorCode


def test_the_rates_are_the_arrivals_of_the_span_by_tier_less_the_job_itself():
    arrivals = Arrivals()
    arrivals.arrived(0.0, PRIORITY, 2, 40)  # before the span: not counted
    arrivals.arrived(5.0, PRIORITY, 2, 20)  # 2 tokens x 20 steps = 40 token-steps, before a flex job
    arrivals.arrived(6.0, FLEX, 3, 10)  # beside it
    arrivals.arrived(7.0, FLEX, 5, 10)  # the job itself (5 tokens)
    coming = arrivals.coming(8.0, 4.0, FLEX, own_tokens=5)
    assert coming == Coming(40 / 4.0, 3 / 4.0)
    # A priority job sees nothing before it: every arrival is its tier or lower.
    assert arrivals.coming(8.0, 4.0, PRIORITY).before_token_steps_s == 0
    assert arrivals.coming(8.0, 0.0, FLEX) == Coming(0.0, 0.0)


def test_the_estimate_is_the_fixed_point_of_the_arrivals_during_it():
    # A job alone takes 2 s; each token-step before it adds 0.1 s, each token beside it 0.01 s.
    calls = []

    def finish_s(before: int, beside: int) -> float:
        calls.append((before, beside))
        return 2.0 + 0.1 * before + 0.01 * beside

    assert Coming(0.0, 0.0).estimate(finish_s) == 2.0 and calls == [(0, 0)]  # no traffic: the held work's
    calls.clear()
    # 2 token-steps/s before it: T = 2 + 0.2 T, i.e. 2.5 s at the fixed point; 4 rounds from 2 s reach
    # 2 + 0.1 x round(2 x 2.496) = 2.5 (each round rounds the work to whole token-steps).
    seconds = Coming(2.0, 0.0).estimate(finish_s)
    assert ROUNDS == 4 and len(calls) == 1 + ROUNDS
    assert seconds == pytest.approx(2.5)
    # Tokens beside it share half of its time on average: 100 tokens/s over 2 s is 100 tokens beside.
    calls.clear()
    Coming(0.0, 100.0).estimate(finish_s)
    assert calls[1] == (0, 100)


def scenario(forecast: bool, least: int | None = None):
    """Three 4-step priority jobs arrive and are served (the engine empty again at ~1 s), then a 4-step flex
    job with a 3 s deadline, judged 0.1 s after it arrived (2.9 s left). Every forward takes 0.5 s, two jobs
    of one token each per forward."""
    h = Harness(max_running=2, max_per_forward=2, forecast=forecast)
    h.measure(0.5)
    start = h.clock.now
    h.add(*(h.job(f"p{i}", PRIORITY, 4) for i in range(3)))
    h.drain()
    assert h.clock.now - start < 3.0  # the priority jobs arrived within the flex job's span
    h.engine.times.by_tokens.clear()  # what their fake forwards measured (no time): 0.5 s a forward again
    h.measure(0.5)
    flex = h.job("flex", FLEX, 4, deadline_s=3.0)
    if least is not None:
        flex.spec = replace(flex.spec, steps_allowed=steps_allowed(4, least, lambda k: k, lambda k: True))
    h.add(flex)
    h.step()
    return h, flex


def test_without_the_forecast_the_held_work_says_in_time():
    # Nothing held: 4 forwards of 0.5 s = 2 s, within 2.9 s.
    h, flex = scenario(forecast=False)
    h.drain()
    assert not isinstance(flex.request.channel.finals[0], Exception) and flex.queue.cut is None


def test_the_forecast_refuses_a_job_the_higher_tiers_arriving_will_make_late():
    # 12 token-steps of priority work in the last 3 s: 4 a second. T = 2 s, then with 8 token-steps before
    # it 6 forwards (3 s), then 12: 8 forwards (4 s), ... past its 2.9 s.
    h, flex = scenario(forecast=True)
    error = flex.request.channel.finals[0]
    assert error.code is ErrorCode.UNAVAILABLE
    assert "cannot finish within" in error.message
    assert "4 token-steps/s of higher tiers arriving" in error.message


def test_the_forecast_cuts_a_job_to_the_steps_that_meet_its_deadline_with_the_arrivals():
    # At 2 steps the rounds go 1.0, 1.5, 2.0, 2.5, 3.0 s: past 90% of 2.9 s; at 1 step 0.5, 1.0, 1.5, 2.0,
    # 2.5 s: within it. Without the forecast it runs its 4 steps (test above).
    h, flex = scenario(forecast=True, least=1)
    assert flex.queue.cut is not None and flex.queue.cut.steps == 1
    h.drain()
    assert not isinstance(flex.request.channel.finals[0], Exception)
