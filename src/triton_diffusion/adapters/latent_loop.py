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
  jobs in one op, and one call per scheduler class (schedulers/), bit-identical to each job's own
  ``scale_model_input`` and ``step``; jobs whose scheduler or config is not vectorised step alone;
- :meth:`LatentStepAdapter.step` returns what happened to each job (a JobStep); it never changes the
  engine's state.

Three collaborators are composed into it: ``caches`` (job_caches.py: its step caches, job by job),
``starter`` (starts.py: how a job starts, text, img2img or
inpainting; a family whose image starts differ gives its own ``starts_class``) and ``sizes`` (row_sizes.py:
a job's tokens, its group, the packed forward). A family subclass fills in the hooks this class declares,
each raising NotImplementedError here (stable_diffusion.py: SD 1.x/2.x and SDXL; flow_matching.py: FLUX.1
and SD3; dit.py, wan.py, qwen_image.py, z_image.py).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from triton_diffusion.adapters import diffusers_compat as compat
from triton_diffusion.adapters.captured_forwards import Capture, CapturedForwards, capture_adapter_forwards
from triton_diffusion.adapters.devices import take_rows, to_device
from triton_diffusion.adapters.diffusers_pipeline import counterpart_pipeline
from triton_diffusion.adapters.image_params import (
    Conditioning,
    ImageParams,
    LatentJob,
    as_run,
    image_params,
    latent_state,
)
from triton_diffusion.adapters.job_caches import JobCaches
from triton_diffusion.adapters.lora import LoraBank, LoraSet
from triton_diffusion.adapters.packed_rows import ANY_SIZE
from triton_diffusion.adapters.row_sizes import Packing, RowSizes
from triton_diffusion.adapters.schedulers import can_batch, guide, scale_model_inputs, vectorised_step
from triton_diffusion.adapters.starts import JobStarts
from triton_diffusion.adapters.step_caches import CachePlan, CacheState, reused_rows
from triton_diffusion.engine.failures import Failure, is_device_lost
from triton_diffusion.engine.jobs import ForwardResult, Job, JobStart, JobStep
from triton_diffusion.families import PipelineFacts
from triton_diffusion.recovery.checkpoint_format import JobCheckpoint

log = logging.getLogger("triton_diffusion")


class LatentStepAdapter:
    """The loop body shared by every latent diffusion family. Subclasses fill in the hooks."""

    starts_class: type[JobStarts] = JobStarts  # how its jobs start (a family's own where its starts differ)
    packing = Packing()  # whether its sizes share forwards, and why not (row_sizes.py; FLUX.1, SD3 set it)

    scales_model_input = False  # UNet schedulers scale the input per step; flow matching does not
    # Pipelines that scale the model input pass prepare_extra_step_kwargs' eta and generator to the
    # scheduler's step; these pass them even without (Sana).
    always_passes_step_kwargs = False
    # The text length when neither the model's config nor the pipeline's __call__ gives one (None: the
    # family's text encoders take no length).
    fallback_max_sequence_length: int | None = None
    # A guidance-distilled transformer (FLUX.1-dev, Qwen-Image's guidance_embeds) takes the row's
    # guidance_scale as a model input.
    guidance_embeds = False
    # The model's LoRA adapters (set by the model after loading them): each row's own in every forward.
    loras: LoraBank | None = None
    # Whether ``predict`` can be captured as a CUDA graph (config cuda_graphs): not where it reads values
    # back to the host to shape the forward (Qwen-Image's text length, Z-Image's caption lengths).
    captures_forwards = True
    captured: CapturedForwards | None = None  # set by the model when it captures them (cuda_graphs)
    # An inpainting checkpoint (SD/SDXL 9-channel UNets, SD3's 33-channel transformer, FLUX.1 Fill): the
    # mask and the masked source's latents are inputs of every forward (``inpaint_channels``), so it
    # serves inpainting jobs only and blends nothing back. Set by the family before this __init__.
    inpainting_checkpoint = False
    # The step caches (step_caches.py) this family's denoiser serves per request: the methods whose
    # reference is diffusers' own hook on its blocks, checked against it in the tests.
    cache_methods: tuple[str, ...] = ()
    # The pipeline calls the denoiser once per CFG branch, each under its own cache_context (FLUX.1 true
    # CFG, Qwen-Image, Wan), so each branch keeps its own cache state; else a job's rows decide together.
    cache_per_branch = False

    def __init__(self, pipe: Any, facts: PipelineFacts, schedulers: Any, max_sequence_length: int | None):
        traits = facts.traits
        self.facts = facts  # read by the starter's supports()
        # The family's pipeline for each start, all over the loaded modules (``pipe`` may be any of them:
        # image_to_image loads the img2img class). ``self.pipe`` is the text-to-image one: its code is what
        # the loop body mirrors; the others supply only their own start (and SDXL img2img's time ids).
        self.pipe = counterpart_pipeline(pipe, traits.text_pipeline or type(pipe).__name__)
        self.starter = self.starts_class(self)
        self.pipelines = {"text": self.pipe}
        for start, name in (("image", traits.image_pipeline), ("mask", traits.inpaint_pipeline)):
            if name is not None and self.starter.supports(start):
                self.pipelines[start] = counterpart_pipeline(pipe, name)
        self.max_sequence_length: int | None = (
            max_sequence_length or facts.default("max_sequence_length") or self.fallback_max_sequence_length
        )
        self.device = compat.execution_device(self.pipe)
        self.dtype = self.model.dtype
        self.latent_dtype = self.dtype  # what latents are drawn and stepped in (Qwen-Image: its text's)
        self.module = sys.modules[type(self.pipe).__module__]  # the pipeline's own retrieve_timesteps & co
        # Pristine scheduler templates: each job steps a copy of its own.
        self.templates = {
            name: type(schedulers[name]).from_config(schedulers[name].config) for name in schedulers.names
        }
        # The step caches this model serves: the family's, where diffusers' hooks apply to its blocks.
        self.caches = JobCaches(self.model, self.cache_methods, self.cache_per_branch)
        self.cache_methods = self.caches.methods
        self.sizes = self.row_sizes()

    # ---- what the engine and the model call (the collaborators') ----------------------------------------
    def prepare(self, jobs: list[Job]) -> list[JobStart]:
        return self.starter.prepare(jobs)

    def checkpoint(self, jobs: list[Job]) -> list[JobCheckpoint | None]:
        return self.starter.checkpoint(jobs)

    def computed(self, jobs: Sequence[Job]) -> tuple[int, int]:
        return self.sizes.computed(jobs)

    def tokens_of(self, request: ImageParams) -> int:
        return self.sizes.tokens_of(request)

    # ---- hooks --------------------------------------------------------------------------------------
    @property
    def model(self) -> Any:
        """The denoising network: the pipeline's transformer (the UNet families override it)."""
        return self.pipe.transformer

    def pack(self, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """[n, C, h, w] latents into the loop's layout (Flux packs 2x2 patches)."""
        return latents

    @property
    def token_patch(self) -> int:
        """Latent pixels a denoiser token spans per side: the transformer's patch (FLUX.1 and Qwen-Image
        pack 2x2 latents in the pipeline instead; a UNet: 1, a token per latent pixel)."""
        patch = getattr(self.model.config, "patch_size", None) or 1
        return int(patch[-1] if isinstance(patch, (tuple, list)) else patch)

    def row_sizes(self) -> RowSizes:
        """Its jobs' sizes (row_sizes.py): the VAE's scale factor and the denoiser's patch (Wan: frames)."""
        factor = getattr(self.pipe, "vae_scale_factor", None) or 8
        return RowSizes(
            scale_factor=factor,
            patch=self.token_patch,
            guided=self.uses_guidance,
            device=self.device,
            packing=self.packing,
        )

    def uses_guidance(self, request: ImageParams) -> bool:
        """Whether the job adds an unconditional row: classic CFG, as the pipelines' ``guidance_scale > 1``
        (true-CFG families and Z-Image override it)."""
        return self.guidance_scale(request) > 1.0

    def guidance_scale(self, request: ImageParams) -> float:
        return float(request.guidance_scale or 0.0)

    def encode(self, requests: Sequence[ImageParams]) -> list[Conditioning]:
        """Text conditioning for every request, in one text-encoder call where the pipeline allows.

        By default for pipelines that encode a negative prompt exactly as a prompt (a missing one as ""):
        the prompts and the guided rows' negative prompts in one ``encode_texts`` call, split back."""
        guided = [i for i, r in enumerate(requests) if self.uses_guidance(r)]
        texts = [r.prompt for r in requests] + [requests[i].negative_prompt or "" for i in guided]
        text = self.encode_texts(texts)
        negatives = {i: text[len(requests) + row] for row, i in enumerate(guided)}
        return [Conditioning(text[i], negatives.get(i)) for i in range(len(requests))]

    def encode_texts(self, texts: list[str]) -> list[dict[str, torch.Tensor]]:
        """Each text's conditioning inputs (each [1, ...]), for the default ``encode``."""
        raise NotImplementedError

    def initial_latents(
        self, requests: Sequence[ImageParams], schedulers: Sequence[Any], generators: list[torch.Generator]
    ) -> torch.Tensor:
        """[n, ...] starting latents of requests of one size, each row from its own generator."""
        raise NotImplementedError

    @property
    def schedule_device(self) -> torch.device | str:
        """Where each job's timesteps (and so its scheduler's tables) live: the device, as in the
        pipeline, unless the family's schedulers would then wait for the GPU on every job's step."""
        return self.device

    def set_timesteps(self, scheduler: Any, request: ImageParams) -> torch.Tensor:
        raise NotImplementedError

    def timestep_rows(self, timesteps: Sequence[torch.Tensor]) -> torch.Tensor:
        """The per-row timestep vector the model takes."""
        return self.stacked_timesteps(timesteps, torch.float32)

    def stacked_timesteps(self, timesteps: Sequence[torch.Tensor], dtype: torch.dtype | None) -> torch.Tensor:
        """Each row's 0-d timestep in one [rows] vector on the device, cast to ``dtype`` (None: as is)."""
        rows = [t if t.dim() == 0 else t.reshape(()) for t in timesteps]  # a reshape costs microseconds
        if dtype is not None and any(t.dtype != rows[0].dtype for t in rows):
            rows = [t.to(dtype) for t in rows]  # each cast as it is (stacking would promote first)
        stacked = torch.stack(rows)
        return self.to_device(stacked if dtype is None else stacked.to(dtype))

    def to_device(self, values: torch.Tensor) -> torch.Tensor:
        """A small host tensor to the device without a sync (devices.py)."""
        return to_device(values, self.device)

    def predict(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        size: tuple[int, int],
    ) -> Any:
        """The model over every row of one forward (all of one size)."""
        raise NotImplementedError

    def extra_inputs(self, request: ImageParams) -> dict[str, torch.Tensor]:
        """Per-row model inputs besides the text (the guidance value of a guidance-distilled transformer);
        shared by both CFG rows."""
        if not self.guidance_embeds:
            return {}
        assert request.guidance_scale is not None  # a guidance-distilled model's default is filled in
        return {"guidance": torch.full([1], request.guidance_scale, device=self.device, dtype=torch.float32)}

    def decode(self, latents: torch.Tensor, size: tuple[int, int]) -> list[Any]:
        """Each job's output: a PIL image (a video family: its uint8 frames, wan.py)."""
        raise NotImplementedError

    def preview_latent(self, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """[C, h, w] of one job's latents for a preview."""
        return latents[0]

    # ---- LoRA adapters per row ---------------------------------------------------------------------------
    def adapted_rows(self, adapters: list[LoraSet]) -> contextlib.AbstractContextManager:
        """Around a forward whose model rows have these adapters (none: the base model)."""
        if self.loras is None:
            return contextlib.nullcontext()
        return self.loras.rows(adapters, self.to_device)

    def new_cache_state(self, request: ImageParams, guided: bool) -> CacheState | None:
        """A new job's step-cache state (job_caches.py), or None without a cache."""
        return self.caches.new_state(request.step_cache, guided)

    def start_caches(self, jobs: list[Job]) -> list[str | None]:
        """Give these running jobs the cache the scheduler gave them (job_caches.py)."""
        return self.caches.start(jobs)

    def _cache_plan(self, jobs: list[Job], adapters: list[LoraSet]) -> CachePlan | None:
        if self.caches.rows is None:
            return None
        loras, rows = self.loras, [self.model_rows(job) for job in jobs]
        if loras is None:
            return self.caches.plan(jobs, rows, lambda subset: contextlib.nullcontext())
        return self.caches.plan(jobs, rows, loras.subsets(adapters, self.to_device))

    def model_rows(self, job: Job) -> int:
        """The denoiser rows a job adds to a forward: 2 with (true) classifier-free guidance."""
        return 2 if latent_state(job.state).unconditional is not None else 1

    def step_output(self, job: Job) -> int:
        """Which output of the scheduler's ``step`` becomes the job's latents: the stepped sample (0), or
        where the pipeline's loop keeps another (``one_step_keeps_original``, PixArt-Alpha after one step:
        the predicted original sample, 1), that index; such a job steps alone."""
        return 1 if self.facts.traits.one_step_keeps_original and as_run(job).steps == 1 else 0

    def forward_inputs(
        self, jobs: list[Job], job_timesteps: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], torch.Tensor, dict[str, torch.Tensor], list[LoraSet]]:
        """One forward's model rows for these jobs at these timesteps: each row's latents (scaled by its
        job's scheduler where the family scales them), the per-row timestep vector, the conditioning inputs
        and each row's LoRA adapters; a guided job's rows are [uncond, cond]."""
        states = [latent_state(job.state) for job in jobs]
        inputs_of = [state.latents for state in states]
        if self.scales_model_input:  # every job's scale_model_input in one op (Euler's per-row sigma)
            schedulers = [state.scheduler for state in states]
            scaled = scale_model_inputs(schedulers, torch.cat(inputs_of), job_timesteps)
            inputs_of = [scaled[j : j + 1] for j in range(len(jobs))]
        latent_rows, timesteps, conditioning, adapters = [], [], [], []
        for job, state, x, t in zip(jobs, states, inputs_of, job_timesteps, strict=True):
            branches = [state.conditional]
            if state.unconditional is not None:
                branches = [state.unconditional, state.conditional]
            for branch in branches:
                latent_rows.append(x)
                timesteps.append(t)
                conditioning.append({**branch, **state.extra})
                adapters.append(image_params(job).lora)  # both CFG rows: the pipeline adapts both halves
        inputs = {name: torch.cat([c[name] for c in conditioning]) for name in conditioning[0]}
        return latent_rows, self.timestep_rows(timesteps), inputs, adapters

    @property
    def uncapturable(self) -> str | None:
        """Why this model's forwards cannot be captured (config ``cuda_graphs``), or None."""
        if not self.captures_forwards:
            return f"{type(self.model).__name__}'s forward reads values back to the host"
        if not self.starter.serves_text:
            return "an inpainting checkpoint's forwards are captured from text jobs, which it refuses"
        return None

    def capture_forwards(
        self, warm: Sequence[tuple[ImageParams, int]], capture: Capture | None = None
    ) -> int:
        """Run forwards through CUDA graphs (config ``cuda_graphs``), captured now for the shape of each
        ``warm`` request at every row bucket up to its model rows (captured_forwards.py). Returns the
        graphs captured; raises CaptureError. (``capture``: CUDA's, unless a test's.)"""
        return capture_adapter_forwards(self, warm, capture)

    # ---- one forward ---------------------------------------------------------------------------------
    def step(self, jobs: list[Job], previews: Sequence[bool] | None = None) -> ForwardResult:
        """One forward over every job's rows, guidance and each job's own scheduler step; ``previews[i]``:
        job i's latents are copied for a preview. Jobs of different sizes share the forward packed
        (``RowSizes.predict_packed``), then each size's rows are guided and stepped together. Returns a
        JobStep per job; raising means no job's state changed (the engine retries smaller)."""
        states = [latent_state(job.state) for job in jobs]
        job_timesteps = [state.timesteps[job.run.steps_done] for job, state in zip(jobs, states, strict=True)]
        latent_rows, timesteps, inputs, adapters = self.forward_inputs(jobs, job_timesteps)
        # Jobs by latent shape: a job's group where it keeps to one (a shape; DiT's bin of sizes), its size
        # where it shares forwards with every size.
        by_size: dict[Hashable, list[int]] = {}
        for j, job in enumerate(jobs):
            by_size.setdefault(
                image_params(job).size if job.run.group == ANY_SIZE else job.run.group, []
            ).append(j)
        plan = self._cache_plan(jobs, adapters)
        padded = 0
        with torch.inference_mode(), self.adapted_rows(adapters), self.caches.running(plan):
            if len(by_size) == 1:
                # A captured graph where there is one (a forward with cached rows runs eagerly: its blocks
                # run on the rows that compute, which a graph's fixed shapes cannot follow).
                forward = self.predict if self.captured is None or plan is not None else self.captured
                predictions = forward(torch.cat(latent_rows), timesteps, inputs, image_params(jobs[0]).size)
                parts = [(list(range(len(jobs))), self._guided_noise(states, predictions))]
            else:  # packed: eagerly (graphs are captured per shape); never with cached rows (group_of)
                assert plan is None, "a job with a step cache shares forwards with its own size only"
                each_size = [image_params(job).size for job in jobs for _ in range(self.model_rows(job))]
                rows, padded = self.sizes.predict_packed(
                    self.predict, latent_rows, timesteps, inputs, each_size
                )
                parts = self._guided_by_size(jobs, states, rows, by_size)
        # The forward succeeded: only now does any job's state change. Every group's rows are gathered
        # before any job steps: a raise here (out of memory) leaves every job as it was, so the engine's
        # retry cannot step a job twice.
        groups: list[tuple[list[int], torch.Tensor]] = []
        alone: list[tuple[int, torch.Tensor]] = []
        for members, noise in parts:
            by_class: dict[type, list[int]] = {}
            for k, j in enumerate(members):
                if can_batch(states[j].scheduler) and not self.step_output(jobs[j]):
                    by_class.setdefault(type(states[j].scheduler), []).append(k)
                else:
                    alone.append((j, noise[k : k + 1]))
            groups += [([members[k] for k in ks], take_rows(noise, ks)) for ks in by_class.values()]
        if plan is not None:  # nothing below raises for everyone: the caches' staged updates take effect
            self.caches.commit(plan)
        errors: dict[int, Failure] = {}
        for j, job_noise in alone:
            error = self._step_alone(states[j], job_noise, job_timesteps[j], self.step_output(jobs[j]))
            if error is not None:
                errors[j] = error
        for members, group_noise in groups:
            group_timesteps = [job_timesteps[j] for j in members]
            failed = self._step_together([states[j] for j in members], group_noise, group_timesteps)
            errors.update((members[k], error) for k, error in failed.items())
        for j, job in enumerate(jobs):
            if states[j].inpaint is not None and j not in errors:  # blended (an ordinary denoiser)
                error = self._blend_source(states[j], job.run.steps_done)
                if error is not None:
                    errors[j] = error
        reused = reused_rows(plan) if plan is not None else {}  # by the id of a job's cache state
        previews = previews or [False] * len(jobs)
        steps = [
            self._job_step(job, errors.get(j), reused.get(id(latent_state(job.state).cache), 0), previews[j])
            for j, job in enumerate(jobs)
        ]
        return ForwardResult(
            steps,
            rows=len(adapters),
            adapters=len({n for a in adapters for n, _ in a}),
            padded_tokens=padded,
        )

    def _guided_by_size(
        self,
        jobs: list[Job],
        states: list[LatentJob],
        rows: list[torch.Tensor],
        by_size: dict[Hashable, list[int]],
    ) -> list[tuple[list[int], torch.Tensor]]:
        """A packed forward's per-row predictions, guided per size: (the jobs, their noise) for each size."""
        first, row = [], 0  # each job's first model row
        for job in jobs:
            first.append(row)
            row += self.model_rows(job)
        parts = []
        for members in by_size.values():
            taken = [rows[r] for j in members for r in range(first[j], first[j] + self.model_rows(jobs[j]))]
            parts.append((members, self._guided_noise([states[j] for j in members], torch.cat(taken))))
        return parts

    def _job_step(self, job: Job, error: Failure | None, reused: int, preview: bool) -> JobStep:
        if error is not None:
            return JobStep(job.run.steps_done, error=error)
        step = job.run.steps_done + 1
        rows = self.model_rows(job)
        snapshot = self._preview_snapshot(job) if preview else None
        done = step >= job.run.total_steps
        return JobStep(step, done, rows_computed=rows - reused, rows_reused=reused, snapshot=snapshot)

    def _preview_snapshot(self, job: Job) -> torch.Tensor | None:
        """The job's snapshot, or None if taking it fails: every state has changed by now, so a raise
        would have the engine retry (and step) the jobs again; a lost preview costs nothing else."""
        try:
            return self.snapshot(job)
        except Exception as exc:
            if is_device_lost(exc):
                raise
            log.warning("request %s: preview snapshot failed: %s", job.request.request_id, exc)
            return None

    def _blend_source(self, state: LatentJob, i: int) -> Failure | None:
        """StableDiffusionInpaintPipeline after step ``i`` (4-channel UNet): outside the mask the latents
        become the source noised to the next timestep (the clean source after the last step). Returns this
        job's own failure, if any."""
        source = state.inpaint
        try:
            # Blended sources only (an ordinary denoiser's): the encoded source and its mask are set.
            assert source is not None and source.image_latents is not None and source.mask is not None
            proper = source.image_latents
            if i < len(state.timesteps) - 1:
                next_timestep = state.timesteps[i + 1 : i + 2]  # a view where it lives: no host sync
                proper = self.starter.noise_source(state.scheduler, proper, source.noise, next_timestep)
            state.latents = (1 - source.mask) * proper + source.mask * state.latents
        except Exception as exc:  # noqa: BLE001  (this job's own blend: it fails alone)
            return _own_failure(exc)
        return None

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
        uncond = take_rows(predictions, [r for r, g in zip(first_rows, guided, strict=True) if g])
        cond = take_rows(predictions, [r + 1 for r, g in zip(first_rows, guided, strict=True) if g])
        mixed = guide(uncond, cond, scales)
        noise, k = [], 0
        for r, g in zip(first_rows, guided, strict=True):
            noise.append(mixed[k : k + 1] if g else predictions[r : r + 1])
            k += g
        return torch.cat(noise)

    def _step_together(
        self, states: list[LatentJob], noise: torch.Tensor, timesteps: list[torch.Tensor]
    ) -> dict[int, Failure]:
        """One scheduler class's jobs in one vectorised call. It is atomic (a raise changes no scheduler), so
        on a failure each job steps alone and only the job whose own step fails fails. Returns those
        failures by position."""
        schedulers = [state.scheduler for state in states]
        kwargs = [state.step_kwargs for state in states]
        stepped = None
        try:
            latents = torch.cat([state.latents for state in states])
            stepped = vectorised_step(schedulers, noise, timesteps, latents, kwargs)
        except Exception as exc:  # noqa: BLE001  (redone job by job below: the culprit fails alone)
            if Failure.of(exc).lost:
                raise
            name = type(schedulers[0]).__name__
            log.warning(
                "vectorised %s step of %d jobs failed (%r); stepping them one by one", name, len(states), exc
            )
        if stepped is not None:
            # Each job keeps a [1, ...] view of the result: diffusers' steps are out of place and the next
            # step's torch.cat copies, so no row is ever written through another's view.
            for j, state in enumerate(states):
                state.latents = stepped[j : j + 1]
            return {}
        errors = {}
        for j, state in enumerate(states):
            error = self._step_alone(state, noise[j : j + 1], timesteps[j])
            if error is not None:
                errors[j] = error
        return errors

    @staticmethod
    def _step_alone(
        state: LatentJob, noise: torch.Tensor, timestep: torch.Tensor, output: int = 0
    ) -> Failure | None:
        """One job's own scheduler step (its ``output``-th result becomes the latents). Returns its own
        failure, if any."""
        try:
            scheduler = state.scheduler
            outputs = scheduler.step(noise, timestep, state.latents, **state.step_kwargs, return_dict=False)
            state.latents = outputs[output]  # requests whose scheduler lacks it are refused at parse
        except Exception as exc:  # noqa: BLE001  (this job's own scheduler: it fails alone)
            return _own_failure(exc)
        return None

    def finish(self, jobs: list[Job]) -> Sequence[object]:
        """Decode the done jobs, those of one size together; outputs in the jobs' order."""
        by_size: dict[tuple[int, int], list[int]] = {}
        for j, job in enumerate(jobs):
            by_size.setdefault(image_params(job).size, []).append(j)
        outputs: list[object] = [None] * len(jobs)
        with torch.inference_mode():
            for size, members in by_size.items():
                decoded = self.decode(torch.cat([latent_state(jobs[j].state).latents for j in members]), size)
                for j, output in zip(members, decoded, strict=True):
                    outputs[j] = output
        return outputs

    def snapshot(self, job: Job) -> torch.Tensor:
        """A copy of the job's latents for a preview (the PNG is made on the response thread while the job
        steps on)."""
        return self.preview_latent(latent_state(job.state).latents, image_params(job).size).clone()


def _own_failure(exc: Exception) -> Failure:
    """A failure of one job's own math is that job's alone (out of memory too: UNAVAILABLE, as a forward
    that fails alone); a lost device is everyone's (the engine answers what it holds and the process
    restarts)."""
    failure = Failure.of(exc)
    if failure.lost:
        raise exc
    return failure
