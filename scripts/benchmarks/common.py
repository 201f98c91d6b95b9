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
from collections.abc import Callable, Sequence
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


def benchmark_parser(description: str, name: str) -> argparse.ArgumentParser:
    """A benchmark's argument parser, its usage line named as it was run: ``bench.py NAME`` where
    ``scripts/bench.py NAME`` ran it, the old script's name (``bench_engines.py``) where that did."""
    script = Path(sys.argv[0]).name
    prog = f"{script} {name}" if script == "bench.py" and sys.argv[1:2] == [name] else None
    return argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
