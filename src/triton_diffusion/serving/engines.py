"""The two engines a model can run, as types: each builds its engine from the model's settings, says how
many jobs it holds before execute() blocks, and what its worker asks about aborts. A model picks one at
load (its step adapter, or its fused pipeline call); what a request's jobs are and how it was batched
(BATCH) is the model kind's (models/).

Caps come from one place, the model's :class:`RowCaps` (``max_rows_per_call`` and its per-size caps):
jobs per forward of one size on the step engine, images per fused call on the request-level engine. Every
other limit is read from the settings resolved for the engine (``settings.resolved``): derived defaults
are computed beside their declarations in settings.py, never here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from triton_diffusion.engine.estimates import WorkTimes
from triton_diffusion.engine.jobs import StepReport
from triton_diffusion.engine.ordering import AdmissionPacing, Service, make_policy
from triton_diffusion.engine.planner import RowCaps
from triton_diffusion.engine.request_engine import PipelineCall, RequestEngine
from triton_diffusion.engine.scheduler import EngineLimits
from triton_diffusion.engine.step_engine import StepAdapter, StepEngine
from triton_diffusion.serving.cancellations import ClientAborts
from triton_diffusion.settings import ModelSettings

log = logging.getLogger("triton_diffusion")


@dataclass(frozen=True)
class StepEngineKind:
    """The step engine over a step adapter. ``caps`` (images) give each size its cap of jobs per forward;
    None (the diffusion LM): one cap, the running set."""

    adapter: StepAdapter
    caps: RowCaps | None = None
    max_tokens_per_forward: int | None = None  # denoiser tokens per forward (None: no token budget)
    times: WorkTimes | None = None  # the cost fit a calibration at load seeded (models/calibration.py)

    name = "step"

    def build(self, settings: ModelSettings, on_progress: Callable[[StepReport], None]) -> StepEngine:
        config = settings.config
        running = settings.resolved("max_running", self.name)
        caps = self.caps
        limits = EngineLimits(
            max_running=running,
            max_per_forward=caps.max_rows if caps is not None else running,
            # An image's group is (height, width), a video's (height, width, frames): caps are by size.
            cap_for=caps.cap_for_shape if caps is not None else None,
            max_tokens_per_forward=self.max_tokens_per_forward,
            max_paused=settings.resolved("max_paused", self.name),
            starvation_steps=config.starvation_steps,
            packing_gate=config.packing_gate,
            narrow_forwards=config.narrow_forwards and caps is not None,  # images and video (its kinds)
        )
        cohort = settings.resolved("admission_cohort", self.name)
        pacing = AdmissionPacing(cohort, config.admission_max_wait_steps)
        refuse = config.deadline_policy == "refuse"
        pause_by: Literal["tier", "deadline"] = "deadline" if config.tier_pause == "deadline" else "tier"
        service = Service(config.service_tiers, config.tier_aging_s, refuse, pause_by)
        policy = make_policy(config.scheduling_policy)
        log.info(
            "%s: step engine (%s), running %d, %d per forward, %s tokens per forward, policy %s, "
            "admission cohort %d, tiers %s",
            settings.name,
            type(self.adapter).__name__,
            limits.max_running,
            limits.max_per_forward,
            limits.max_tokens_per_forward or "any",
            policy.name,
            pacing.cohort,
            ",".join(service.tiers),
        )
        # Checkpoints of the jobs that have a checkpoint key (recovery/resumes.py), every this many steps.
        every = config.checkpoint_every_steps
        return StepEngine(
            self.adapter, limits, policy, pacing, service, checkpoint_every=every, times=self.times
        )

    @staticmethod
    def aborts(settings: ModelSettings) -> ClientAborts:
        """What the worker asks before each step: a client is asked at most every ``cancel_poll_s``."""
        return ClientAborts(settings.config.cancel_poll_s)

    def capacity(self, settings: ModelSettings) -> int:
        """Jobs held before execute() blocks: the running set and the waiting room."""
        return settings.resolved("max_running", self.name) + settings.resolved("waiting_room", self.name)

    def deadline_room(self, settings: ModelSettings) -> int:
        """Jobs beyond ``capacity`` a request with a deadline joins without waiting in execute(): where the
        scheduler refuses late ones (``deadline_policy: refuse``), else none (nothing would refuse them)."""
        refuses = settings.config.deadline_policy == "refuse"
        return int(settings.resolved("deadline_room", self.name)) if refuses else 0


@dataclass(frozen=True)
class RequestEngineKind:
    """The request-level engine: one fused pipeline call per compatible group of at most ``caps``."""

    call: PipelineCall
    caps: RowCaps

    name = "request"

    def build(self, settings: ModelSettings, on_progress: Callable[[StepReport], None]) -> RequestEngine:
        # Asked before each fused call and between its denoising steps, every time (one round trip each).
        return RequestEngine(self.call, self.caps, on_progress, ClientAborts())

    @staticmethod
    def aborts(settings: ModelSettings) -> ClientAborts:
        """The worker's (nothing to ask: this engine asks its own before each call)."""
        return ClientAborts()

    def capacity(self, settings: ModelSettings) -> int:
        """Images held before execute() blocks: one fused call's and the waiting room."""
        return self.caps.max_rows + settings.resolved("waiting_room", self.name)

    @staticmethod
    def deadline_room(settings: ModelSettings) -> int:
        """None: this engine refuses nothing for a deadline, so a request with one waits like any other."""
        return 0


EngineKind = StepEngineKind | RequestEngineKind
