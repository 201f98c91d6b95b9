"""Which jobs the step engine runs in the next forward: a named, configurable scheduling policy.

Only jobs of one group (same latent shape) can share a forward, so each step the policy picks a group
and, if the group holds more jobs than the forward's cap, which of them go. Policies:

- ``oldest``: the group of the oldest job; oldest jobs first (FIFO, the default),
- ``round_robin``: groups take turns; oldest jobs first within one,
- ``fewest_remaining``: the job closest to done and its group; fewest remaining steps first (SRPT:
  favours finishing work, lowest mean latency),
- ``largest``: the group with the most jobs (SGLang's default: fullest forwards),
- ``first_step_first``: jobs that have not stepped yet first, then the oldest (lowest time to the first
  step when the running set holds more jobs than one forward).

Whatever the policy, no job starves: a job that has not stepped for ``starvation_steps`` engine steps
is served next, its group with it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol


class Schedulable(Protocol):
    group: Hashable
    arrival: int  # admission order
    remaining: int  # steps left
    steps_done: int
    waited_since: int  # the engine step at which it last stepped (or was admitted)


def _oldest(job: Schedulable) -> tuple:
    return (job.arrival,)


def _fewest_remaining(job: Schedulable) -> tuple:
    return (job.remaining, job.arrival)


def _first_step_first(job: Schedulable) -> tuple:
    return (job.steps_done > 0, job.arrival)


@dataclass
class SchedulingPolicy:
    name: str
    job_order: Callable[[Schedulable], tuple]
    starvation_steps: int = 16
    _last_group: Hashable = None

    def pick(
        self, running: Sequence[Schedulable], cap_for: Callable[[Hashable], int], step: int
    ) -> list[Schedulable]:
        """The jobs of the next forward: one group, at most ``cap_for(group)`` jobs."""
        if not running:
            return []
        groups: dict[Hashable, list[Schedulable]] = {}
        for job in running:
            groups.setdefault(job.group, []).append(job)
        starved = [j for j in running if step - j.waited_since >= self.starvation_steps]
        if starved:
            group = min(starved, key=lambda j: (j.waited_since, j.arrival)).group
        else:
            group = self._choose_group(groups)
        self._last_group = group
        members = groups[group]
        # Starved jobs of the group first, then the policy's order.
        members.sort(key=lambda j: (step - j.waited_since < self.starvation_steps, *self.job_order(j)))
        return members[: max(1, cap_for(group))]

    def _choose_group(self, groups: dict[Hashable, list[Schedulable]]) -> Hashable:
        if self.name == "largest":
            return max(groups, key=lambda g: (len(groups[g]), -min(j.arrival for j in groups[g])))
        if self.name == "round_robin" and len(groups) > 1:
            ordered = sorted(groups, key=lambda g: min(j.arrival for j in groups[g]))
            if self._last_group in ordered:
                return ordered[(ordered.index(self._last_group) + 1) % len(ordered)]
            return ordered[0]
        # oldest, fewest_remaining, first_step_first: the group of the first job in the policy's order
        return min((j for jobs in groups.values() for j in jobs), key=self.job_order).group


POLICIES = {
    "oldest": _oldest,
    "round_robin": _oldest,
    "fewest_remaining": _fewest_remaining,
    "largest": _oldest,
    "first_step_first": _first_step_first,
}


def make_policy(name: str, starvation_steps: int = 16) -> SchedulingPolicy:
    if name not in POLICIES:
        raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {name!r}")
    if starvation_steps < 1:
        raise ValueError(f"starvation_steps must be >= 1, got {starvation_steps}")
    return SchedulingPolicy(name, POLICIES[name], starvation_steps)
