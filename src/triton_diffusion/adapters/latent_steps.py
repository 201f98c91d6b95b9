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
  (to batch-size rounding) whoever it shared forwards with. The row math runs vectorised: guidance for all
  jobs in one op, and one call per scheduler class (batched_schedulers.py), bit-identical to each job's
  own ``scale_model_input`` and ``step``; jobs whose scheduler or config is not vectorised step alone.

A family subclass says how to encode prompts, draw initial latents, call the model and decode
(stable_diffusion.py: SD 1.x/2.x and SDXL; flow_matching.py: FLUX.1 and SD3).
"""

from __future__ import annotations

import copy
import inspect
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from triton_diffusion.adapters.batched_schedulers import (
    batched_step,
    can_batch,
    can_batch_step,
    guide,
    scale_model_inputs,
)
from triton_diffusion.adapters.diffusers_pipeline import row_generator
from triton_diffusion.engine.jobs import Job
from triton_diffusion.families import PipelineFacts

log = logging.getLogger("triton_diffusion")


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
        states: list[LatentJob] = [job.state for job in jobs]
        job_timesteps = [state.timesteps[job.steps_done] for job, state in zip(jobs, states, strict=True)]
        inputs_of = [state.latents for state in states]
        if self.scales_model_input:  # every job's scale_model_input in one op (Euler's per-row sigma)
            schedulers = [state.scheduler for state in states]
            scaled = scale_model_inputs(schedulers, torch.cat(inputs_of), job_timesteps)
            inputs_of = [scaled[j : j + 1] for j in range(len(jobs))]
        latent_rows, timesteps, conditioning = [], [], []
        for state, x, t in zip(states, inputs_of, job_timesteps, strict=True):
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
        noise = self._guided_noise(states, predictions)
        by_class: dict[type, list[int]] = {}
        for j, state in enumerate(states):
            if can_batch(state.scheduler):
                by_class.setdefault(type(state.scheduler), []).append(j)
            else:
                self._step_alone(jobs[j], noise[j : j + 1], job_timesteps[j])
        for members in by_class.values():
            group_timesteps = [job_timesteps[j] for j in members]
            self._step_together([jobs[j] for j in members], _rows(noise, members), group_timesteps)
        return [job for job in jobs if job.failure is None and job.steps_done + 1 >= job.total_steps]

    def _guided_noise(self, states: list[LatentJob], predictions: torch.Tensor) -> torch.Tensor:
        """Each job's noise prediction ([jobs, ...]): classifier-free guidance for every guided job in one
        op, each with its own scale, bit-identical to ``uncond + guidance * (cond - uncond)`` per job."""
        guided = [state.unconditional is not None for state in states]
        if not any(guided):
            return predictions
        scales = [state.guidance for state, g in zip(states, guided, strict=True) if g]
        if all(guided):  # rows are [uncond, cond] per job
            return guide(predictions[0::2], predictions[1::2], scales)
        first_rows, row = [], 0  # each job's first model row
        for g in guided:
            first_rows.append(row)
            row += 2 if g else 1
        uncond = _rows(predictions, [r for r, g in zip(first_rows, guided, strict=True) if g])
        cond = _rows(predictions, [r + 1 for r, g in zip(first_rows, guided, strict=True) if g])
        mixed = guide(uncond, cond, scales)
        noise, k = [], 0
        for r, g in zip(first_rows, guided, strict=True):
            noise.append(mixed[k : k + 1] if g else predictions[r : r + 1])
            k += g
        return torch.cat(noise)

    def _step_together(self, jobs: list[Job], noise: torch.Tensor, timesteps: list[torch.Tensor]) -> None:
        """One scheduler class's jobs in one vectorised call. It is atomic (a raise changes no scheduler), so
        on a failure each job steps alone and only the job whose own step fails fails."""
        states: list[LatentJob] = [job.state for job in jobs]
        schedulers = [state.scheduler for state in states]
        kwargs = [state.step_kwargs for state in states]
        stepped = None
        try:
            latents = torch.cat([state.latents for state in states])
            if can_batch_step(schedulers, noise, timesteps, latents, kwargs):
                stepped = batched_step(schedulers, noise, timesteps, latents, kwargs)
        except Exception as exc:  # noqa: BLE001  (redone job by job below: the culprit fails alone)
            name = type(schedulers[0]).__name__
            log.warning(
                "vectorised %s step of %d jobs failed (%r); stepping them one by one", name, len(jobs), exc
            )
        if stepped is not None:
            # Each job keeps a [1, ...] view of the result: diffusers' steps are out of place and the next
            # step's torch.cat copies, so no row is ever written through another's view.
            for j, state in enumerate(states):
                state.latents = stepped[j : j + 1]
            return
        for j, job in enumerate(jobs):
            self._step_alone(job, noise[j : j + 1], timesteps[j])

    @staticmethod
    def _step_alone(job: Job, noise: torch.Tensor, timestep: torch.Tensor) -> None:
        """One job's own scheduler step; its failure is this job's alone."""
        state: LatentJob = job.state
        try:
            step = state.scheduler.step
            state.latents = step(noise, timestep, state.latents, **state.step_kwargs, return_dict=False)[0]
        except Exception as exc:  # noqa: BLE001  (this job's own scheduler: it fails alone)
            job.failure = f"{type(exc).__name__}: {exc}"

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


def _rows(values: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``values[rows]`` by slices (no index tensor to copy to the device); the tensor itself when whole."""
    if rows == list(range(values.shape[0])):
        return values
    return torch.cat([values[r : r + 1] for r in rows])
