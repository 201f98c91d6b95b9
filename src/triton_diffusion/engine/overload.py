"""Degrading for the load offered, not only for the queue: while requests arrive faster than the engine
serves them at full steps, every job admitted at full steps makes the ones after it later, and a cut
decided from the queue alone (engine/degradation.py) comes when the queue shows it, too late for the jobs
already started. Here the engine looks at what arrives.

The load offered is measured over the last ``WINDOW`` arrivals, by their true arrival stamps: each one's
work at the steps it asked, priced as the engine's own estimate prices it (a step its share of a full
forward, plus a start and a decode), over the time they arrived in, as a share of the engine's time. It
counts as overload only where it is shown: its lower bound, the arrivals counted less two of their
standard errors (Poisson counts: a share of ``2 / sqrt(n)``), still exceeds the engine's time, with at
least ``LEAST`` arrivals seen; and only while the engine is full (the scheduler's condition). Then the
work above ``CUT_TARGET`` of the engine's time is taken from the jobs that allow fewer steps and have a
deadline, the lowest tier first: a share per tier of what its arrivals could give up, the next tier only
where the lower ones' all is not enough. Each waiting job of a tier then runs the most steps allowed that
give up its tier's share (at least); the deadline rule may cut it more, never less. Otherwise nobody is
cut for the load, and a queue with room degrades nobody.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from triton_diffusion.engine.degradation import CUT_TARGET, StepsAllowed, StepsCut

if TYPE_CHECKING:
    from triton_diffusion.engine.jobs import Job

# Arrivals the load is measured over (the newest), and the fewest it is measured with.
WINDOW = 128
LEAST = 32


@dataclass(frozen=True)
class Arrival:
    """One job as it arrived: when (its request's stamp), its tier, its tokens and the token budget of
    its forwards, the denoising steps it asked and the fewest it may run (``steps`` where it allows none,
    or sends no deadline: nothing of it is cut)."""

    at: float
    tier: int
    tokens: int
    budget: int
    steps: int
    fewest: int


def arrival_of(job: Job, budget: int) -> Arrival:
    """A job as it arrives, with the token ``budget`` of its forwards: what it asked, and the fewest steps
    it may run where it has a deadline (the load's cut is for deadlines)."""
    allowed, asked = job.spec.steps_allowed, job.remaining
    fewest = allowed[-1][1] if allowed and job.spec.deadline is not None else asked
    return Arrival(job.request.entered, job.spec.tier, job.spec.tokens, budget, asked, fewest)


@dataclass(frozen=True)
class Overload:
    """The load offered, shown above the engine's time: ``load``, the work offered per second of the
    window (its point estimate), and by tier the share of what its jobs could give up that they do."""

    load: float
    arrivals: int
    shares: dict[int, float]


class OfferedLoad:
    """The newest arrivals and what they ask of the engine (the scheduler's, on its thread)."""

    def __init__(self, window: int = WINDOW) -> None:
        self.arrivals: deque[Arrival] = deque(maxlen=window)

    def arrived(self, arrival: Arrival) -> None:
        self.arrivals.append(arrival)

    def overload(
        self, now: float, forward_s: Callable[[int], float], fixed_s: float, least: int = LEAST
    ) -> Overload | None:
        """The overload shown at ``now`` (None where it is not): each arrival's steps priced at its share
        of a forward of its budget (``forward_s(tokens)``: the engine's line), plus ``fixed_s`` (a start
        and a decode)."""
        arrivals = list(self.arrivals)
        count = len(arrivals)
        span = now - arrivals[0].at if arrivals else 0.0
        if count < least or span <= 0:
            return None
        step_s = [forward_s(a.budget) * a.tokens / max(a.budget, 1) for a in arrivals]
        work = sum(a.steps * s for a, s in zip(arrivals, step_s, strict=True)) + count * fixed_s
        load = work / span
        if load * (1 - 2 / math.sqrt(count)) <= 1.0:
            return None
        spare: dict[int, float] = {}
        for arrival, seconds in zip(arrivals, step_s, strict=True):
            spare[arrival.tier] = spare.get(arrival.tier, 0.0) + (arrival.steps - arrival.fewest) * seconds
        excess = work - CUT_TARGET * span
        shares: dict[int, float] = {}
        for tier in sorted(spare, reverse=True):  # the lowest tier (the highest rank) first
            given = min(excess, spare[tier])
            shares[tier] = given / spare[tier] if spare[tier] > 0 else 0.0
            excess -= given
        return Overload(load, count, shares)


def overload_cut(allowed: StepsAllowed, share: float, overload: Overload) -> StepsCut | None:
    """The cut of a job that allows ``allowed`` where its tier gives up ``share`` of what it could: the
    most steps whose denoising steps give up at least that share (None where the share is nothing, or
    what it asked already does)."""
    if not allowed or share <= 0:
        return None
    (asked, asked_denoising), fewer = allowed[0], allowed[1:]
    target = asked_denoising - share * (asked_denoising - fewer[-1][1])
    steps, denoising = next((k, d) for k, d in fewer if d <= target + 1e-9)
    offered = f"{overload.load:.2f} x the engine's time offered over the last {overload.arrivals} arrivals"
    return StepsCut(steps, denoising, asked, f"overload: {offered}")
