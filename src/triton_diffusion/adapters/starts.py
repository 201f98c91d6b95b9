"""How a latent job starts, as its diffusers pipeline starts it: from text (noise drawn from the row's
generator, as the text-to-image pipeline's ``prepare_latents``); from a source image (img2img, as the
family's img2img pipeline: ``get_timesteps`` trims the schedule by ``strength``, the source is preprocessed
by its ``image_processor``, VAE-encoded and sampled with the row's own generator, and noised at the first
remaining timestep); or from a source image and a mask (inpainting with an ordinary denoiser, as
``StableDiffusionInpaintPipeline`` and the SDXL, SD3 and FLUX.1 inpaint pipelines: after every step the
latents outside the mask are replaced by the source noised to the next timestep; with an inpainting
checkpoint the mask and the masked source's latents are model inputs instead). The start is data in the
job's params (``ImageParams.start``), not another engine: from then on every job is the same.

``JobStarts.prepare`` reads as a diffusers ``__call__`` does: encode the prompts, set each job's
timesteps, make its starting latents, and return each job's start. A job whose request was resent after
a crash with a checkpoint of it starts the same way, then takes the checkpoint's state and steps on from
there (``JobStarts.resumed``); ``JobStarts.checkpoint`` takes those checkpoints.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import diffusers
import torch
from diffusers.utils.torch_utils import randn_tensor

from triton_diffusion.adapters.diffusers_compat import job_scheduler
from triton_diffusion.adapters.diffusers_pipeline import row_generator
from triton_diffusion.adapters.image_params import (
    Conditioning,
    ImageParams,
    InpaintSource,
    LatentJob,
    as_run,
    latent_state,
)
from triton_diffusion.adapters.job_checkpoints import (
    CheckpointMismatch,
    restore,
    snapshot_if_able,
)
from triton_diffusion.adapters.lora import LoraSet
from triton_diffusion.engine.failures import Failure
from triton_diffusion.engine.jobs import Job, JobStart
from triton_diffusion.recovery.checkpoint_format import JobCheckpoint

log = logging.getLogger("triton_diffusion")

if TYPE_CHECKING:
    from triton_diffusion.adapters.lora import LoraBank
    from triton_diffusion.adapters.row_sizes import RowSizes
    from triton_diffusion.adapters.step_caches import CacheState
    from triton_diffusion.families import PipelineFacts


class StartHooks(Protocol):
    """What a job's start reads of its family's step adapter (latent_loop.py's LatentStepAdapter and the
    family's hooks): its loaded parts and the hooks of its loop."""

    inpainting_checkpoint: bool
    scales_model_input: bool
    always_passes_step_kwargs: bool
    loras: LoraBank | None
    facts: PipelineFacts
    pipe: Any
    pipelines: dict[str, Any]
    templates: dict[str, Any]
    device: torch.device
    dtype: torch.dtype
    latent_dtype: torch.dtype
    sizes: RowSizes

    @property
    def model(self) -> Any: ...
    def encode(self, requests: Sequence[ImageParams]) -> list[Conditioning]: ...
    def initial_latents(
        self,
        requests: Sequence[ImageParams],
        schedulers: Sequence[Any],
        generators: list[torch.Generator],
    ) -> torch.Tensor: ...
    def set_timesteps(self, scheduler: Any, request: ImageParams) -> torch.Tensor: ...
    def pack(self, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor: ...
    def uses_guidance(self, request: ImageParams) -> bool: ...
    def guidance_scale(self, request: ImageParams) -> float: ...
    def extra_inputs(self, request: ImageParams) -> dict[str, torch.Tensor]: ...
    def new_cache_state(self, request: ImageParams, guided: bool) -> CacheState | None: ...


class JobStarts:
    """The start of every latent job: text, img2img and inpainting, composed into LatentStepAdapter
    (latent_loop.py ``starter``), whose hooks (``encode``, ``initial_latents``, ``set_timesteps``, ...) it
    calls. A family whose image starts differ from the SD pipelines' (this class) gives its adapter a
    subclass (``LatentStepAdapter.starts_class``: flow_matching.py, stable_diffusion.py, ...)."""

    def __init__(self, adapter: StartHooks) -> None:
        self.adapter = adapter

    def supports(self, start: str) -> bool:
        """Whether this family's adapter can start jobs this way (``image``, ``mask``) with this model."""
        return False

    @property
    def serves_text(self) -> bool:
        """Whether jobs may start from text alone (not with an inpainting checkpoint, which needs a mask)."""
        return not self.adapter.inpainting_checkpoint

    @property
    def starts(self) -> tuple[str, ...]:
        """The starts served: ``text`` and those of ``image``/``mask`` the family declares and supports."""
        return tuple(start for start in self.adapter.pipelines if start != "text" or self.serves_text)

    def default_strength(self, start: str) -> float:
        """The ``strength`` the start's diffusers pipeline defaults to (img2img 0.8, SDXL 0.3, ...)."""
        return float(inspect.signature(self.adapter.pipelines[start].__call__).parameters["strength"].default)

    def first_step(self, steps: int, strength: float) -> int:
        """Where an image-conditioned job enters its schedule (``t_start`` of the pipeline's
        ``get_timesteps``): SD and SDXL round the steps that run down."""
        return max(steps - min(int(steps * strength), steps), 0)

    def encode_source(self, pixels: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        """[n, ...] latents of preprocessed source images, each row sampled with its own generator."""
        raise NotImplementedError

    def noise_source(
        self, scheduler: Any, image_latents: torch.Tensor, noise: torch.Tensor, timestep: torch.Tensor
    ) -> torch.Tensor:
        """One row's source latents noised to ``timestep`` by its own scheduler."""
        return scheduler.add_noise(image_latents, noise, timestep)

    def source_noise_shape(self, size: tuple[int, int]) -> tuple[int, ...]:
        """The shape of one image-conditioned row's noise, as its pipeline's ``prepare_latents`` draws it
        (before packing): the VAE's latent channels at latent size."""
        factor = self.adapter.pipe.vae_scale_factor
        return (1, self.adapter.pipe.vae.config.latent_channels, size[0] // factor, size[1] // factor)

    def encodes_source(self, request: ImageParams) -> bool:
        """Whether the start's pipeline VAE-encodes the source (a draw from the row's generator) before it
        draws the noise: always, except the SD, SDXL and SD3 inpaint pipelines with an inpainting
        checkpoint at strength 1 (pure noise)."""
        return not (self.adapter.inpainting_checkpoint and request.strength == 1.0)

    def pack_mask(self, mask: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """A [1, 1, h, w] latent-size mask into the loop's layout (it broadcasts over the channels)."""
        return mask

    def encode_with_loras(self, requests: list[ImageParams]) -> list[Conditioning]:
        """``encode``, once per distinct adapter set where the text encoders carry adapters (the pipeline
        encodes the prompt and the negative prompt with the adapted encoder), else in one call."""
        adapter, loras = self.adapter, self.adapter.loras
        if loras is None or not loras.text_encoder_layers:
            return adapter.encode(requests)
        by_set: dict[LoraSet, list[int]] = {}
        for i, request in enumerate(requests):
            by_set.setdefault(request.lora, []).append(i)
        conditioning: dict[int, Conditioning] = {}
        for adapters, indices in by_set.items():
            with loras.uniform(adapters):
                for i, encoded in zip(indices, adapter.encode([requests[i] for i in indices]), strict=True):
                    conditioning[i] = encoded
        return [conditioning[i] for i in range(len(requests))]

    # ---- the start of every job ---------------------------------------------------------------------
    def prepare(self, jobs: list[Job]) -> list[JobStart]:
        requests = [as_run(job) for job in jobs]
        starts = self.start_requests(requests)
        return [self.resumed(request, start) for request, start in zip(requests, starts, strict=True)]

    def resumed(self, request: ImageParams, start: JobStart) -> JobStart:
        """A job started as any other, then given its checkpoint's state where its request carries one
        (``ImageParams.resume``): it goes on after the checkpoint's step. Started like any other first, so
        everything not in the checkpoint (text conditioning, the inpainting source) is made as usual. A
        checkpoint that does not fit the job (another model, another version) is dropped: the job starts
        afresh (never from a half-restored state) and its request's BATCH says why."""
        if request.resume is None:
            return start
        try:
            restore(latent_state(start.state), request.resume)
        except Exception as exc:  # noqa: BLE001  (any checkpoint that cannot be restored: start afresh)
            if not isinstance(exc, CheckpointMismatch) and Failure.of(exc).lost:
                raise
            log.warning("a checkpoint does not fit its job (%s): it starts over", exc)
            (fresh,) = self.start_requests([replace(request, resume=None)])
            return replace(fresh, warning=f"its checkpoint did not fit ({exc}): started over")
        return replace(start, steps_done=request.resume.step)

    def checkpoint(self, jobs: list[Job]) -> list[JobCheckpoint | None]:
        """Each job's resumable state now (CPU copies: the host writes them while the jobs step on), or
        None where it cannot be checkpointed exactly (a step cache's state: it would restart from its
        first step), in order (engine/step_engine.py Checkpointing)."""
        return [snapshot_if_able(job.state, job.run.steps_done) for job in jobs]

    @torch.no_grad()  # text encoders and the VAE encoder: nothing here is differentiated
    def start_requests(self, requests: list[ImageParams]) -> list[JobStart]:
        """Each request's start, together (a family may start a request at another size: dit.py)."""
        # 1. Encode the prompts: once for everyone admitted together (per adapter set where the text
        #    encoders carry LoRA adapters).
        conditioning = self.encode_with_loras(requests)
        # 2. Timesteps: each job's own scheduler and schedule (the pipeline's retrieve_timesteps), trimmed
        #    by strength for an image start (get_timesteps). One generator per row: it draws the row's
        #    noise, then (stochastic samplers) its step noise.
        generators = [row_generator(r.seed, r.image_index) for r in requests]
        schedulers, timesteps = [], []
        for request in requests:
            scheduler = job_scheduler(self.adapter.templates[request.scheduler])
            job_timesteps = self.adapter.set_timesteps(scheduler, request)
            begin = 0
            if request.image is not None:
                assert request.strength is not None  # an image start's is filled in at parse (source_images)
                begin = self.first_step(request.steps, request.strength) * scheduler.order
                job_timesteps = job_timesteps[begin:]
            if hasattr(scheduler, "set_begin_index"):  # a diffusers scheduler API, not ours
                scheduler.set_begin_index(begin)
            schedulers.append(scheduler)
            timesteps.append(job_timesteps)
        # 3. Latents: a text start from noise, an image start from its encoded source noised to its first
        #    timestep (with the inpainting source to blend back or feed the model), per latent shape.
        starts = self.starting_latents(requests, schedulers, generators, timesteps)
        # 4. Each job's state from here on.
        prepared = []
        for i, (request, scheduler) in enumerate(zip(requests, schedulers, strict=True)):
            latents, inpaint = starts[i]
            extra = self.adapter.extra_inputs(request)
            if inpaint is not None:
                extra.update(inpaint.model_inputs)
            guided = self.adapter.uses_guidance(request) and conditioning[i].unconditional is not None
            state = LatentJob(
                latents=latents,
                scheduler=scheduler,
                timesteps=timesteps[i],
                conditional=conditioning[i].conditional,
                unconditional=conditioning[i].unconditional if guided else None,
                guidance=self.adapter.guidance_scale(request),
                step_kwargs=self._step_kwargs(scheduler, generators[i]),
                extra=extra,
                inpaint=inpaint if inpaint is not None and inpaint.blended else None,
                cache=self.adapter.new_cache_state(request, guided),
                grid=self.adapter.sizes.grid_of(request),
            )
            group, joins = self.adapter.sizes.group_of(request), self.adapter.sizes.also_joins(request)
            prepared.append(JobStart(state, group, len(timesteps[i]), also_joins=joins))
        return prepared

    def starting_latents(
        self,
        requests: list[ImageParams],
        schedulers: list[Any],
        generators: list[torch.Generator],
        timesteps: list[torch.Tensor],
    ) -> dict[int, tuple[torch.Tensor, InpaintSource | None]]:
        """Each request's starting latents (and inpainting source), drawn per latent shape in one call."""
        starts: dict[int, tuple[torch.Tensor, InpaintSource | None]] = {}
        by_size: dict[tuple[int, ...], list[int]] = {}
        for i, request in enumerate(requests):
            by_size.setdefault(request.shape, []).append(i)
        for indices in by_size.values():
            from_text = [i for i in indices if requests[i].image is None]
            from_image = [i for i in indices if requests[i].image is not None]
            if from_text:
                latents = self.adapter.initial_latents(
                    [requests[i] for i in from_text],
                    [schedulers[i] for i in from_text],
                    [generators[i] for i in from_text],
                )
                starts.update((i, (latents[row : row + 1], None)) for row, i in enumerate(from_text))
            if from_image:
                latents, sources = self.source_latents(
                    [requests[i] for i in from_image],
                    [schedulers[i] for i in from_image],
                    [generators[i] for i in from_image],
                    [timesteps[i][:1] for i in from_image],
                )
                starts.update((i, (latents[row : row + 1], sources[row])) for row, i in enumerate(from_image))
        return starts

    def source_latents(
        self,
        requests: Sequence[ImageParams],
        schedulers: Sequence[Any],
        generators: list[torch.Generator],
        first_timesteps: Sequence[torch.Tensor],
    ) -> tuple[torch.Tensor, list[InpaintSource | None]]:
        """Starting latents of image-conditioned rows of one size, as the img2img and inpaint pipelines'
        ``prepare_latents`` make them for each row: the source preprocessed and encoded (sampled with the
        row's generator), then the row's noise from the same generator, then the source noised to its
        first timestep. An inpainting row at strength 1 starts from noise alone, as diffusers' does."""
        size = height, width = requests[0].size
        pixels = [
            self.adapter.pipelines[r.start]
            .image_processor.preprocess(r.image, height=height, width=width)
            .float()
            for r in requests
        ]
        encoded = [i for i, request in enumerate(requests) if self.encodes_source(request)]
        image_latents: dict[int, torch.Tensor] = {}
        if encoded:
            latents = self.encode_source(
                torch.cat([pixels[i] for i in encoded]), [generators[i] for i in encoded]
            )
            image_latents = {i: latents[row : row + 1] for row, i in enumerate(encoded)}
        shape = self.source_noise_shape(size)
        rows: list[torch.Tensor] = []
        sources: list[InpaintSource | None] = []
        for i, request in enumerate(requests):
            scheduler, timestep = schedulers[i], first_timesteps[i]
            # In the loop's layout from here on: noising and the inpaint blend are elementwise.
            row_noise = randn_tensor(
                shape, generator=generators[i], device=self.adapter.device, dtype=self.adapter.latent_dtype
            )
            row_noise = self.adapter.pack(row_noise, size)
            source = self.adapter.pack(image_latents[i], size) if i in image_latents else None
            if request.mask_image is None:
                assert source is not None  # img2img always encodes its source (encodes_source)
                rows.append(self.noise_source(scheduler, source, row_noise, timestep))
                sources.append(None)
                continue
            if request.strength == 1.0:  # is_strength_max: pure noise, scaled as a text start is
                # (flow matching has no init_noise_sigma: SD3's takes the noise as is, FLUX.1's noises the
                # source to sigma 1, the same thing)
                rows.append(row_noise * getattr(scheduler, "init_noise_sigma", 1.0))
            else:
                assert source is not None  # below strength 1 the source is encoded (encodes_source)
                rows.append(self.noise_source(scheduler, source, row_noise, timestep))
            sources.append(self.inpaint_source(request, generators[i], source, row_noise, pixels[i]))
        return torch.cat(rows), sources

    def inpaint_source(
        self,
        request: ImageParams,
        generator: torch.Generator,
        image_latents: torch.Tensor | None,
        noise: torch.Tensor,
        pixels: torch.Tensor,
    ) -> InpaintSource:
        """What an ordinary denoiser's inpainting job blends back: its source, its noise, and the inpaint
        pipeline's mask at latent size (binarised, nearest-resized), after the one draw its
        ``prepare_mask_latents`` takes from the row's generator: it encodes the masked source (which only an
        inpainting checkpoint reads), so a stochastic sampler's later draws follow the same stream. With an
        inpainting checkpoint: the model's extra input channels, and no blend."""
        if self.adapter.inpainting_checkpoint:
            channels = self.inpaint_channels(request, generator, pixels)
            return InpaintSource(None, noise, None, {"inpaint_channels": channels})
        pipe = self.adapter.pipelines["mask"]
        height, width = request.size
        mask = self.mask_condition(request)
        factor = pipe.vae_scale_factor
        mask = torch.nn.functional.interpolate(mask, size=(height // factor, width // factor))
        if not isinstance(pipe.vae, diffusers.AutoencoderTiny):  # retrieve_latents samples a distribution
            shape = (1, pipe.vae.config.latent_channels, height // factor, width // factor)
            randn_tensor(shape, generator=generator, device=self.adapter.device, dtype=self.source_draw_dtype)
        mask = self.pack_mask(mask.to(device=self.adapter.device, dtype=self.adapter.dtype), request.size)
        return InpaintSource(image_latents, noise, mask)

    def inpaint_channels(
        self, request: ImageParams, generator: torch.Generator, pixels: torch.Tensor
    ) -> torch.Tensor:
        """An inpainting checkpoint's extra input for one row: as the SD, SDXL and SD3 inpaint pipelines
        make it, their own ``prepare_mask_latents`` (the mask at latent size, the source outside it encoded
        with the row's generator) for one row without CFG (the engine gives both CFG rows the same), the
        mask's channel first. One tensor of both: one copy per forward, not two."""
        prepare = self.adapter.pipelines["mask"].prepare_mask_latents
        height, width = request.size
        mask = self.mask_condition(request)
        # SD3's takes num_images_per_prompt too; by keyword, one call fits every signature.
        extra = (
            {"num_images_per_prompt": 1}
            if "num_images_per_prompt" in inspect.signature(prepare).parameters
            else {}
        )
        vae = self.adapter.pipelines["mask"].vae
        original = vae.dtype
        try:
            mask, masked = prepare(
                mask=mask,
                masked_image=pixels * (mask < 0.5),
                batch_size=1,
                height=height,
                width=width,
                dtype=self.adapter.dtype,
                device=self.adapter.device,
                generator=generator,
                do_classifier_free_guidance=False,
                **extra,
            )
        finally:  # SDXL's encode casts the VAE to float32 and back, without a finally: an OOM half-way
            if vae.dtype != original:  # must not leave the shared VAE in float32 for every later decode
                vae.to(dtype=original)
        return torch.cat([mask, masked], dim=1)

    def mask_condition(self, request: ImageParams) -> torch.Tensor:
        """The request's mask as its inpaint pipeline preprocesses it (grayscale, binarised, [1, 1, H, W])."""
        height, width = request.size
        return self.adapter.pipelines["mask"].mask_processor.preprocess(
            request.mask_image, height=height, width=width
        )

    @property
    def source_draw_dtype(self) -> torch.dtype:
        """The dtype in which the inpaint pipeline's VAE samples the masked source's latents."""
        return self.adapter.pipelines["mask"].vae.dtype

    def _step_kwargs(self, scheduler: Any, generator: torch.Generator) -> dict[str, Any]:
        """What the pipeline's prepare_extra_step_kwargs passes (eta for DDIM, the generator for
        stochastic samplers); flow-matching pipelines pass none."""
        if not (self.adapter.scales_model_input or self.adapter.always_passes_step_kwargs):
            return {}
        accepted = _step_parameters(scheduler)
        kwargs: dict[str, Any] = {}
        if "eta" in accepted:
            kwargs["eta"] = 0.0
        if "generator" in accepted:
            kwargs["generator"] = [generator]
        return kwargs


# The arguments each scheduler class's ``step`` takes (a signature costs more than the rest of a job's
# start around it).
_STEP_PARAMETERS: dict[type, frozenset[str]] = {}


def _step_parameters(scheduler: Any) -> frozenset[str]:
    found = _STEP_PARAMETERS.get(type(scheduler))
    if found is None:
        found = _STEP_PARAMETERS[type(scheduler)] = frozenset(inspect.signature(scheduler.step).parameters)
    return found
