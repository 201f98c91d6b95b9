"""A latent adapter's step caches, job by job (step_caches.py holds the hooks and each row's state): the
caches the model serves, a new job's state, the cache the scheduler gives a running job
(engine/degradation.py) and the plan of one forward's cached rows. Composed into LatentStepAdapter
(latent_loop.py) as ``caches``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from triton_diffusion.adapters.image_params import latent_state
from triton_diffusion.adapters.packed_rows import ANY_SIZE
from triton_diffusion.adapters.step_caches import (
    CachePlan,
    CacheState,
    RowCaches,
    Slot,
    new_cache_state,
    servable,
)
from triton_diffusion.engine.jobs import Job
from triton_diffusion.step_cache_spec import NO_CACHE, StepCache, parse_step_cache

RowSubsets = Callable[[list[int]], contextlib.AbstractContextManager]


class JobCaches:
    """Of the family's ``methods``, those diffusers' hooks apply to ``model`` (``methods``), with the hooks
    installed once (``rows``; None where it serves none). ``per_branch``: the family's
    ``cache_per_branch`` (latent_loop.py): each CFG branch keeps its own state."""

    def __init__(self, model: torch.nn.Module, methods: Sequence[str], per_branch: bool) -> None:
        self.methods = servable(model, methods)
        self.per_branch = per_branch
        # Hooks that do nothing in a forward without a cached row.
        self.rows = RowCaches(model, self.methods) if self.methods else None

    def new_state(self, step_cache: StepCache, guided: bool) -> CacheState | None:
        """A new job's state (None without a cache, or where the model serves none)."""
        if not step_cache or self.rows is None:
            return None
        return new_cache_state(step_cache, 2 if guided and self.per_branch else 1)

    def start(self, jobs: list[Job]) -> list[str | None]:
        """Give these running jobs the cache the scheduler gave them (``queue.cache_given``) from their next
        step: a fresh state, as diffusers' cache enabled between two steps starts. Per job, None, or why
        not (it runs on without one)."""
        refused: list[str | None] = []
        for job in jobs:
            state = latent_state(job.state)
            given = job.queue.cache_given
            spec = parse_step_cache(given.step_cache) if given is not None else NO_CACHE
            if not spec or self.rows is None or spec.method not in self.methods:
                refused.append(f"{spec.text} is not served by this model")
            elif state.cache is not None:
                refused.append(f"it runs {state.cache.spec.text} already")
            elif job.run.group == ANY_SIZE:  # a packed forward's shared mask does not follow a cache
                refused.append("it shares forwards with jobs of other sizes")
            else:
                branches = 2 if state.unconditional is not None and self.per_branch else 1
                state.cache = new_cache_state(spec, branches)
                refused.append(None)
        return refused

    def plan(self, jobs: list[Job], model_rows: Sequence[int], subsets: RowSubsets) -> CachePlan | None:
        """The cached branches of a forward over these jobs (``model_rows``: each one's rows in it); None
        where no job has a step cache. ``subsets``: around a block call over some of the rows."""
        if self.rows is None:
            return None
        slots, states, row = [], [], 0
        for job, count in zip(jobs, model_rows, strict=True):
            rows = list(range(row, row + count))
            cache = latent_state(job.state).cache
            if cache is not None:
                states.append(cache)
                if len(cache.branches) == len(rows):  # each CFG branch its own
                    slots += [Slot[Any](branch, [r]) for branch, r in zip(cache.branches, rows, strict=True)]
                else:
                    slots.append(Slot[Any](cache.branches[0], rows))
            row += len(rows)
        if not slots:
            return None
        return CachePlan(row, slots, states, subsets)

    def running(self, plan: CachePlan | None) -> contextlib.AbstractContextManager:
        """Around a forward with cached rows: the hooks follow ``plan``."""
        if plan is None:
            return contextlib.nullcontext()
        assert self.rows is not None  # a plan is made only with them (plan)
        return self.rows.running(plan)

    def commit(self, plan: CachePlan) -> None:
        """The forward returned: its staged updates become the branches' state."""
        assert self.rows is not None  # a plan is made only with them (plan)
        self.rows.commit(plan)
