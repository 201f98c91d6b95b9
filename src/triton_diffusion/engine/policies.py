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

When waiting jobs join a busy running set is :class:`AdmissionPacing`'s choice (below).
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


@dataclass(frozen=True)
class AdmissionPacing:
    """When waiting jobs join a running set that is already denoising.

    Admitting is not free: the text encoders run once for everyone admitted together, and jobs admitted
    together (with the same steps) finish together and share one VAE decode. Both calls have a large fixed
    cost, and every running row stalls while they run. Under random arrivals, admitting each newcomer the
    moment a place frees makes every step pay a batch-1 encode and a batch-1 decode (measured on CPU: the
    engine's capacity fell below the request-level engine's). So a busy engine admits once ``cohort``
    places are free (newcomers then start, and later finish, as a cohort), or once the oldest waiting job
    has waited ``max_wait_steps`` engine steps (no job waits long for a cohort that does not form). An
    idle engine admits at once, and at low load places are free, so a newcomer still starts at the next
    step. ``cohort`` 1 admits whenever there is room.
    """

    cohort: int = 1
    max_wait_steps: int = 8

    def __post_init__(self) -> None:
        if self.cohort < 1 or self.max_wait_steps < 0:
            raise ValueError(f"admission cohort must be >= 1 and max_wait_steps >= 0, got {self}")

    def due(self, running: int, room: int, oldest_wait_steps: int) -> bool:
        """Whether to admit now, with ``running`` jobs running, ``room`` places free and the oldest
        waiting job having waited through ``oldest_wait_steps`` engine steps (0: it arrived during the
        last one)."""
        return running == 0 or room >= self.cohort or oldest_wait_steps >= self.max_wait_steps
