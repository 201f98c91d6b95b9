"""The in-process benchmark's clock (scripts/benchmarks/arrivals.py), driven with fake time and no model: a
request is charged from when it was sent, not from when the engine loop got round to taking it."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the benchmarks' package

from benchmarks.arrivals import Traffic, poisson_arrivals  # noqa: E402
from benchmarks.common import percentile, poisson_label, step_request_ratios  # noqa: E402


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def request_level_loop(traffic: Traffic, time: FakeTime, call_s: float, first_step_s: float) -> list[int]:
    """engine_runs.run_request_level's shape: take what has arrived, run one whole call for it, answer
    it; the loop looks for arrivals only between calls. Returns the rows of each call."""
    rows = []
    while not traffic.finished:
        batch = traffic.arrived()
        if not batch:
            traffic.wait_for_arrival()
            continue
        time.now += first_step_s
        for index, _ in batch:
            traffic.first_step(index)
        time.now += call_s - first_step_s
        for index, _ in batch:
            traffic.done(index)
        rows.append(len(batch))
    return rows


def test_a_request_that_arrives_while_a_call_runs_is_charged_that_wait():
    time = FakeTime()
    traffic = Traffic(["a", "b"], arrivals=[0.0, 0.1], clock=time, sleep=time.sleep)

    assert request_level_loop(traffic, time, call_s=0.5, first_step_s=0.05) == [1, 1]

    # "b" arrived at 0.1 and the loop saw it at 0.5, when the call for "a" ended: its 0.4 s behind that
    # call count (stamped when polled, it would read 0.5 and 0.05).
    assert traffic.timings[1].submitted == pytest.approx(0.1)
    measured = traffic.measure()
    assert measured.latencies == pytest.approx([0.5, 0.9])
    assert measured.first_steps == pytest.approx([0.05, 0.45])


def test_an_idle_loop_sleeps_until_the_next_arrival_without_charging_the_sleep():
    time = FakeTime()
    traffic = Traffic(["a", "b"], arrivals=[1.0, 3.0], clock=time, sleep=time.sleep)

    request_level_loop(traffic, time, call_s=0.5, first_step_s=0.1)

    assert traffic.measure().latencies == pytest.approx([0.5, 0.5])
    assert traffic.timings[1].done == pytest.approx(3.5)


def test_a_closed_loop_client_sends_its_next_request_when_answered_not_when_polled():
    time = FakeTime()
    traffic = Traffic(["a", "b", "c"], concurrency=1, clock=time, sleep=time.sleep)

    assert [index for index, _ in traffic.arrived()] == [0]
    assert traffic.arrived() == []  # the one client is waiting for its answer
    time.now = 0.3
    traffic.done(0)  # answered mid-step...
    time.now = 0.5  # ...and the loop polls after the step
    assert [index for index, _ in traffic.arrived()] == [1]
    assert traffic.timings[1].submitted == pytest.approx(0.3)
    time.now = 0.8
    traffic.done(1)
    assert [index for index, _ in traffic.arrived()] == [2]
    time.now = 1.0
    traffic.done(2)

    assert traffic.finished
    assert traffic.measure().latencies == pytest.approx([0.3, 0.5, 0.2])


def test_closed_loop_clients_each_send_again_from_their_own_answer():
    time = FakeTime()
    traffic = Traffic(list("abcd"), concurrency=2, clock=time, sleep=time.sleep)

    assert len(traffic.arrived()) == 2
    time.now = 0.2
    traffic.done(1)
    time.now = 0.4
    traffic.done(0)
    time.now = 0.6
    assert [index for index, _ in traffic.arrived()] == [2, 3]
    assert [traffic.timings[i].submitted for i in (2, 3)] == pytest.approx([0.2, 0.4])


def test_the_first_tenth_of_a_poisson_run_is_left_out_of_the_statistics():
    time = FakeTime()
    arrivals = [0.1 * i for i in range(10)]
    traffic = Traffic(list(range(10)), arrivals=arrivals, warm_up_fraction=0.1, clock=time, sleep=time.sleep)
    time.now = 1.0
    assert len(traffic.arrived()) == 10
    time.now = 10.0
    traffic.done(0)  # the first request, served into an empty system (here: very slow)
    for index in range(1, 10):
        time.now = arrivals[index] + 1.0
        traffic.done(index)

    measured = traffic.measure()
    assert (measured.requests, measured.measured) == (10, 9)
    assert measured.latencies == pytest.approx([1.0] * 9)
    # Offered: 9 arrivals 0.1 s apart; delivered: 9 answers 0.1 s apart (a system that keeps up delivers
    # what is offered, whatever its latency). The window runs from the first measured arrival (0.1) to
    # the last measured answer (1.9).
    assert measured.offered_per_s == pytest.approx(10.0)
    assert measured.delivered_per_s == pytest.approx(10.0)
    assert measured.duration_s == pytest.approx(1.8)


def test_a_closed_loop_run_keeps_every_request_and_offers_no_rate():
    time = FakeTime()
    traffic = Traffic(["a"], concurrency=1, clock=time, sleep=time.sleep)
    traffic.arrived()
    time.now = 2.0
    traffic.done(0)

    measured = traffic.measure()
    assert (measured.measured, measured.offered_per_s, measured.delivered_per_s) == (1, None, 0.5)


def test_both_engines_get_the_same_poisson_arrivals():
    assert poisson_arrivals(500, 4.0, seed=1) == poisson_arrivals(500, 4.0, seed=1)
    assert poisson_arrivals(500, 4.0, seed=1) != poisson_arrivals(500, 4.0, seed=2)
    arrivals = poisson_arrivals(2000, 4.0)
    assert arrivals == sorted(arrivals)
    assert len(arrivals) / arrivals[-1] == pytest.approx(4.0, rel=0.1)
    assert [poisson_label(load) for load in (0.5, 0.8, 0.95)] == ["poisson50", "poisson80", "poisson95"]


def test_traffic_is_either_a_closed_or_an_open_loop():
    with pytest.raises(ValueError):
        Traffic(["a"])
    with pytest.raises(ValueError):
        Traffic(["a"], concurrency=1, arrivals=[0.0])
    with pytest.raises(ValueError):
        Traffic(["a", "b"], arrivals=[0.0])


def test_percentile_interpolates_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.95) == pytest.approx(4.8)
    assert math.isnan(percentile([], 0.95))


def test_the_shared_ratios_compare_the_step_engine_with_the_request_level_engine():
    class Run:
        def __init__(self, variant: str, traffic: str, images_per_s: float, p95: float, first: float) -> None:
            self.variant, self.traffic, self.concurrency, self.round = variant, traffic, 16, 0
            self.images_per_s, self.latency_p95_s, self.first_step_mean_s = images_per_s, p95, first

    runs = [
        Run("step", "homogeneous", 9.5, 1.0, 0.1),
        Run("request", "homogeneous", 10.0, 1.0, 0.1),
        Run("step", "poisson80", 8.0, 0.7, 0.1),
        Run("request", "poisson80", 8.0, 1.4, 0.4),
    ]
    ratios, rounds = step_request_ratios(runs, 16, "first_step_mean_s", key="variant")

    assert ratios == {
        "homogeneous c=16: step / request throughput": (pytest.approx(0.95), ">= 1.0"),
        "Poisson 80%: step / request p95 latency": (pytest.approx(0.5), "<= 0.7"),
        "Poisson 80%: step / request mean time to first step": (pytest.approx(0.25), "<= 0.3"),
    }
    assert rounds == {}  # one round each: no verdict
    # A second round (its runs first in the list, as a rotated order puts them): each round its own pair.
    second = [Run("request", "poisson80", 8.0, 1.0, 0.4), Run("step", "poisson80", 8.0, 0.9, 0.1)]
    for run in second:
        run.round = 1
    ratios, rounds = step_request_ratios(second + runs, 16, "first_step_mean_s", key="variant")
    assert rounds["Poisson 80%: step / request p95 latency"] == [pytest.approx(0.5), pytest.approx(0.9)]
    assert ratios["Poisson 80%: step / request p95 latency"][0] == pytest.approx(0.7)  # their median
