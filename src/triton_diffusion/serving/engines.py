"""The two engines a model can run, as types: each builds its engine from the model's settings, turns one
image of a validated request into a job's params, and says how the request was batched (the BATCH
output). A model picks one at load (its step adapter, or its fused pipeline call); nothing downstream asks
which it is.

Caps come from one place, the model's :class:`RowCaps` (``max_rows_per_call`` and its per-size caps):
jobs per forward of one size on the step engine, images per fused call on the request-level engine. Every
other limit is read from the settings resolved for the engine (``settings.resolved``): derived defaults
are computed beside their declarations in settings.py, never here.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

from triton_diffusion.compatibility import CompatibilityKey, compatibility_key
from triton_diffusion.engine.jobs import Job, StepReport
from triton_diffusion.engine.ordering import AdmissionPacing, Service, make_policy
from triton_diffusion.engine.planner import RowCaps
from triton_diffusion.engine.request_engine import PipelineCall, RequestEngine
from triton_diffusion.engine.scheduler import EngineLimits
from triton_diffusion.engine.step_engine import StepAdapter, StepEngine
from triton_diffusion.faults import FaultyStepAdapter
from triton_diffusion.fields import FieldSet
from triton_diffusion.serving.cancellations import ClientAborts
from triton_diffusion.settings import ModelSettings

log = logging.getLogger("triton_diffusion")

# (a request's validated values, which of its images) -> the job's params
ParamsOf = Callable[[dict[str, Any], int], Any]


@dataclass(frozen=True)
class StepEngineKind:
    """The step engine over a step adapter. ``caps`` (images) give each size its cap of jobs per forward;
    None (the diffusion LM): one cap, the running set. ``params_of`` makes a job's params."""

    adapter: StepAdapter
    params_of: ParamsOf
    caps: RowCaps | None = None
    prompt_of: Callable[[Job], str] = lambda job: ""  # for fault injection

    name = "step"

    def build(self, settings: ModelSettings, on_progress: Callable[[StepReport], None]) -> StepEngine:
        config = settings.config
        adapter = self.adapter
        if config.fault_injection is not None:  # the engine sees the failures a model would give it
            adapter = FaultyStepAdapter(adapter, config.fault_injection, self.prompt_of)
        running = settings.resolved("max_running", self.name)
        caps = self.caps
        limits = EngineLimits(
            max_running=running,
            max_per_forward=caps.max_rows if caps is not None else running,
            # An image's group is (height, width), a video's (height, width, frames): caps are by size.
            cap_for=caps.cap_for_shape if caps is not None else None,
            max_paused=settings.resolved("max_paused", self.name),
            starvation_steps=config.starvation_steps,
        )
        cohort = settings.resolved("admission_cohort", self.name)
        pacing = AdmissionPacing(cohort, config.admission_max_wait_steps)
        service = Service(config.service_tiers, config.tier_aging_s, config.deadline_policy == "refuse")
        policy = make_policy(config.scheduling_policy)
        log.info(
            "%s: step engine (%s), running %d, %d per forward, policy %s, admission cohort %d, tiers %s",
            settings.name,
            type(self.adapter).__name__,
            limits.max_running,
            limits.max_per_forward,
            policy.name,
            pacing.cohort,
            ",".join(service.tiers),
        )
        engine = StepEngine(adapter, limits, policy, pacing, service)
        if isinstance(adapter, FaultyStepAdapter):
            adapter.held = lambda: engine.active  # what hold_on_prompt waits on (tests only)
        return engine

    @staticmethod
    def aborts(settings: ModelSettings) -> ClientAborts:
        """What the worker asks before each step: a client is asked at most every ``cancel_poll_s``."""
        return ClientAborts(settings.config.cancel_poll_s)

    def capacity(self, settings: ModelSettings) -> int:
        """Jobs held before execute() blocks: the running set and the waiting room."""
        return settings.resolved("max_running", self.name) + settings.resolved("waiting_room", self.name)

    def job_params(self, values: dict[str, Any], image: int, key: Hashable) -> tuple[Any, Hashable]:
        """The job's params; its group is set when the adapter starts it."""
        return self.params_of(values, image), None

    @staticmethod
    def key_for(fields: FieldSet, values: dict[str, Any]) -> None:
        """No compatibility key: rows of any fields share forwards here, grouped by latent shape."""
        return None

    @staticmethod
    def batch(values: dict[str, Any], jobs: list[Job]) -> dict[str, Any]:
        """How the request was batched: its shape group (what its rows shared forwards by), the forwards
        its images took part in and the most images they shared one with."""
        key = {name: values[name] for name in ("height", "width", "num_frames") if name in values}
        if values.get("lora"):  # the adapters and scales this request's rows had
            key["lora"] = values["lora"]
        report = {
            "key": key,
            "engine": "step",
            "forwards": max(job.forwards for job in jobs),
            "most_rows_shared": max(job.most_shared for job in jobs),
        }
        if values.get("step_cache"):  # its denoiser rows: run in full, or from its cache
            report["step_cache"] = {
                "cache": values["step_cache"],
                "rows_computed": sum(job.rows_computed for job in jobs),
                "rows_reused": sum(job.rows_reused for job in jobs),
            }
        return report


@dataclass(frozen=True)
class RequestEngineKind:
    """The request-level engine: one fused pipeline call per compatible group of at most ``caps``."""

    call: PipelineCall
    params_of: ParamsOf
    caps: RowCaps
    _own_calls: Iterator[int] = field(default_factory=itertools.count, compare=False, repr=False)

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

    def job_params(self, values: dict[str, Any], image: int, key: Hashable) -> tuple[Any, Hashable]:
        """The job's params, and its group: its request's compatibility key."""
        return self.params_of(values, image), key

    def key_for(self, fields: FieldSet, values: dict[str, Any]) -> CompatibilityKey:
        """The request's compatibility key; with a step cache one of its own: diffusers' cache decides once
        per call over all its rows, so a cached request shares a call with nobody."""
        key = compatibility_key(fields, values)
        if not values.get("step_cache"):
            return key
        return CompatibilityKey((*key.items, ("own_call", next(self._own_calls))))

    @staticmethod
    def batch(values: dict[str, Any], jobs: list[Job]) -> dict[str, Any]:
        """How the request was batched: its compatibility key and the fused calls it went through."""
        key = {name: value for name, value in jobs[0].group.as_dict().items() if name != "own_call"}
        report = {"key": key, "fused_calls": jobs[0].calls}
        if values.get("step_cache"):  # diffusers' own cache, on calls of its own
            report["step_cache"] = {"cache": values["step_cache"], "own_calls": True}
        return report


EngineKind = StepEngineKind | RequestEngineKind
