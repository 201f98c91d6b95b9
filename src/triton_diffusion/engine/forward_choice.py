"""Which running jobs step together in the next forward (the scheduler's :meth:`Scheduler.next_forward`
calls these in turn): the group that goes (:func:`choose_group`), its jobs in order within the forward's
caps (:func:`fill`), where they are of several sizes whether they run packed (:func:`gate`), and where
a deadline needs it fewer of them (:func:`narrow`).

- The group: a job not stepped for ``starvation_steps`` engine steps goes first (its group); else the
  policy chooses among the groups of the highest tier running. A job that packs with every size also
  joins its own size's group, where jobs with a step cache keep to it; so that group steps instead where
  its own jobs go first (adapters/packed_rows.py).
- The fill: at most the group's jobs and tokens (its caps: forward_caps.py) and, of each shape, its size's
  cap; a job that does not fit is skipped for a smaller one after it, and the first always goes.
- The gate: the cost fit (estimates.py) prices the packed forward (padding included, times what packed
  forwards measured over the fit) and one forward per size; where by size is cheaper by ``PACK_MARGIN``
  and ``PACK_MIN_SAVING_S``, only the first job's size steps (the others in later forwards, as without
  packing), but for one packed forward after ``PACK_PROBE_AFTER`` of one size (to measure packing
  again); else it runs packed, as before the fit has a price. The decision and both prices go in the
  forward's report.
- Narrowing (config ``narrow_forwards``), last: where a job with a deadline would not be done within
  ``CUT_TARGET`` of its time left stepping in forwards as full as this one, and would in a smaller one,
  only a prefix of the forward's jobs in order steps: the longest that keeps it, and every job with a
  deadline before it, in time (those left out wait until starved: ``starvation_steps``; a job left out may be
  one that also joins this group). Only where the smaller forward costs at most ``NARROW_MARGIN`` more
  per token than the full one by the fit (a forward whose time grows with its rows, as a compute-bound
  GPU's at large sizes): there the rows left out lose little; where a forward's fixed part dominates
  they would lose a step for a few milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from triton_diffusion.engine.degradation import CUT_TARGET
from triton_diffusion.engine.estimates import WorkTimes
from triton_diffusion.engine.forward_caps import ForwardCaps
from triton_diffusion.engine.jobs import Computed, Job, Packing
from triton_diffusion.engine.ordering import Policy

# How much cheaper the same jobs' forwards by size must be priced than their packed forward for them to run
# by size, relatively and in seconds: the fit is a plane through noisy timings, and a difference within
# them (or below a timer's reach: a fake model's) is no reason to leave packing, which the mixed-sizes
# benchmark measured a gain on tiny FLUX.1.
PACK_MARGIN = 0.05
PACK_MIN_SAVING_S = 0.001
# Forwards of one size since the last packed one after which a forward the fit sends by size runs packed
# once: what packed forwards cost is only measured where they run (estimates.py), and a cost measured
# high once would otherwise hold for good.
PACK_PROBE_AFTER = 200
# How much more per token a narrowed forward may cost than the full one, by the fit (see the docstring).
NARROW_MARGIN = 0.05


def choose_group(
    running: list[Job], step: int, bound: int, policy: Policy, order: Callable[[Job], tuple]
) -> Hashable:
    """The group of the next forward among the ``running`` jobs (not ended) at engine ``step``: a starved
    job's (``bound``: starvation_steps), else the policy's choice among the top tier's groups, or the
    group that chosen one's first job also joins (see the module's docstring). ``order``: the forward
    key."""
    starved = [j for j in running if step - j.queue.waited_since >= bound]
    if starved:
        group = min(starved, key=lambda j: (j.queue.waited_since, j.queue.admitted)).run.group
    else:
        # The policy chooses among the groups of the highest tier running (by their own tiers: aging
        # orders jobs, the starvation bound above serves a lower group).
        top = min(j.spec.tier for j in running)
        candidates = [j for j in running if j.spec.tier == top]
        groups: dict[Hashable, list[Job]] = {}
        for job in candidates:
            groups.setdefault(job.run.group, []).append(job)
        first = min(candidates, key=order)  # none starved: the forward key is the order's
        group = policy.choose_group(groups, first)
    # A job may also step in another group's forwards (``also_joins``); so where the chosen group's job
    # that would go first joins such a group, that group steps, the two kinds together. Only where that
    # group's own jobs go before any job of the chosen group that joins another, so the switch never holds
    # back another (it steps in the next forward of its own group, as it would have).
    # (An adapter gives every job of a group an also_joins, or none: one of them says which.)
    if next(j for j in running if j.run.group == group).run.also_joins is not None:
        chosen = sorted((j for j in running if j.run.group == group), key=order)
        joins = chosen[0].run.also_joins
        own = [j for j in running if j.run.group == joins]
        other = next((j for j in chosen if j.run.also_joins != joins), None)
        if joins is not None and own and (other is None or order(min(own, key=order)) < order(other)):
            group = joins
    policy.picked(group)
    return group


def fill(group: Hashable, members: list[Job], caps: ForwardCaps, computed: Computed) -> list[Job]:
    """The members, in order, that fit one forward: within its jobs, its token budget and each shape's
    cap. One that does not fit is skipped (a smaller one after it may fill the room); the first is
    always taken, even alone over the budget (it runs alone, never refused for its size), so a starved
    job, put first, steps whatever keeps arriving."""
    jobs_cap, budget = caps.jobs_for(group), caps.tokens_for(group)
    taken: list[Job] = []
    of_shape: dict[Hashable, int] = {}
    for job in members:
        if len(taken) >= jobs_cap:
            break
        # The tokens the forward would compute with it, padding included (sizes mixed: the adapter's).
        over_budget = budget is not None and computed([*taken, job])[1] > budget
        if taken and (over_budget or of_shape.get(job.spec.shape, 0) >= caps.shape_cap(job.spec.shape)):
            continue
        taken.append(job)
        of_shape[job.spec.shape] = of_shape.get(job.spec.shape, 0) + 1
    return taken


def narrow(taken: list[Job], now: float, times: WorkTimes, computed: Computed, keep: int) -> list[Job]:
    """The jobs of a forward narrowed for a deadline: where a job with one is late in the full forward and
    in time in the shortest prefix of ``taken`` (in order) holding it, the longest prefix (at least the
    first ``keep``: the starved) in which every such job is in time. A job is priced as stepping in
    forwards of the prefix's tokens (padding included) for its steps left, then decoded (the cost line:
    estimates.py), and is in time where that is within ``CUT_TARGET`` of its time left (the estimate is an
    average). ``taken`` itself where no deadline needs it, before anything is measured, and where the
    prefix costs over ``NARROW_MARGIN`` more per token than ``taken``."""
    if len(taken) < 2 or not times.measured or all(job.spec.deadline is None for job in taken):
        return taken
    sizes = [computed(taken[: k + 1])[1] for k in range(len(taken))]
    decode = times.finish_s or 0.0

    def late(job: Job, k: int) -> bool:  # in forwards of the first k jobs
        deadline = job.spec.deadline
        done_in = job.remaining * times.forward_s(sizes[k - 1]) + decode
        return deadline is not None and done_in > (deadline - now) * CUT_TARGET

    # Those a smaller forward can bring in time: not a job late even in the shortest prefix holding it.
    savable = [
        (i, job) for i, job in enumerate(taken) if job.spec.deadline is not None and not late(job, i + 1)
    ]
    if not any(late(job, len(taken)) for _, job in savable):
        return taken
    # An earlier job's deadline goes first: the longest prefix keeping it may leave out a later one.
    fits = [k for k in range(max(keep, 1), len(taken)) if not any(late(j, k) for i, j in savable if i < k)]
    if not fits or not narrow_pays(times, sizes[max(fits) - 1], sizes[-1]):
        return taken
    return taken[: max(fits)]


def narrow_pays(times: WorkTimes, narrow_tokens: int, full_tokens: int) -> bool:
    """Whether a forward of ``narrow_tokens`` costs at most ``NARROW_MARGIN`` more per token than one of
    ``full_tokens``, by the cost line."""
    narrow_s, full_s = times.forward_s(narrow_tokens), times.forward_s(full_tokens)
    return narrow_s * full_tokens <= (1 + NARROW_MARGIN) * full_s * narrow_tokens


def gate(taken: list[Job], times: WorkTimes, computed: Computed, on: bool) -> Packing | None:
    """Whether jobs of several sizes run packed (None: one size). By the cost fit: the packed forward
    (padding included) against one forward per size, each by its rows and tokens; always packed where
    the gate is off (``on``: config packing_gate)."""
    sizes: dict[Hashable, list[Job]] = {}
    for job in taken:
        sizes.setdefault(job.spec.shape, []).append(job)
    if len(sizes) < 2:
        return None
    if not on:
        return Packing(True)
    packed = times.forward_cost(*computed(taken), packed=True)
    parts = [times.forward_cost(*computed(jobs)) for jobs in sizes.values()]
    if packed is None or any(part is None for part in parts):
        return Packing(True)
    by_size = sum(part for part in parts if part is not None)
    cheaper_by_size = by_size * (1 + PACK_MARGIN) < packed and packed - by_size >= PACK_MIN_SAVING_S
    probe = times.since_packed >= PACK_PROBE_AFTER
    return Packing(not cheaper_by_size or probe, packed, by_size)
