"""How long work takes, from the engine's own measurements: what deadlines are checked against.

The step engine times every forward (by its jobs), every start and every decode. A job's time to finish
is estimated as the forwards it still needs times the forward time at the number of jobs it will share
them with, plus a start and a decode; the work queued ahead of it (jobs that go first) adds the forwards
it needs. Before anything was measured there is no estimate, and nothing is refused for it.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field

# Weight of the newest measurement in the running averages.
SMOOTHING = 0.2


@dataclass
class WorkTimes:
    """Running averages: forward seconds by the number of jobs in it (over every group, and per group: a
    group is a latent shape, whose forwards cost what its size does), start and decode seconds per job."""

    forward_s: dict[int, float] = field(default_factory=dict)
    by_group: dict[Hashable, dict[int, float]] = field(default_factory=dict)
    start_s: float | None = None  # per job started
    finish_s: float | None = None  # per job decoded

    def forward_ran(self, jobs: int, seconds: float, group: Hashable = None) -> None:
        self.forward_s[jobs] = _blend(self.forward_s.get(jobs), seconds)
        if group is not None:
            table = self.by_group.setdefault(group, {})
            table[jobs] = _blend(table.get(jobs), seconds)

    def started(self, jobs: int, seconds: float) -> None:
        if jobs:
            self.start_s = _blend(self.start_s, seconds / jobs)

    def finished(self, jobs: int, seconds: float) -> None:
        if jobs:
            self.finish_s = _blend(self.finish_s, seconds / jobs)

    @property
    def measured(self) -> bool:
        return bool(self.forward_s)

    def forward(self, jobs: int, group: Hashable = None) -> float:
        """Seconds of a forward of ``jobs`` jobs of ``group`` (its own measurements where it has any, else
        every group's): measured, else interpolated between the nearest measured sizes (linearly: a
        forward's cost grows about linearly past its fixed part), else 0."""
        times = self.by_group.get(group) or self.forward_s
        jobs = max(jobs, 1)
        if jobs in times:
            return times[jobs]
        if not times:
            return 0.0
        sizes = sorted(times)
        below = [s for s in sizes if s < jobs]
        above = [s for s in sizes if s > jobs]
        if below and above:
            low, high = below[-1], above[0]
            share = (jobs - low) / (high - low)
            return times[low] + share * (times[high] - times[low])
        nearest = below[-1] if below else above[0]
        return times[nearest] * jobs / nearest if below else times[nearest]

    def finish_in(
        self, steps: int, ahead_steps: int, cap: int, started: bool, group: Hashable = None
    ) -> float:
        """Seconds until a job with ``steps`` denoising steps to go is done, when ``ahead_steps`` job-steps
        of work go before it and a forward holds at most ``cap`` jobs: the forwards it needs (its own steps,
        or the whole work shared out ``cap`` at a time, whichever is more), each of the size the work
        fills, plus its start (unless ``started``) and its decode."""
        cap = max(cap, 1)
        forwards = max(steps, math.ceil((ahead_steps + steps) / cap))
        size = min(cap, max(1, math.ceil((ahead_steps + steps) / max(forwards, 1))))
        seconds = forwards * self.forward(size, group)
        if not started:
            seconds += self.start_s or 0.0
        return seconds + (self.finish_s or 0.0)


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
