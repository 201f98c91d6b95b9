"""A short calibration at load, so the packing gate (engine/scheduler.py) has prices from the first request.

The engine's cost fit in rows and tokens (engine/estimates.py ``forward_cost``) learns from every forward,
but traffic of mixed sizes that always runs packed computes one canvas per row and so never shows what a
row of another length costs: the fit would stay undetermined and the gate would pack for ever. At load,
a family that packs sizes runs a few forwards of its own at two sizes (the default and half of it) with
one row and with its size's cap (at most ``MAX_ROWS``), ``FORWARDS`` each, and seeds the fit with the
fastest of each (the first of a shape pays its warm-up). Nothing else is seeded: deadlines and refusals
price by what the served traffic measures, as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from triton_diffusion.adapters.image_params import ImageParams
from triton_diffusion.engine.estimates import WorkTimes
from triton_diffusion.engine.jobs import Job
from triton_diffusion.engine.stopwatch import Stopwatch

if TYPE_CHECKING:
    from triton_diffusion.adapters.latent_loop import LatentStepAdapter

log = logging.getLogger("triton_diffusion")

FORWARDS = 3  # forwards per plan: the fastest counts
MAX_ROWS = 4  # rows of the larger plan of a size (a GPU's large forwards stay bounded)
STEPS = FORWARDS + 2  # a calibration job's denoising steps: more than it runs, so none finishes


@dataclass(frozen=True)
class _Calibration:
    """A calibration job's request (engine/request_status.py Request): never answered."""

    request_id: str
    entered: float = field(default_factory=time.perf_counter)


def calibrate(
    adapter: LatentStepAdapter, requests: Sequence[ImageParams], rows_for: Callable[[ImageParams], int]
) -> WorkTimes | None:
    """The cost fit seeded from forwards of ``requests`` (step requests of distinct sizes), each run with
    one row and with ``min(rows_for(request), MAX_ROWS)``; None where the adapter does not pack sizes or
    a forward fails (the fit then learns from traffic alone)."""
    if not adapter.sizes.packing.on or len(requests) < 2:
        return None
    times = WorkTimes()
    started = time.perf_counter()
    try:
        for request in requests:
            for rows in sorted({1, max(1, min(rows_for(request), MAX_ROWS))}):
                _measure(adapter, [replace(request, seed=i) for i in range(rows)], times)
    except Exception as exc:  # noqa: BLE001  (a calibration is an extra: the model serves without it)
        log.warning("calibration at load failed (%s): the packing gate learns from traffic alone", exc)
        return None
    log.info(
        "calibration: %d forwards at %s in %.2f s",
        len(times.calibration) * FORWARDS,
        ", ".join(f"{r.width}x{r.height}" for r in requests),
        time.perf_counter() - started,
    )
    return times


def _measure(adapter: LatentStepAdapter, requests: list[ImageParams], times: WorkTimes) -> None:
    jobs = [
        Job(
            _Calibration(f"calibration-{i}"),
            replace(request, steps=STEPS),
            shape=request.shape,
            tokens=adapter.tokens_of(request),
        )
        for i, request in enumerate(requests)
    ]
    for job, start in zip(jobs, adapter.prepare(jobs), strict=True):
        job.begin(start)
    stopwatch = Stopwatch.on(adapter.device)  # a GPU's forward returns once queued: its device seconds
    seconds: list[float] = []
    rows, padded = 0, 0
    for _ in range(FORWARDS):
        began = stopwatch.start()
        result = adapter.step(jobs, [False] * len(jobs))
        stopwatch.stop(began, seconds.append)
        stopwatch.settle(wait=True)
        rows, padded = result.rows, result.padded_tokens
        for job, out in zip(jobs, result.steps, strict=True):
            if out.error is not None:
                raise RuntimeError(out.error.text)
            job.reached(out.step)
    times.calibrated(rows, sum(job.spec.tokens for job in jobs) + padded, min(seconds))
