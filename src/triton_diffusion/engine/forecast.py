"""The work still to come: what a deadline's estimate adds for the requests that will arrive while a job
runs (config ``deadline_estimate`` ``arrivals``; ``held``: only the work held now).

The estimate of when a waiting job is done (scheduler.py, estimates.py) prices the work held now: the jobs
that go before it and the running jobs that share its forwards. Under load that is too hopeful: while the
job runs, requests of a higher tier arrive and go before it (pausing it when the running set is full), and
requests of its own tier or lower join its forwards while there is room, making each one longer. A job
admitted as in time then expires after it started, its steps wasted; a cut (engine/degradation.py) or a
refusal at admission would have been the better answer, and neither sees it coming.

The forecast: the arrivals of the last ``span`` seconds (the job's own deadline, from when its request
entered to its deadline: the stretch of traffic that matters to it), as rates by tier, token-steps and
tokens per second. During the ``T`` seconds the job is estimated to take, a higher tier adds
``token-steps/s x T`` of work before it, and its own tier and lower add ``tokens/s x T / 2`` tokens beside
it (one arriving at a uniform time in ``T`` shares half of it on average). ``T`` is found by a few rounds
of the fixed point (each round prices the arrivals of the last round's ``T``): with light traffic the
rates are small and the estimate is the held work's; where the higher tiers alone bring more work than the
engine does, ``T`` keeps growing and the job is late, as it will be.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

# Rounds of the fixed point: enough to price a busy engine (each adds the arrivals of the last round's
# estimate), few enough to cost little at every engine step.
ROUNDS = 4
# Arrivals kept: those of the last this many seconds, at most this many.
KEEP_S = 600.0
KEEP = 10_000


@dataclass(frozen=True)
class Coming:
    """The rates of the work arriving, as one job sees it."""

    before_token_steps_s: float  # token-steps per second of higher tiers: they go before it
    beside_tokens_s: float  # tokens per second of its tier and lower: they share its forwards

    def estimate(self, finish_s: Callable[[int, int], float]) -> float:
        """Seconds until the job is done, with the work arriving meanwhile: ``finish_s(before, beside)`` is
        its estimate with ``before`` token-steps more before it and ``beside`` tokens more beside it."""
        seconds = finish_s(0, 0)
        if self.before_token_steps_s <= 0 and self.beside_tokens_s <= 0:
            return seconds
        for _ in range(ROUNDS):
            seconds = finish_s(
                round(self.before_token_steps_s * seconds), round(self.beside_tokens_s * seconds / 2)
            )
        return seconds


@dataclass
class Arrivals:
    """Every job that arrived at the engine: (when, tier, tokens, token-steps asked), oldest first."""

    log: deque[tuple[float, int, int, int]] = field(default_factory=lambda: deque(maxlen=KEEP))

    def arrived(self, now: float, tier: int, tokens: int, steps: int) -> None:
        self.log.append((now, tier, tokens, tokens * steps))
        while self.log and self.log[0][0] < now - KEEP_S:
            self.log.popleft()

    def coming(self, now: float, span_s: float, tier: int, own_tokens: int = 0) -> Coming:
        """The rates a job of ``tier`` sees, from the arrivals of the last ``span_s`` seconds (less its own
        ``own_tokens``: it is among them, and is not beside itself)."""
        if span_s <= 0:
            return Coming(0.0, 0.0)
        before, beside = 0, -own_tokens
        for when, their_tier, tokens, token_steps in reversed(self.log):
            if when < now - span_s:
                break
            if their_tier < tier:
                before += token_steps
            else:
                beside += tokens
        return Coming(before / span_s, max(beside, 0) / span_s)
