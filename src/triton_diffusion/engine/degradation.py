"""Degrading a row instead of refusing its request: under overload, a job that may run fewer denoising
steps is given the most steps with which it meets its deadline.

A job's allowance is its ``steps_allowed`` (engine/jobs.py): every ``num_inference_steps`` it may run, the
one its request asked for first, then fewer, down to its request's ``min_inference_steps`` (or its
tier's ``degrade_tiers`` default), each with the denoising steps it makes (an image start runs the
part its strength leaves). Empty: it is never degraded.

The rule (the scheduler applies it at every engine step, before refusals and admission: scheduler.py):
the jobs held, in the order they go (tier, least slack, the policy's own); each job still waiting, with
a deadline and an allowance, is given the most steps for which the engine's estimate (the one refusals
use: its forwards after the work that goes before it, its start and its decode) finishes it in time.

- Only when a deadline needs it: its own, or (below) a later job's. Where what it asked meets its
  deadline and no later job needs room, it runs what it asked (a queue with room degrades nobody); where
  the load offered leaves headroom (engine/overload.py ``OfferedLoad.headroom``), no job is newly cut
  (one cut before keeps what it needs: :func:`with_headroom`). Where
  no allowed count meets its deadline, a job not cut yet is not degraded (a cut that saves nobody is not
  made: it is refused or expires as without degradation); one cut already keeps its fewest steps.
- Lower tiers first: they go after the higher ones, so the higher tiers' work counts ahead of them and
  they are the ones whose deadlines need a cut. Its order is by the steps it asked (a cut would give it
  slack and move it behind the jobs it was cut for), and a job the walk cut is not refused.
- As little as it can: the most steps that meet the deadline, the fewest cut.
- Room for a later job: one still late even at its fewest steps (or, allowing none, at what it asked)
  has waiting jobs ahead of it that are in time, of its tier or lower, cut to make room for it
  (``make_room``); none is cut where that does not bring it in time, a job late itself is never cut for
  another, and a higher tier is never cut for a lower one. A job between the one cut and the late one is
  still priced with the cut's work counted in full (the walk goes once): it may be cut more than it needs
  at that step; the next step decides again, unless it was admitted in that step (a started job's
  schedule is fixed).
- Decided again at each engine step until the job is admitted (a queue that drains in the meantime gives
  it back what it asked); once it starts, its schedule is fixed (its scheduler's timesteps are made for
  its steps: it equals ``pipeline(num_inference_steps=k)`` for the k it runs).

Beside the queue, the load offered (engine/overload.py): while arrivals are shown to ask more than the
engine serves, a waiting job runs at most the steps its tier's share of the excess leaves.

A job whose request allows a step cache (``degrade_step_cache``, a DiT family's) is also given it, for
the steps it has left, once it runs and the same estimate says it misses its own deadline at full compute
(:func:`cache_for_deadline`, the scheduler's ``_cache_late``): from that step on its rows run as
diffusers' own cache enabled at that step would run them (adapters/step_caches.py), and it keeps it. Only
for its own deadline, never to make room for another: what a cache saves depends on how the image changes
from step to step, unknown before it runs, so no estimate says whether it would bring another in time.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from triton_diffusion.step_cache_spec import parse_step_cache

if TYPE_CHECKING:
    from triton_diffusion.engine.jobs import Job

# Every num_inference_steps a job may run, with the denoising steps each makes: (steps, denoising).
StepsAllowed = tuple[tuple[int, int], ...]
# A cut aims at this share of the time left, not all of it: the estimate is an average, and a cut sized to
# the last millisecond would miss its deadline by the noise of a step or two.
CUT_TARGET = 0.9


@dataclass(frozen=True)
class StepsCut:
    """A job given fewer steps than its request asked for, and why (BATCH ``degraded``)."""

    steps: int  # the num_inference_steps it runs with
    denoising: int  # the denoising steps that makes
    asked: int  # the num_inference_steps its request asked for
    reason: str
    # Which rule cut it: "deadline" (its own), "room" (a later job's), "overload" (the load offered,
    # engine/overload.py: not a promise that it is in time, so a newcomer cut so is still judged for refusal).
    rule: Literal["deadline", "room", "overload"] = "deadline"

    def report(self) -> dict[str, int | str]:
        return {"steps_run": self.steps, "steps_asked": self.asked, "reason": self.reason}


@dataclass(frozen=True)
class CacheGiven:
    """A running job given a step cache for its steps left, and why (BATCH ``degraded``)."""

    step_cache: str  # the cache's canonical text (``fbc:0.2``)
    from_step: int  # the denoising steps it had done without it
    reason: str

    def report(self) -> dict[str, int | str]:
        return {"step_cache": self.step_cache, "cached_from_step": self.from_step, "reason": self.reason}


def cache_for_deadline(
    step_cache: str, steps_done: int, steps_left: int, finish_s: float, time_left_s: float
) -> CacheGiven | None:
    """The cache a running job is given where the estimate ``finish_s`` of its ``steps_left`` at full
    compute misses ``time_left_s`` (None where it is in time, or where too few steps are left for the cache
    to skip any: a fresh FBC computes its first step, a TaylorSeer its warm-up)."""
    first_skip = parse_step_cache(step_cache).first_skip
    if first_skip is None or steps_left <= first_skip or finish_s <= time_left_s:
        return None
    left_ms = max(time_left_s, 0) * 1000
    why = f"deadline: {steps_left} steps left estimated {finish_s * 1000:.0f} ms, {left_ms:.0f} ms left"
    return CacheGiven(step_cache, steps_done, why)


def may_cache(job: Job) -> bool:
    """Whether ``job`` may still be given a step cache: its request allows one, it was given none and the
    adapter did not refuse it one."""
    return bool(job.spec.degrade_cache) and job.queue.cache_given is None and not job.queue.cache_refused


def late_caches(
    held: Sequence[Job], started: Collection[int], now: float, finish_s: Callable[[Job, int], float]
) -> list[tuple[Job, CacheGiven]]:
    """The caches to give: ``held`` in the order jobs go, each started job (by id) that may be given one
    and has a deadline, given it where ``finish_s(job, token-steps ahead of it)`` at full compute misses
    its deadline (:func:`cache_for_deadline`)."""
    given = []
    ahead = 0
    for job in held:
        if id(job) in started and may_cache(job) and job.spec.deadline is not None:
            cache, finish = job.spec.degrade_cache, finish_s(job, ahead)
            assert cache is not None  # may_cache
            cut = cache_for_deadline(
                cache, job.run.steps_done, job.remaining, finish, job.spec.deadline - now
            )
            if cut is not None:
                given.append((job, cut))
        ahead += job.remaining * job.spec.tokens
    return given


def cut_for_deadline(
    allowed: StepsAllowed,
    finish_s: Callable[[int], float],
    time_left_s: float,
    previous: StepsCut | None = None,
) -> StepsCut | None:
    """The cut that lets a job meet its deadline: the most steps of ``allowed`` (what it asked first, then
    fewer) whose estimate ``finish_s(denoising steps)`` is within ``CUT_TARGET`` of ``time_left_s`` (where
    none is, the fewest steps that are within the time left). None where what it asked fits the time
    left (no cut needed: the rule refusals use) or where nothing allowed fits it (no cut saves it)."""
    if not allowed:
        return None
    (asked, asked_denoising), fewer = allowed[0], allowed[1:]
    full_s = finish_s(asked_denoising)
    if full_s <= time_left_s:
        return None
    why = f"{asked} steps estimated {full_s * 1000:.0f} ms, {max(time_left_s, 0) * 1000:.0f} ms left"
    if not fewer or finish_s(fewer[-1][1]) > time_left_s:
        # Not even the fewest steps allowed are in time: a job not cut yet is left as it asked (refused
        # or expiring as without degradation); one cut already keeps the fewest (given back what it asked,
        # it would run the most work and expire, after counting at full size before every later job).
        if previous is None or not fewer:
            return None
        return StepsCut(*fewer[-1], asked, f"deadline: {why}; even {fewer[-1][0]} steps late")
    # The estimate grows with the steps: search (most steps first) for the first within the target.
    low, high = 0, len(fewer) - 1
    while low < high:
        middle = (low + high) // 2
        if finish_s(fewer[middle][1]) <= time_left_s * CUT_TARGET:
            high = middle
        else:
            low = middle + 1
    steps, denoising = fewer[low]
    return StepsCut(steps, denoising, asked, f"deadline: {why}")


def with_headroom(
    allowed: StepsAllowed, finish_s: Callable[[int], float], time_left_s: float, previous: StepsCut
) -> StepsCut | None:
    """A cut made before, decided again while the load leaves headroom (no job is newly cut then): one
    made for a later job's deadline is kept as it is (that job was let in on it); one for its own is
    given back what it asked only where that is within ``CUT_TARGET`` of the time left (given back, it
    would not be cut again), else decided again by :func:`cut_for_deadline` (kept where that finds
    nothing)."""
    if previous.rule == "room":
        return previous
    if finish_s(allowed[0][1]) <= time_left_s * CUT_TARGET:
        return None
    return cut_for_deadline(allowed, finish_s, time_left_s, previous) or previous


def room_for(
    late_in: Callable[[int], float],
    time_left_s: float,
    candidates: Sequence[tuple[StepsAllowed, int, int]],
    why: str,
) -> list[StepsCut | None]:
    """Cuts of the jobs ahead of a late job that bring it within ``CUT_TARGET`` of ``time_left_s``, taken
    from ``candidates`` in the order given (the scheduler gives the lowest tier first, the last in order
    first): each cut as far as its allowance goes before the next is touched, the last one as little as
    it can (greedy by that order: not the fewest steps over all of them where their tokens differ).
    ``candidates``: each job's (allowance, denoising steps it runs now, tokens per step);
    ``late_in(freed)``: the late job's estimate once ``freed`` token-steps ahead of it are gone;
    ``why``: each cut's reason.

    One entry per candidate: its new cut (None: not cut further). All None where even every candidate at
    its fewest steps leaves the late job late: a cut that saves nobody is not made."""
    target = time_left_s * CUT_TARGET
    cuts: list[StepsCut | None] = [None] * len(candidates)
    freed = 0
    for i, (allowed, runs, tokens) in enumerate(candidates):
        fewer = [(k, d) for k, d in allowed[1:] if d < runs]
        if not fewer:
            continue
        if late_in(freed + (runs - fewer[-1][1]) * tokens) > target:
            freed += (runs - fewer[-1][1]) * tokens
            cuts[i] = StepsCut(*fewer[-1], allowed[0][0], why, "room")
            continue
        # This one is enough: the most steps of it that are (bisection: the estimate falls with the cut).
        low, high = 0, len(fewer) - 1
        while low < high:
            middle = (low + high) // 2
            if late_in(freed + (runs - fewer[middle][1]) * tokens) <= target:
                high = middle
            else:
                low = middle + 1
        cuts[i] = StepsCut(*fewer[low], allowed[0][0], why, "room")
        return cuts
    return [None] * len(candidates)


def make_room(
    job: Job, cuttable: list[Job], after: Callable[[int, int], float], left: float, steps: int
) -> list[tuple[Job, StepsCut]]:
    """The cuts of the waiting jobs ``cuttable`` (passed in the walk, each in time) of ``job``'s tier or
    lower that bring ``job`` within ``CUT_TARGET`` of ``left`` at ``steps`` (its fewest allowed, or what
    it asked): the lowest tier and last in order first, each to its fewest steps before the next is
    touched, the last as little as it can (``room_for``); none where they cannot. ``after(freed,
    steps)``: ``job``'s estimate with ``freed`` token-steps fewer ahead of it. The scheduler applies
    them."""
    ranked = [(c.spec.tier, i, c) for i, c in enumerate(cuttable) if c.spec.tier >= job.spec.tier]
    others = [c for _, _, c in sorted(ranked, key=lambda entry: entry[:2], reverse=True)]
    late_ms, left_ms = after(0, steps) * 1000, max(left, 0) * 1000
    why = f"deadline of another image after it: estimated {late_ms:.0f} ms, {left_ms:.0f} ms left"
    cuts = room_for(
        lambda freed: after(freed, steps),
        left,
        [(c.steps_allowed, c.remaining, c.spec.tokens) for c in others],
        why,
    )
    return [(other, cut) for other, cut in zip(others, cuts, strict=True) if cut is not None]


def degraded_report(jobs: Sequence[Job]) -> dict[str, int | str | list[str]]:
    """BATCH ``degraded`` of a request's images: the fewest steps one ran (``steps_run``, ``steps_asked``)
    and the step cache one was given from the earliest step (``step_cache``, ``cached_from_step``), with
    their reasons; ``rules``, every rule that degraded one of them (``deadline``: its own, ``room``: a
    later job's, ``overload``: the load offered; a cache is only ever given for its own), for a program to
    read where the reasons are for people; and ``images``, how many of them were degraded (each is its own
    job, decided for its own deadline)."""
    report: dict[str, int | str | list[str]] = {}
    reasons = []
    cuts = [job.queue.cut for job in jobs if job.queue.cut is not None]
    if cuts:
        report.update(min(cuts, key=lambda cut: cut.steps).report())
        reasons.append(str(report["reason"]))
    caches = [job.queue.cache_given for job in jobs if job.queue.cache_given is not None]
    if caches:
        report.update(min(caches, key=lambda cache: cache.from_step).report())
        reasons.append(str(report["reason"]))
    report["reason"] = "; ".join(reasons)
    report["rules"] = sorted({cut.rule for cut in cuts} | ({"deadline"} if caches else set()))
    report["images"] = sum(job.degraded for job in jobs)
    return report


def steps_allowed(
    asked: int, least: int, denoising: Callable[[int], int], runs: Callable[[int], bool]
) -> StepsAllowed:
    """A request's allowance: ``asked`` steps, then every count down to ``least`` that the model ``runs``
    (one with no denoising step, or a single step a scheduler cannot take, is left out), each with the
    denoising steps it makes. Empty where nothing fewer is allowed."""
    fewer = [(k, denoising(k)) for k in range(asked - 1, least - 1, -1) if runs(k) and denoising(k) >= 1]
    return ((asked, denoising(asked)), *fewer) if fewer else ()
