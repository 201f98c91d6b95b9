"""Degrading for the load offered, not only for the queue: while requests arrive faster than the engine
serves them at full steps, every job admitted at full steps makes the ones after it later, and a cut
decided from the queue alone (engine/degradation.py) comes when the queue shows it, too late for the jobs
already started. Here the engine looks at what arrives.

Both sides in seconds of the engine's time. Served: over the engine's last ``WINDOW`` forwards taken
while it was full (its running set at ``max_running``: no idle wait counted), the token-steps (a job's
tokens times its steps) they advanced per wall-clock second between them, less the starts and decodes
the engine ran in between (as it measured them: WorkTimes.spent_s): so everything the process spends per
forward (the answers, the server beside it on the same cores) is in the rate, and a cut, which saves
steps but no start or decode, does not lower it. Offered: over the last ``WINDOW`` arrivals, each one's
token-steps at that rate plus a start and a decode (the engine's averages, ``fixed_s``), over the time
since the oldest of them entered (their entry stamps: a request Triton held while the model's door was
full counts from when it got in, so a load above the door's is under-counted, never over). The load is
their ratio.

It counts as overload only where it is shown: its lower bound, less two standard errors of the work
offered (requests are the counts: a request's images arrive together; the error of a sum of unequal
requests is ``sqrt(sum x^2) / sum x`` of it), is above 1, with at least ``LEAST`` arrivals and ``LEAST``
forwards seen; and the newest ``LEAST`` arrivals alone still ask more than the engine serves (a burst that
has passed cuts nobody). Then the work above ``CUT_TARGET`` of the engine's time is taken from the jobs
that allow fewer steps and have a deadline, the lowest tier first: a share per tier of what its arrivals
could give up, the next tier only where the lower ones' all is not enough. Each waiting job of a tier
then runs the most steps allowed that give up its tier's share (at least); the deadline rule may cut it
more, never less, and a waiting job's cut is decided again at every engine step. Otherwise nobody is cut
for the load. The scheduler's clock must be the one requests are stamped on (``time.perf_counter``).

The other side, headroom: the engine has the headroom the load's cut aims at unless it is shown short of
it, by a lower bound as an overload is (less two standard errors, each request one count): the window's
(at least ``LEAST`` arrivals and forwards) above ``CUT_TARGET`` of what the engine serves, or that of its
newest 32 or newest 64 arrivals (``NEWEST``) above what it serves (a load that rose after a quieter
spell, which the window still averages with the quiet). Degrading is what must be shown, not the room:
the bursts that a steady load below capacity brings now and then are seldom read as a lack of room, so
there a request runs what it asked, as without the feature (a few late in such a burst, as without it).
The price: where the load is a little above what the engine serves, the deadline rule acts less often
than where the point estimates decided, and after a rise from a quiet spell it acts once a bound shows the
rise (docs/design/degradation.md has how often each is read, from scripts/headroom_rule.py). A
request's images are one count: traffic of several images a request is burstier, so below capacity it
reads no headroom more often, and above it less often. With headroom no job is newly degraded: none is cut for
a deadline, its own or a later job's, and none is given a step cache (the scheduler's ``_cut_steps`` and
``_cache_late``). A job cut before keeps its cut where it or the job it was cut for needs it
(engine/degradation.py ``with_headroom``): taking a cut back that a job was let in on would let it run
and expire. With too few arrivals or forwards seen to tell, there is no headroom (the deadline rule
decides).
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
# The newest arrivals whose bound alone can show that the load rose (headroom): 32 show a sharp rise soon,
# 64 a milder one. With one image a request, evenly spaced, read one spacing after the last arrival the
# newest 32 show a load from 1.55 x what the engine serves (1 / (1 - 2 / sqrt(32))), the newest 64 from
# 1.33 x; read at an arrival's instant (n arrivals over n - 1 spacings), from 1.50 x and 1.31 x.
NEWEST = (LEAST, 2 * LEAST)


@dataclass(frozen=True)
class Arrival:
    """One job as it arrived: when (its request's entry stamp), its request, its tier, the token-steps it
    asked (tokens x denoising steps) and those it may give up (none where it allows no fewer steps, or
    sends no deadline: the load's cut is for deadlines)."""

    at: float
    request: str
    tier: int
    work: int
    spare: int


def arrival_of(job: Job) -> Arrival:
    allowed, asked, tokens = job.steps_allowed, job.remaining, job.spec.tokens
    spare = (asked - allowed[-1][1]) * tokens if allowed and job.spec.deadline is not None else 0
    return Arrival(job.request.entered, job.request.request_id, job.spec.tier, asked * tokens, spare)


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
        # Per full forward: the seconds since the one before, those of them the engine spent on starts and
        # decodes, and the token-steps it advanced.
        self.forwards: deque[tuple[float, float, int]] = deque(maxlen=window)
        self._last: float | None = None  # when the last full forward ended
        self._spent = 0.0  # the engine's seconds spent on starts and decodes, as of the last forward
        # view()'s last reading: ((now, fixed_s), the overload shown, headroom)
        self._view: tuple[tuple[float, float], Overload | None, bool] | None = None

    def arrived(self, arrival: Arrival) -> None:
        self.arrivals.append(arrival)
        self._view = None

    def view(self, now: float, fixed_s: float) -> tuple[Overload | None, bool]:
        """The overload shown at ``now`` (None: none) and whether the load leaves headroom, read once for
        an instant and ``fixed_s`` (the scheduler looks several times an engine step) until an arrival or
        a full forward is recorded."""
        if self._view is None or self._view[0] != (now, fixed_s):
            # Headroom: the window's bound at most 0.9 of what the engine serves, so no overload.
            headroom = self.headroom(now, fixed_s)
            self._view = ((now, fixed_s), None if headroom else self.overload(now, fixed_s), headroom)
        return self._view[1], self._view[2]

    def served(self, now: float, token_steps: int, spent_s: float, full: bool) -> None:
        """A forward that advanced ``token_steps`` ended at ``now``; ``spent_s``: the engine's seconds spent
        on starts and decodes so far (WorkTimes.spent_s: those since the last forward are taken out of
        the window's time, a start of a job that never finishes included); ``full``: the engine was full.
        Only a full forward after a full one is counted (the time between them held no idle wait). They
        come out of the window's sum, not each interval's: on a GPU a start's or decode's seconds are
        recorded once the device has passed it (engine/stopwatch.py), a step or more after it ran."""
        if full and self._last is not None:
            self.forwards.append((max(now - self._last, 0.0), spent_s - self._spent, token_steps))
            self._view = None
        self._last, self._spent = (now if full else None), spent_s

    def _rate(self, least: int) -> float | None:
        """Token-steps a second over the full forwards seen (None: fewer than ``least`` arrivals or
        forwards seen, too few to tell)."""
        # The steps' own time: between the forwards, less the starts and decodes run there.
        served_s = sum(seconds - spent for seconds, spent, _ in self.forwards)
        if len(self.arrivals) < least or len(self.forwards) < least or served_s <= 0:
            return None
        return sum(token_steps for _, _, token_steps in self.forwards) / served_s

    def headroom(self, now: float, fixed_s: float, least: int = LEAST) -> bool:
        """Whether the load offered at ``now`` leaves headroom: neither the window's lower bound above
        ``CUT_TARGET`` of what the engine serves nor that of its newest arrivals (each count of
        ``NEWEST``) above it. False where too few arrivals or forwards were seen to tell."""
        rate = self._rate(least)
        if rate is None:
            return False
        arrivals = list(self.arrivals)
        window = _load(arrivals, now, rate, fixed_s, bound=True)
        newest = [_load(arrivals[-count:], now, rate, fixed_s, bound=True) for count in NEWEST]
        if window is None or window > CUT_TARGET:
            return False
        return all(load is not None and load <= 1.0 for load in newest)

    def overload(self, now: float, fixed_s: float, least: int = LEAST) -> Overload | None:
        """The overload shown at ``now``, or None (``fixed_s``: a job's start and decode)."""
        rate = self._rate(least)
        if rate is None:
            return None
        arrivals = list(self.arrivals)
        load = _load(arrivals, now, rate, fixed_s, bound=True)
        if load is None or load <= 1.0 or (_load(arrivals[-least:], now, rate, fixed_s) or 0.0) <= 1.0:
            return None
        offered = sum(a.work / rate + fixed_s for a in arrivals)
        span = now - min(a.at for a in arrivals)
        spare: dict[int, float] = {}
        for a in arrivals:
            spare[a.tier] = spare.get(a.tier, 0.0) + a.spare / rate
        excess = offered - CUT_TARGET * span
        shares: dict[int, float] = {}
        for tier in sorted(spare, reverse=True):  # the lowest tier (the highest rank) first
            given = min(excess, spare[tier])
            shares[tier] = given / spare[tier] if spare[tier] > 0 else 0.0
            excess -= given
        return Overload(offered / span, len(arrivals), shares)


def _load(
    arrivals: list[Arrival], now: float, rate: float, fixed_s: float, bound: bool = False
) -> float | None:
    """Seconds of work offered per second since the oldest of ``arrivals`` entered (None: no time yet);
    with ``bound``, less two standard errors of the work (each request one count, of its images' work)."""
    span = now - min(a.at for a in arrivals)
    if span <= 0:
        return None
    offered = sum(a.work for a in arrivals) / rate + fixed_s * len(arrivals)
    if not bound:  # the point estimate, looked at every engine step: no grouping by request
        return offered / span
    by_request: dict[str, float] = {}
    for a in arrivals:
        by_request[a.request] = by_request.get(a.request, 0.0) + a.work / rate + fixed_s
    error = math.sqrt(sum(x * x for x in by_request.values())) / offered
    return offered * (1 - 2 * error) / span


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
    return StepsCut(steps, denoising, asked, f"overload: {offered}", "overload")
