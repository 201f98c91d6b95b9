"""Degrading for the load offered, not only for the queue: while requests arrive faster than the engine
serves them at full steps, every job admitted at full steps makes the ones after it later, and a cut
decided from the queue alone (engine/degradation.py) comes when the queue shows it, too late for the jobs
already started. Here the engine looks at what arrives.

Two rates, both measured, in token-steps (a job's tokens times its denoising steps: what a forward
computes). Offered: over the last ``WINDOW`` arrivals, by their true arrival stamps, the token-steps they
asked over the time they arrived in. Served: over the engine's last ``WINDOW`` forwards taken while it was
full (its running set at ``max_running``: no idle time counted), the token-steps they advanced over the
wall-clock time between them, so everything the engine's process spends per forward (starts, decodes,
the answers, the server beside it) is in it, not only the forward. The load is their ratio. It counts as
overload only where it is shown: its lower bound, the arrivals counted less two of their standard errors
(Poisson counts: a share of ``2 / sqrt(n)``), still above 1, with at least ``LEAST`` arrivals and
``LEAST`` forwards seen (a cut for a load that is not there would cost images their steps for nothing;
at 0.8 of what the engine serves over 128 arrivals, the bound is about 0.66). Then the
token-steps above ``CUT_TARGET`` of what the engine serves are taken from the jobs that allow fewer steps
and have a deadline, the lowest tier first: a share per tier of what its arrivals could give up, the next
tier only where the lower ones' all is not enough. Each waiting job of a tier then runs the most steps
allowed that give up its tier's share (at least); the deadline rule may cut it more, never less.
Otherwise nobody is cut for the load.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from triton_diffusion.engine.degradation import CUT_TARGET, StepsAllowed, StepsCut

if TYPE_CHECKING:
    from triton_diffusion.engine.jobs import Job

# Arrivals (and full forwards) the rates are measured over (the newest), and the fewest they are
# measured with.
WINDOW = 128
LEAST = 32


@dataclass(frozen=True)
class Arrival:
    """One job as it arrived: when (its request's stamp), its tier, its tokens, the denoising steps it
    asked and the fewest it may run (``steps`` where it allows none, or sends no deadline: nothing of it
    is cut for the load)."""

    at: float
    tier: int
    tokens: int
    steps: int
    fewest: int


def arrival_of(job: Job) -> Arrival:
    """A job as it arrives: what it asked, and the fewest steps it may run where it has a deadline (the
    load's cut is for deadlines)."""
    allowed, asked = job.spec.steps_allowed, job.remaining
    fewest = allowed[-1][1] if allowed and job.spec.deadline is not None else asked
    return Arrival(job.request.entered, job.spec.tier, job.spec.tokens, asked, fewest)


@dataclass(frozen=True)
class Overload:
    """The load offered, shown above what the engine serves: ``load``, their ratio (its point estimate),
    and by tier the share of what its jobs could give up that they do."""

    load: float
    arrivals: int
    shares: dict[int, float]


class OfferedLoad:
    """The newest arrivals and the engine's newest full forwards (the scheduler's, on its thread)."""

    def __init__(self, window: int = WINDOW) -> None:
        self.arrivals: deque[Arrival] = deque(maxlen=window)
        self.forwards: deque[tuple[float, int]] = deque(
            maxlen=window
        )  # (seconds since the last, token-steps)
        self._last: float | None = None  # when the last full forward ended

    def arrived(self, arrival: Arrival) -> None:
        self.arrivals.append(arrival)

    def served(self, now: float, token_steps: int, full: bool) -> None:
        """A forward that advanced ``token_steps`` ended at ``now``; ``full``: the engine was full. Only a
        full forward after a full one is counted (the time between them held no idle wait)."""
        if full and self._last is not None:
            self.forwards.append((now - self._last, token_steps))
        self._last = now if full else None

    def overload(self, now: float, least: int = LEAST) -> Overload | None:
        """The overload shown at ``now``, or None."""
        arrivals = list(self.arrivals)
        count = len(arrivals)
        span = now - arrivals[0].at if arrivals else 0.0
        served_s = sum(seconds for seconds, _ in self.forwards)
        if count < least or len(self.forwards) < least or span <= 0 or served_s <= 0:
            return None
        rate = sum(token_steps for _, token_steps in self.forwards) / served_s  # token-steps per second
        offered = sum(a.steps * a.tokens for a in arrivals)
        load = offered / (span * rate)
        if load * (1 - 2 / math.sqrt(count)) <= 1.0:
            return None
        spare: dict[int, int] = {}
        for a in arrivals:
            spare[a.tier] = spare.get(a.tier, 0) + (a.steps - a.fewest) * a.tokens
        excess = offered - CUT_TARGET * span * rate
        shares: dict[int, float] = {}
        for tier in sorted(spare, reverse=True):  # the lowest tier (the highest rank) first
            given = min(excess, spare[tier])
            shares[tier] = given / spare[tier] if spare[tier] > 0 else 0.0
            excess -= given
        return Overload(load, count, shares)


def overload_cut(allowed: StepsAllowed, share: float, overload: Overload) -> StepsCut | None:
    """The cut of a job that allows ``allowed`` where its tier gives up ``share`` of what it could: the
    most steps whose denoising steps give up at least that share (None where the share is nothing)."""
    if not allowed or share <= 0:
        return None
    (asked, asked_denoising), fewer = allowed[0], allowed[1:]
    target = asked_denoising - min(share, 1.0) * (asked_denoising - fewer[-1][1])
    steps, denoising = next((k, d) for k, d in fewer if d <= target + 1e-9)
    offered = (
        f"{overload.load:.2f} x what the engine serves offered over the last {overload.arrivals} arrivals"
    )
    return StepsCut(steps, denoising, asked, f"overload: {offered}")
