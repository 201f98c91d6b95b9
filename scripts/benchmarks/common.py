"""What the benchmarks share: the prompts, the traffic's constants, statistics, the issue's target ratios,
the Flux special case, the machine line, and each benchmark's argument parser.

Nothing here imports torch or the package, so the unit tests load it in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


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


def _by_round(
    runs: Sequence[Any], name: str, traffic: str, concurrency: int | None, key: str
) -> dict[int, Any]:
    """The runs of engine (or variant: ``key``) ``name`` on ``traffic`` by round (a run the rounds did not
    reach: round 0; where several share a round, the last)."""
    return {
        getattr(run, "round", 0): run
        for run in runs
        if getattr(run, key) == name and run.traffic == traffic and concurrency in (None, run.concurrency)
    }


def per_round(
    runs: Sequence[Any],
    over: tuple[str, str],
    traffic: str,
    figure: str,
    concurrency: int | None = None,
    key: str = "engine",
) -> list[float]:
    """Each round's ``figure`` of the engine ``over[0]`` over the engine ``over[1]``'s (engines told apart
    by the runs' ``key``), in round order; a round one engine lacks is left out."""
    first, second = (_by_round(runs, name, traffic, concurrency, key) for name in over)
    return [
        getattr(first[r], figure) / getattr(second[r], figure)
        for r in sorted(first.keys() & second.keys())
        if getattr(second[r], figure)
    ]


def ratio_value(rounds: list[float]) -> float:
    """A ratio's figure: its one round's, or the median round's (the verdict reads the same rounds)."""
    return rounds[0] if len(rounds) == 1 else statistics.median(rounds)


def step_request_ratios(
    runs: Sequence[Any], top: int, first_step: str, key: str = "engine"
) -> tuple[dict[str, tuple[float, str]], dict[str, list[float]]]:
    """The step engine over the request-level engine: homogeneous throughput at concurrency ``top``,
    mixed throughput, and p95 latency and mean time to the first step at 80% Poisson load, each the median
    of its rounds (runs with ``images_per_s``, ``latency_p95_s`` and the attribute named ``first_step``;
    the engine in the attribute ``key``); traffic not run is left out. Returns ``{label: (value,
    target)}`` and ``{label: its rounds}`` for those measured over more than one round."""
    out: dict[str, tuple[float, str]] = {}
    rounds: dict[str, list[float]] = {}
    pair, label = ("step", "request"), poisson_label(0.8)
    for name, traffic, figure, concurrency, target in (
        (f"homogeneous c={top}: step / request throughput", "homogeneous", "images_per_s", top, "throughput"),
        ("mixed: step / request throughput", "mixed", "images_per_s", None, "mixed throughput"),
        ("Poisson 80%: step / request p95 latency", label, "latency_p95_s", None, "poisson p95"),
        (
            "Poisson 80%: step / request mean time to first step",
            label,
            first_step,
            None,
            "poisson first step",
        ),
    ):
        each = per_round(runs, pair, traffic, figure, concurrency, key)
        if each:
            out[name] = (ratio_value(each), TARGETS[target])
        if len(each) > 1:
            rounds[name] = each
    return out, rounds


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


def benchmark_parser(description: str, name: str) -> argparse.ArgumentParser:
    """A benchmark's argument parser, its usage line named as it was run: ``bench.py NAME`` where
    ``scripts/bench.py NAME`` ran it, the old script's name (``bench_engines.py``) where that did."""
    script = Path(sys.argv[0]).name
    prog = f"{script} {name}" if script == "bench.py" and sys.argv[1:2] == [name] else None
    return argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
