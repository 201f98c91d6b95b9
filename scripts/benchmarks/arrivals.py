"""Arrival processes and the true clock of the in-process benchmarks: Poisson arrival times, and
``Traffic``, which sends a benchmark's requests (closed loop or open loop) to a single-threaded engine loop
and stamps each with when it was sent.

Nothing here imports torch or the package, so the unit tests load it in milliseconds.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar


def poisson_arrivals(count: int, rate: float, seed: int = 1) -> list[float]:
    """``count`` arrival times (seconds from the start) of a Poisson process at ``rate`` per second. The
    same seed gives the same arrivals, so engines compared at one rate see the same traffic."""
    rng, at, out = random.Random(seed), 0.0, []
    for _ in range(count):
        at += rng.expovariate(rate)
        out.append(at)
    return out


@dataclass
class Timing:
    submitted: float  # when the request was sent: its scheduled arrival, not when the engine saw it
    first_step: float | None = None
    done: float | None = None


@dataclass
class Measurement:
    """One run's requests after the warm-up: what the tables report."""

    requests: int  # all requests of the run
    measured: int  # those in the statistics (arrival order, after the warm-up)
    duration_s: float  # first measured arrival to last measured answer
    delivered_per_s: float  # measured requests answered per second of that window
    offered_per_s: float | None  # measured requests sent per second (Poisson); None for a closed loop
    latencies: list[float]
    first_steps: list[float]


Item = TypeVar("Item")


class Traffic(Generic[Item]):
    """Arrivals for a single-threaded engine loop, on a true clock.

    Closed loop (``concurrency`` clients): a client sends its next request the moment its previous one is
    answered. Open loop (``arrivals``, seconds from the start): a request is sent at its scheduled time.
    The loop polls ``arrived()`` only when it is free (between whole pipeline calls, or between steps),
    so a request is stamped with when it was sent, not when it was polled: the wait behind a running call
    is part of its latency. ``clock`` and ``sleep`` are injectable so tests can drive it with fake time.
    """

    def __init__(
        self,
        items: Sequence[Item],
        concurrency: int | None = None,
        arrivals: Sequence[float] | None = None,
        warm_up_fraction: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if (concurrency is None) == (arrivals is None):
            raise ValueError("give either a concurrency (closed loop) or arrival times (open loop)")
        if arrivals is not None and len(arrivals) != len(items):
            raise ValueError("one arrival time per request")
        self.items = list(items)
        self.concurrency = concurrency
        self.clock, self.sleep = clock, sleep
        self.start = clock()
        self.arrivals = None if arrivals is None else [self.start + at for at in arrivals]
        # Closed loop: when each idle client became free (all at the start, then at each answer).
        self.free_since = [self.start] * (concurrency or 0)
        self.warm_up = math.floor(len(self.items) * warm_up_fraction)
        self.timings: dict[int, Timing] = {}

    @property
    def pending(self) -> int:
        return len(self.items) - len(self.timings)

    def arrived(self) -> list[tuple[int, Item]]:
        """Requests sent by now that the loop has not taken yet, in arrival order, each stamped with the
        time it was sent."""
        now = self.clock()
        out = []
        while self.pending:
            index = len(self.timings)
            if self.arrivals is None:
                if not self.free_since:
                    break
                sent = self.free_since.pop(0)
            else:
                if self.arrivals[index] > now:
                    break
                sent = self.arrivals[index]
            self.timings[index] = Timing(sent)
            out.append((index, self.items[index]))
        return out

    def wait_for_arrival(self) -> None:
        """The loop is idle: sleep until the next Poisson arrival (a closed loop's clients are all busy)."""
        if self.arrivals is not None and self.pending:
            delay = self.arrivals[len(self.timings)] - self.clock()
            if delay > 0:
                self.sleep(delay)

    def first_step(self, index: int) -> None:
        if self.timings[index].first_step is None:
            self.timings[index].first_step = self.clock()

    def done(self, index: int) -> None:
        now = self.clock()
        self.timings[index].done = now
        if self.arrivals is None:
            self.free_since.append(now)  # this client sends its next request now

    @property
    def finished(self) -> bool:
        return not self.pending and all(t.done is not None for t in self.timings.values())

    def measure(self) -> Measurement:
        """Statistics over the requests after the warm-up (the first ``warm_up_fraction`` by arrival)."""
        measured = [self.timings[i] for i in sorted(self.timings) if i >= self.warm_up]
        begin = measured[0].submitted
        end = max(t.done for t in measured)
        offered, delivered = None, len(measured) / (end - begin)
        if self.arrivals is not None:
            # Open loop: both rates from the spacing of their own events (arrivals, answers), so a system
            # that keeps up delivers what is offered whatever its latency.
            span = measured[-1].submitted - begin
            offered = (len(measured) - 1) / span if span > 0 else float("nan")
            answers = sorted(t.done for t in measured)
            answered = answers[-1] - answers[0]
            delivered = (len(measured) - 1) / answered if answered > 0 else float("nan")
        return Measurement(
            requests=len(self.items),
            measured=len(measured),
            duration_s=end - begin,
            delivered_per_s=delivered,
            offered_per_s=offered,
            latencies=[t.done - t.submitted for t in measured],
            first_steps=[t.first_step - t.submitted for t in measured if t.first_step is not None],
        )
