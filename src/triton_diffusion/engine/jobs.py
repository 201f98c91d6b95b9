"""What both engines work on (a :class:`Job`) and what they hand back after each step (a :class:`StepReport`).

Data at the engine boundary: an engine never calls into serving. Each step returns a report of what
happened (jobs admitted, jobs that took a denoising step with a snapshot for a preview or a streamed block,
jobs finished with their outputs, jobs that left and why, the forwards or fused calls run); the serving
layer's engine host renders it into responses on its own thread. A failure is answered where it is found,
through the request's :class:`TrackedRequest` (the one place a request's life is kept: exactly one FINAL),
and reported with its error.

Words: an *image* (or video, or LM request) is one job; a *model row* is one row of the denoiser's batch
(a job with classifier-free guidance has two); an *engine step* is one turn of the engine loop; a job's
*denoising step* is one of its ``total_steps``; the scheduler's ``step`` is the math that advances latents.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from triton_diffusion.engine.requests import TrackedRequest
from triton_diffusion.errors import RequestError


@dataclass(eq=False)
class Job:
    """One image (or video, or LM request) in an engine. ``params`` is what the adapter needs to start it;
    ``record`` is the serving host's per-request bookkeeping, opaque to the engine. The adapter sets
    ``state``, ``group`` and ``total_steps`` when it starts the job; the engine keeps the rest."""

    request: TrackedRequest
    params: Any
    record: Any = None
    index: int = 0  # which image of its request (image i of num_images_per_prompt)
    preview_every: int = 0  # a snapshot for a preview every N denoising steps (0: never)
    state: Any = None
    group: Hashable = None  # jobs of one group can share a forward (latent shape, or compatibility key)
    total_steps: int = 0  # denoising steps
    steps_done: int = 0
    failure: str | None = None  # set by the adapter when this job's own scheduler step failed
    queued_at: int = 0  # the engine step at which it joined the waiting queue
    arrival: int = 0  # admission order
    waited_since: int = 0  # the engine step at which it last stepped (or was admitted)
    first_forward: int | None = None  # the engine forward it first took part in
    forwards: int = 0  # forwards (or fused calls) it took part in
    most_shared: int = 0  # the most images it shared one forward with
    calls: list[dict[str, int]] = field(default_factory=list)  # request-level: the fused calls it was in
    submitted_at: float = field(default_factory=time.perf_counter)

    @property
    def remaining(self) -> int:
        return max(self.total_steps - self.steps_done, 0)


@dataclass(frozen=True)
class Stepped:
    """A job after one of its denoising steps. ``snapshot`` is what the adapter copied for the host at
    this step (a preview latent, the tokens of a finished block) or None."""

    job: Job
    step: int
    total: int
    snapshot: Any = None


@dataclass(frozen=True)
class Finished:
    job: Job
    output: Any


@dataclass(frozen=True)
class Left:
    """A job left its engine: ``finished``, ``cancelled``, ``failed`` (``error`` says why) or ``ended``
    (its request was answered elsewhere, e.g. a sibling image failed)."""

    job: Job
    reason: str
    error: RequestError | None = None


@dataclass(frozen=True)
class Forward:
    """One forward of the step engine (or one fused pipeline call of the request-level engine)."""

    images: int
    model_rows: int  # images plus their unconditional rows
    seconds: float
    adapters: int = 0  # distinct LoRA adapters among its rows


@dataclass
class StepReport:
    """What one engine step did, in the order it happened within each list."""

    admitted: list[Job] = field(default_factory=list)
    stepped: list[Stepped] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    left: list[Left] = field(default_factory=list)
    forwards: list[Forward] = field(default_factory=list)
    calls: list[Any] = field(default_factory=list)  # request-level: each fused call as run (CallReport)
    cuts: list[str] = field(default_factory=list)  # request-level: why planned calls were cut short
    running: int = 0  # jobs in the running set after the step

    def __bool__(self) -> bool:
        return bool(self.admitted or self.stepped or self.finished or self.left or self.forwards)
