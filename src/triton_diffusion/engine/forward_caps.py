"""What one forward of the step engine may hold: the configured limits (:class:`EngineLimits`) and the
caps learned from out-of-memory forwards (:class:`ForwardCaps`), which the scheduler fills forwards within
(scheduler.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass

log = logging.getLogger("triton_diffusion")

# Full forwards of a group at an out-of-memory-learned cap before the cap is doubled again (at first).
CAP_RECOVERY_FORWARDS = 50


@dataclass(frozen=True)
class EngineLimits:
    max_running: int  # jobs in the running set
    max_per_forward: int  # jobs per forward, in all
    cap_for: Callable[[Hashable], int] | None = None  # a lower cap on jobs of some shapes (sizes)
    max_paused: int = 0  # jobs held paused at once for higher tiers (0: never pause)
    starvation_steps: int = 16  # a running job not stepped for this many engine steps goes next
    max_tokens_per_forward: int | None = None  # the jobs' tokens in one forward (None: no token bound)
    packing_gate: bool = True  # sizes mixed run by size where the cost fit prices that cheaper (else packed)
    narrow_forwards: bool = False  # fewer jobs in a forward where a deadline needs it (forward_choice.py)

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.max_per_forward < 1 or self.starvation_steps < 1:
            raise ValueError(f"max_running, max_per_forward and starvation_steps must be >= 1, got {self}")
        if self.max_tokens_per_forward is not None and self.max_tokens_per_forward < 1:
            raise ValueError(f"max_tokens_per_forward must be >= 1 when set, got {self}")


class ForwardCaps:
    """What one forward of a group holds: at most ``jobs_for`` jobs, ``tokens_for`` tokens and, of each
    shape, ``shape_cap`` jobs. The first two are the configured ones, lowered to half a forward that ran
    out of memory (its jobs and its tokens: a forward of mixed sizes runs out by its tokens as much as by
    its jobs). An out-of-memory may be transient (another process held memory for a while), so learned
    caps double after enough full forwards (at the learned job cap, or above half the learned token cap)
    and are dropped once they reach the configured ones (a token cap with no configured one, with the job
    cap). A real limit is re-learned by the next out-of-memory (one split forward), and each time the wait
    before the next try doubles, so a real limit is probed ever more rarely."""

    def __init__(self, limits: EngineLimits) -> None:
        self.limits = limits
        self._jobs: dict[Hashable, int] = {}  # learned job caps
        self._tokens: dict[Hashable, int] = {}  # learned token caps
        self._good: dict[Hashable, int] = {}  # full forwards at the learned caps since they changed
        self._wait: dict[Hashable, int] = {}  # full forwards to wait before raising them again
        self._raised: set[Hashable] = set()  # groups whose caps were raised and not yet re-proven

    def jobs_for(self, group: Hashable) -> int:
        """Jobs in one forward of the group (a job not started yet has no group: the configured cap)."""
        cap = self.limits.max_per_forward
        return min(cap, self._jobs.get(group, cap))

    def tokens_for(self, group: Hashable) -> int | None:
        """Tokens in one forward of the group (None: no bound)."""
        caps = [c for c in (self.limits.max_tokens_per_forward, self._tokens.get(group)) if c is not None]
        return min(caps, default=None)

    def budget_for(self, group: Hashable, shape: Hashable, tokens: int) -> int:
        """The tokens a forward holds, for estimating a job of ``tokens`` tokens of ``shape`` in ``group``:
        the group's token budget, or its cap of jobs of this size where that is less (without a token
        budget, the row-based estimate of before)."""
        jobs = min(self.jobs_for(group), self.shape_cap(shape)) * tokens
        budget = self.tokens_for(group)
        return jobs if budget is None else min(budget, jobs)

    def shape_cap(self, shape: Hashable) -> int:
        """Jobs of this shape (latent size) in one forward: the configured cap for its size."""
        cap = self.limits.max_per_forward
        if self.limits.cap_for is not None and shape is not None:
            cap = min(cap, self.limits.cap_for(shape))
        return cap

    def out_of_memory(self, group: Hashable, jobs: int, tokens: int) -> None:
        if jobs < 2:
            return
        if group in self._raised:  # raising them failed: wait longer next time
            self._raised.discard(group)
            self._wait[group] = self._wait.get(group, CAP_RECOVERY_FORWARDS) * 2
        self._jobs[group] = min(self.jobs_for(group), jobs // 2)
        self._tokens[group] = max(1, min(self.tokens_for(group) or tokens, tokens // 2))
        self._good[group] = 0
        log.warning(
            "out of memory: forwards of group %s capped at %d jobs, %d tokens",
            group,
            self._jobs[group],
            self._tokens[group],
        )

    def ran(self, group: Hashable, jobs: int, tokens: int) -> None:
        learned_jobs, learned_tokens = self._jobs.get(group), self._tokens.get(group)
        if learned_jobs is None and learned_tokens is None:
            return
        full = (learned_jobs is not None and jobs >= learned_jobs) or (
            learned_tokens is not None and tokens > learned_tokens // 2
        )
        if not full:
            return
        good = self._good.get(group, 0) + 1
        if good < self._wait.get(group, CAP_RECOVERY_FORWARDS):
            self._good[group] = good
            return
        self._good[group] = 0
        self._raised.add(group)
        self._jobs.pop(group, None)
        self._tokens.pop(group, None)
        if learned_jobs is not None and learned_jobs * 2 < self.limits.max_per_forward:
            self._jobs[group] = learned_jobs * 2
        budget = self.limits.max_tokens_per_forward
        if learned_tokens is not None and (budget is None or learned_tokens * 2 < budget):
            if budget is not None or group in self._jobs:  # no configured budget: dropped with the job cap
                self._tokens[group] = learned_tokens * 2
        log.info(
            "forwards of group %s capped at %d jobs, %s tokens again",
            group,
            self.jobs_for(group),
            self.tokens_for(group),
        )
