"""The step engine's adapter for latent diffusion pipelines: one denoising step at a time, many requests.

Built from the loaded diffusers pipeline's own parts (its text encoders through ``encode_prompt``, its
``prepare_latents`` or the same noise draw, its module's ``retrieve_timesteps``, its UNet or transformer,
its VAE and image processor); only the loop body of ``__call__`` is written here, once, for every family:

- each job (one image) has its own latents, its own scheduler instance (so steps and scheduler may differ
  per row) with its own timesteps, its own generator and its own guidance scale;
- a job with classifier-free guidance (or true CFG) adds an unconditional row to the forward, one
  without adds none; rows of every job in the forward go through ONE model call with a per-row timestep;
- each job's noise prediction is guided and stepped by its own scheduler, exactly as the pipeline's loop
  does for that row, so a request's image equals ``pipeline(...)`` for the same arguments and generator
  (to batch-size rounding) whoever it shared forwards with.

A family subclass says how to encode prompts, draw initial latents, call the model and decode
(stable_diffusion.py: SD 1.x/2.x and SDXL; flow_matching.py: FLUX.1 and SD3).
"""

from __future__ import annotations

import copy
import inspect
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from triton_diffusion.adapters.diffusers_pipeline import row_generator
from triton_diffusion.engine.jobs import Job
from triton_diffusion.families import PipelineFacts


@dataclass(frozen=True)
class ImageRequest:
    """What one image row needs (a job's ``params``), read from a validated request."""

    prompt: str
    negative_prompt: str | None
    seed: int
    image_index: int
    height: int
    width: int
    steps: int
    guidance_scale: float | None
    true_cfg_scale: float | None
    scheduler: str

    @property
    def size(self) -> tuple[int, int]:
        return self.height, self.width

    @property
    def summary(self) -> str:
        """For the admission log line."""
        size = f"{self.width}x{self.height}"
        return f"{size}, {self.steps} steps, {self.scheduler}, guidance {self.guidance_scale}"


@dataclass(eq=False)
class LatentJob:
    """A job's state between two steps (``job.state``)."""

    latents: torch.Tensor  # [1, ...]
    scheduler: Any
    timesteps: torch.Tensor
    conditional: dict[str, torch.Tensor]  # the model's conditioning inputs for this row, each [1, ...]
    unconditional: dict[str, torch.Tensor] | None  # with (true) classifier-free guidance
    guidance: float  # the (true) CFG scale applied when ``unconditional`` is set
    step_kwargs: dict[str, Any]  # extra arguments of scheduler.step (generator, eta)
    extra: dict[str, Any]  # per-row model inputs that are not text conditioning (Flux's guidance)


@dataclass(frozen=True)
class Conditioning:
    """What the text encoders gave one job: its conditional inputs and, with guidance, unconditional."""

    conditional: dict[str, torch.Tensor]
    unconditional: dict[str, torch.Tensor] | None


