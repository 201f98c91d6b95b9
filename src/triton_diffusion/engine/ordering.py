"""The scheduler's swappable parts, each declared once (name, parameters, doc): the scheduling policy
(which group of running jobs steps next and in what order), service tiers and deadlines (who goes first
across groups, who is paused, who ages), and admission pacing (when newcomers join a busy running set).
settings.py takes the policy names and docs from :data:`POLICIES`; docs/reference/config.md is made
from settings.py.

Order, for admission, pausing and each forward alike: a job's *effective tier* first (its tier, raised by
aging), then within a tier jobs with a deadline by least slack (deadline minus the estimated time to
finish it), then the policy's own order. With one tier and no deadlines this is the policy alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol, TypeVar


class Served(Protocol):
    """A job's service, as its spec says (engine/jobs.py's JobSpec)."""

    @property
    def tier(self) -> int: ...

    @property
    def deadline(self) -> float | None: ...


class Queued(Protocol):
    """A job's place and waits (engine/jobs.py's Queue)."""

    @property
    def arrived(self) -> int: ...  # order of arrival at the engine

    @property
    def admitted(self) -> int: ...  # order of admission to the running set

    @property
    def waited_since(self) -> int: ...  # the engine step at which it last stepped (or was admitted)

    @property
    def waited_s(self) -> float: ...

    @property
    def ready_at(self) -> float | None: ...  # since when it waits or is paused (None while it runs)


class Running(Protocol):
    """Where a job is (engine/jobs.py's Run)."""

    @property
    def group(self) -> Hashable: ...

    @property
    def steps_done(self) -> int: ...


class Schedulable(Protocol):
    """What the policies and the service order jobs by (engine/jobs.py's Job)."""

    @property
    def run(self) -> Running: ...

    @property
    def spec(self) -> Served: ...

    @property
    def queue(self) -> Queued: ...

    @property
    def remaining(self) -> int:
        """Denoising steps left."""


J = TypeVar("J", bound=Schedulable)


class Policy:
    """A scheduling policy: the order of jobs within a forward's group, and which group goes next. The
    default group is the one of the first job in order."""

    name: ClassVar[str]
    doc: ClassVar[str]

    def job_key(self, job: Schedulable) -> tuple:
        return (job.queue.admitted,)

    def choose_group(self, groups: Mapping[Hashable, Sequence[Schedulable]], first: Schedulable) -> Hashable:
        return first.run.group

    def picked(self, group: Hashable) -> None:
        """The group that stepped (whoever chose it: this policy, or the starvation bound)."""


class Oldest(Policy):
    name, doc = "oldest", "the group of the oldest job; oldest jobs first (FIFO, the default)"


class RoundRobin(Policy):
    name, doc = "round_robin", "groups take turns; oldest jobs first within one"

    def __init__(self) -> None:
        self._last: Hashable = None

    def choose_group(self, groups: Mapping[Hashable, Sequence[Schedulable]], first: Schedulable) -> Hashable:
        ordered = sorted(groups, key=lambda g: min(j.queue.admitted for j in groups[g]))
        if len(ordered) > 1 and self._last in ordered:
            return ordered[(ordered.index(self._last) + 1) % len(ordered)]
        return ordered[0]

    def picked(self, group: Hashable) -> None:
        self._last = group


class FewestRemaining(Policy):
    name = "fewest_remaining"
    doc = "the job closest to done and its group; fewest remaining steps first (SRPT: lowest mean latency)"

    def job_key(self, job: Schedulable) -> tuple:
        return (job.remaining, job.queue.admitted)


class Largest(Policy):
    name, doc = "largest", "the group with the most jobs (SGLang's default: fullest forwards)"

    def choose_group(self, groups: Mapping[Hashable, Sequence[Schedulable]], first: Schedulable) -> Hashable:
        return max(groups, key=lambda g: (len(groups[g]), -min(j.queue.admitted for j in groups[g])))


class FirstStepFirst(Policy):
    name = "first_step_first"
    doc = "jobs that have not stepped yet first, then the oldest (lowest time to the first step)"

    def job_key(self, job: Schedulable) -> tuple:
        return (job.run.steps_done > 0, job.queue.admitted)


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Oldest, RoundRobin, FewestRemaining, Largest, FirstStepFirst)
}


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {name!r}")
    return POLICIES[name]()


@dataclass(frozen=True)
class Service:
    """Service tiers, deadlines and aging.

    ``tiers``: the tier names, highest first (a job's ``tier`` is its rank). ``aging_s``: every this many
    seconds a job has spent waiting or paused (in all, never reset) raise it one tier, up to one above the
    highest: a job that has waited ``(rank + 1) x aging_s`` outranks every job that has not, is never
    paused again for another (pausing needs a strictly higher tier), and is served in the policy's order
    among such jobs (the starvation bound; 0: no aging). ``refuse_late``: a job whose deadline the estimate
    says it cannot meet is refused at admission (deadline_policy ``refuse``), else it runs anyway
    (``best_effort``). ``pause_by``: when a job of a higher tier pauses a running job of a lower one (the
    running set full) or skips the admission cohort: ``tier``, always; ``deadline``, only where the
    scheduler's estimate of its finish, waiting, is not within 90% of its time left, or while the load is
    shown above capacity (engine/overload.py), and always for a job without a deadline."""

    tiers: tuple[str, ...] = ("priority", "default", "flex")
    aging_s: float = 0.0
    refuse_late: bool = True
    pause_by: Literal["tier", "deadline"] = "tier"

    def effective_tier(self, job: Schedulable, now: float) -> int:
        if self.aging_s <= 0:
            return job.spec.tier
        waited = job.queue.waited_s + (now - job.queue.ready_at if job.queue.ready_at is not None else 0.0)
        return max(job.spec.tier - math.floor(waited / self.aging_s), -1)

    def key(self, job: J, now: float, finish_s: Callable[[J], float]) -> tuple:
        """The service part of a job's order: effective tier, then least slack (jobs without a deadline
        after those with one)."""
        deadline = job.spec.deadline  # read once: this runs for every held job at every engine step
        slack = math.inf if deadline is None else deadline - now - finish_s(job)
        return (self.effective_tier(job, now), slack)

    def victim_key(self, job: J, now: float, finish_s: Callable[[J], float]) -> tuple:
        """Which running job is paused first (largest first): the lowest effective tier, then the most
        slack (no deadline: the most), then the most remaining work."""
        slack = math.inf if job.spec.deadline is None else job.spec.deadline - now - finish_s(job)
        return (self.effective_tier(job, now), slack, job.remaining)


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
    step. ``cohort`` 1 admits whenever there is room. A job of a higher tier than some running job is
    not held back for a cohort (the scheduler admits it at once, pausing a lower one if it must), under
    ``Service.pause_by`` deadline only where its deadline needs it.
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
