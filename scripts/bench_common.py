"""What the benchmark scripts share: the prompts, statistics, the true clock of the in-process runs, the
issue's target ratios, the Flux special case, the machine line and the markdown and plot helpers.

Imported by ``bench.py``, ``bench_engines.py`` and ``bench_dllm.py`` (each puts ``scripts/`` on
``sys.path`` first, as they are also loaded from a file path by the tests). Nothing here imports torch or
the package, so the unit tests can load it in milliseconds.
"""

from __future__ import annotations

import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

REPO_ROOT = Path(__file__).resolve().parents[1]


def read_prompts(path: Path = REPO_ROOT / "client" / "prompts.txt") -> list[str]:
    """The shipped prompts, one per line; blank lines and ``#`` comments skipped."""
    return [
        line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]


PROMPTS = read_prompts()

# Traffic shared by the image benchmarks: mixed requests draw steps x guidance from these, and Poisson
# arrivals come at these fractions of the request-level engine's saturated throughput.
MIXED_STEPS = (4, 8, 16)
MIXED_GUIDANCE = (1.0, 5.0, 7.5)
POISSON_LOADS = (0.5, 0.8, 0.95)
WARM_UP_FRACTION = 0.1  # the first requests of a Poisson run fill an empty system: not steady state

# The shipped text_to_image_flux config caps T5 prompts at 64 tokens; the benchmarks do the same so the
# in-process pipeline does the work the served one does.
FLUX_MAX_SEQUENCE_LENGTH = 64


def max_sequence_length(name: str) -> int | None:
    """The prompt length cap to pass for an architecture or pipeline class name (Flux only)."""
    return FLUX_MAX_SEQUENCE_LENGTH if "flux" in name.lower() else None


def poisson_label(load: float) -> str:
    return f"poisson{round(load * 100)}"


# Statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default); nan for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def mean(values: Sequence[float]) -> float:
    """The mean; nan for no values (a run where every request failed still gets a row)."""
    return statistics.fmean(values) if values else float("nan")


def metric_delta(before: dict, after: dict, name: str, model: str) -> float:
    """How much a Prometheus counter of ``model`` grew between two reads of the server's metrics."""
    key = f'{name}{{model="{model}"}}'
    return after.get(key, 0.0) - before.get(key, 0.0)


def poisson_arrivals(count: int, rate: float, seed: int = 1) -> list[float]:
    """``count`` arrival times (seconds from the start) of a Poisson process at ``rate`` per second. The
    same seed gives the same arrivals, so engines compared at one rate see the same traffic."""
    rng, at, out = random.Random(seed), 0.0, []
    for _ in range(count):
        at += rng.expovariate(rate)
        out.append(at)
    return out


# The true clock of the in-process benchmark


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


# Target ratios (the issue's) of the step engine against the request-level engine

TARGETS = {
    "throughput": ">= 1.0",  # homogeneous closed loop: the step engine loses nothing
    "mixed throughput": ">= 2",
    "poisson p95": "<= 0.7",  # through the server at 80% load
    "poisson first step": "<= 0.3",
    "raw throughput": ">= 0.95",  # the step engine against the raw batched pipeline
    "own work": "<= 0.03",  # the engine's own work per step at full occupancy
}
# In process, Poisson load -> step / request mean and p95 latency, and mean time to the first step.
POISSON_TARGETS = {0.5: (0.8, 0.4), 0.8: (0.65, 0.3), 0.95: (0.4, 0.2)}
DELIVERED_TARGET = ">= 0.98"  # of the offered rate, at 95% load


def pooled_throughput(runs: Sequence[Any]) -> float:
    """Images per second over runs together: all their measured images over all their measured time (a run
    has ``images_per_s`` and ``duration_s``, its measured window)."""
    return sum(r.images_per_s * r.duration_s for r in runs) / sum(r.duration_s for r in runs)


def alternated_rounds(steps: Sequence[Any], requests: Sequence[Any]) -> tuple[float, list[float]]:
    """The step / request throughput ratio over rounds run alternately (round i of each engine back to
    back, so both see the machine's speed of that moment): pooled (:func:`pooled_throughput` of each
    engine) and each round's own ratio, sorted."""
    each = sorted(s.images_per_s / r.images_per_s for s, r in zip(steps, requests, strict=True))
    return pooled_throughput(steps) / pooled_throughput(requests), each


def step_request_ratios(
    pick: Callable[[str, str], Any | None], top: int, first_step: str
) -> dict[str, tuple[float, str]]:
    """The step engine over the request-level engine: homogeneous throughput at concurrency ``top``,
    mixed throughput, and p95 latency and mean time to the first step at 80% Poisson load.
    ``pick(engine, traffic)`` returns a run (``images_per_s``, ``latency_p95_s`` and the attribute named
    ``first_step``) or None; rows whose traffic was not run are left out."""
    out: dict[str, tuple[float, str]] = {}
    step, request = pick("step", "homogeneous"), pick("request", "homogeneous")
    out[f"homogeneous c={top}: step / request throughput"] = (
        step.images_per_s / request.images_per_s,
        TARGETS["throughput"],
    )
    if pick("step", "mixed") and pick("request", "mixed"):
        out["mixed: step / request throughput"] = (
            pick("step", "mixed").images_per_s / pick("request", "mixed").images_per_s,
            TARGETS["mixed throughput"],
        )
    label = poisson_label(0.8)
    step80, request80 = pick("step", label), pick("request", label)
    if step80 and request80:
        out["Poisson 80%: step / request p95 latency"] = (
            step80.latency_p95_s / request80.latency_p95_s,
            TARGETS["poisson p95"],
        )
        out["Poisson 80%: step / request mean time to first step"] = (
            getattr(step80, first_step) / getattr(request80, first_step),
            TARGETS["poisson first step"],
        )
    return out


# Reports


def machine_description(*details: str) -> str:
    """One line for a report: architecture, cores, memory, processor, then ``details`` (torch threads,
    the GPU)."""
    import psutil  # only the reports need it

    line = (
        f"{platform.machine()} {os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB "
        f"({platform.processor() or platform.platform()})"
    )
    return ", ".join([line, *details])


def load_cell(concurrency: int | None, rate: float | None) -> str:
    """A table's "concurrency / rate" cell: the closed loop's clients or the Poisson rate."""
    return str(concurrency) if rate is None else f"{rate:.2f}/s"


def number_cell(value: float | None, digits: int = 3) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def ratio_table(ratios: dict[str, tuple[float, str]]) -> list[str]:
    """Markdown lines of the ratio table: name, value, target."""
    lines = ["| ratio | value | target |", "|---|---|---|"]
    lines += [f"| {name} | {value:.3f} | {target} |" for name, (value, target) in ratios.items()]
    return lines


def write_plot(
    runs: list[Any],
    path: Path,
    throughput: str = "requests_per_s",
    throughput_label: str = "requests/s",
    xlabel: str = "concurrency",
) -> None:
    """Throughput and p95 latency against concurrency, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for variant in dict.fromkeys(r.variant for r in runs):
        points = sorted(
            (r for r in runs if r.variant == variant and r.concurrency), key=lambda r: r.concurrency
        )
        xs = [r.concurrency for r in points]
        left.plot(xs, [getattr(r, throughput) for r in points], marker="o", label=variant)
        right.plot(xs, [r.latency_p95_s for r in points], marker="o", label=variant)
    left.set(xlabel=xlabel, ylabel=throughput_label, title="Throughput")
    right.set(xlabel=xlabel, ylabel="p95 latency (s)", title="p95 latency")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