class LatentStepAdapter:
    """The loop body shared by every latent diffusion family. Subclasses fill in the hooks."""

    scales_model_input = False  # UNet schedulers scale the input per step; flow matching does not

    def __init__(self, pipe: Any, facts: PipelineFacts, schedulers: Any, max_sequence_length: int | None):
        self.pipe = pipe
        self.facts = facts
        self.max_sequence_length = max_sequence_length
        self.device = pipe._execution_device
        self.dtype = self.model.dtype
        self.module = sys.modules[type(pipe).__module__]  # the pipeline's own retrieve_timesteps & co
        # Pristine scheduler templates: each job steps a copy of its own.
        self.templates = {
            name: type(schedulers[name]).from_config(schedulers[name].config) for name in schedulers.names
        }

    # ---- hooks --------------------------------------------------------------------------------------
    @property
    def model(self) -> Any:
        """The denoising network (UNet or transformer)."""
        raise NotImplementedError

    def uses_guidance(self, request: ImageRequest) -> bool:
        """Whether the job adds an unconditional row."""
        raise NotImplementedError

    def guidance_scale(self, request: ImageRequest) -> float:
        return float(request.guidance_scale or 0.0)

    def encode(self, requests: Sequence[ImageRequest]) -> list[Conditioning]:
        """Text conditioning for every request, in one text-encoder call where the pipeline allows."""
        raise NotImplementedError

    def initial_latents(
        self, requests: Sequence[ImageRequest], schedulers: Sequence[Any], generators: list[torch.Generator]
    ) -> torch.Tensor:
        """[n, ...] starting latents of requests of one size, each row from its own generator."""
        raise NotImplementedError

    @property
    def schedule_device(self) -> str:
        """Where each job's timesteps (and so its scheduler's tables) live: the device, as in the
        pipeline, unless the family's schedulers would then wait for the GPU on every job's step."""
        return self.device

    def set_timesteps(self, scheduler: Any, request: ImageRequest) -> torch.Tensor:
        raise NotImplementedError

    def timestep_rows(self, timesteps: Sequence[torch.Tensor]) -> torch.Tensor:
        """The per-row timestep vector the model takes."""
        return self.to_device(torch.stack([t.reshape(()).to(torch.float32) for t in timesteps]))

    def to_device(self, values: torch.Tensor) -> torch.Tensor:
        """A small host tensor to the device without a sync: a plain copy from pageable memory would
        wait for the forward still queued on the GPU, so the next step could never be queued early."""
        if values.device.type == "cpu" and str(self.device).startswith("cuda"):
            return values.pin_memory().to(self.device, non_blocking=True)
        return values.to(self.device)

    def predict(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        size: tuple[int, int],
    ) -> Any:
        """The model over every row of one forward (all of one size)."""
        raise NotImplementedError

    def extra_inputs(self, request: ImageRequest) -> dict[str, torch.Tensor]:
        """Per-row model inputs besides the text (Flux's guidance value); shared by both CFG rows."""
        return {}

    def decode(self, latents: torch.Tensor, size: tuple[int, int]) -> list[Image.Image]:
        raise NotImplementedError

    def preview_latent(self, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """[C, h, w] of one job's latents for a preview."""
        return latents[0]

    # ---- the step adapter -------------------------------------------------------------------------------
    def prepare(self, jobs: list[Job]) -> None:
        requests: list[ImageRequest] = [job.params for job in jobs]
        conditioning = self.encode(requests)
        # One generator per row: it draws the row's noise, then (stochastic samplers) its step noise.
        generators = [row_generator(r.seed, r.image_index) for r in requests]
        schedulers, timesteps = [], []
        for request in requests:
            scheduler = copy.deepcopy(self.templates[request.scheduler])
            timesteps.append(self.set_timesteps(scheduler, request))
            if hasattr(scheduler, "set_begin_index"):
                scheduler.set_begin_index(0)
            schedulers.append(scheduler)
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, request in enumerate(requests):
            by_size.setdefault(request.size, []).append(i)
        for indices in by_size.values():
            latents = self.initial_latents(
                [requests[i] for i in indices],
                [schedulers[i] for i in indices],
                [generators[i] for i in indices],
            )
            for row, i in enumerate(indices):
                job, request, scheduler = jobs[i], requests[i], schedulers[i]
                guided = self.uses_guidance(request) and conditioning[i].unconditional is not None
                job.group, job.total_steps = request.size, len(timesteps[i])
                job.state = LatentJob(
                    latents=latents[row : row + 1],
                    scheduler=scheduler,
                    timesteps=timesteps[i],
                    conditional=conditioning[i].conditional,
                    unconditional=conditioning[i].unconditional if guided else None,
                    guidance=self.guidance_scale(request),
                    step_kwargs=self._step_kwargs(scheduler, generators[i]),
                    extra=self.extra_inputs(request),
                )

    def model_rows(self, job: Job) -> int:
        return 2 if job.state.unconditional is not None else 1

    def step(self, jobs: list[Job]) -> list[Job]:
        latent_rows, timesteps, conditioning = [], [], []
        for job in jobs:
            state: LatentJob = job.state
            t = state.timesteps[job.steps_done]
            x = state.latents
            if self.scales_model_input:
                x = state.scheduler.scale_model_input(x, t)
            branches = [state.conditional]
            if state.unconditional is not None:
                branches = [state.unconditional, state.conditional]
            for branch in branches:
                latent_rows.append(x)
                timesteps.append(t)
                conditioning.append({**branch, **state.extra})
        inputs = {name: torch.cat([c[name] for c in conditioning]) for name in conditioning[0]}
        size = jobs[0].params.size  # one shape group per forward
        with torch.inference_mode():
            predictions = self.predict(torch.cat(latent_rows), self.timestep_rows(timesteps), inputs, size)
        # The forward succeeded: only now does any job's state change.
        done, row = [], 0
        for job in jobs:
            state = job.state
            if state.unconditional is not None:
                uncond, cond = predictions[row : row + 1], predictions[row + 1 : row + 2]
                noise = uncond + state.guidance * (cond - uncond)
                row += 2
            else:
                noise = predictions[row : row + 1]
                row += 1
            t = state.timesteps[job.steps_done]
            try:
                step = state.scheduler.step
                state.latents = step(noise, t, state.latents, **state.step_kwargs, return_dict=False)[0]
            except Exception as exc:  # noqa: BLE001  (this job's own scheduler: it fails alone)
                job.failure = f"{type(exc).__name__}: {exc}"
                continue
            if job.steps_done + 1 >= job.total_steps:
                done.append(job)
        return done

    def finish(self, jobs: list[Job]) -> list[Any]:
        """Decode the done jobs of one size together."""
        latents = torch.cat([job.state.latents for job in jobs])
        with torch.inference_mode():
            return self.decode(latents, jobs[0].params.size)

    def snapshot(self, job: Job) -> torch.Tensor | None:
        """A copy of the job's latents for a preview when one is due at this step (the PNG is made on the
        response thread while the job steps on)."""
        if not job.preview_every or job.steps_done % job.preview_every:
            return None
        return self.preview_latent(job.state.latents, job.params.size).clone()

    # ---- shared pieces ------------------------------------------------------------------------------------
    def _step_kwargs(self, scheduler: Any, generator: torch.Generator) -> dict[str, Any]:
        """What the pipeline's prepare_extra_step_kwargs passes (eta for DDIM, the generator for
        stochastic samplers); flow-matching pipelines pass none."""
        if not self.scales_model_input:
            return {}
        accepted = set(inspect.signature(scheduler.step).parameters)
        kwargs: dict[str, Any] = {}
        if "eta" in accepted:
            kwargs["eta"] = 0.0
        if "generator" in accepted:
            kwargs["generator"] = [generator]
        return kwargs
