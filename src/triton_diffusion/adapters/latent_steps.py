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

A job starts in one of three ways, which is data in its params (``ImageRequest.start``), not another
engine: from text (noise drawn from the row's generator, as the text-to-image pipeline's
``prepare_latents``); from a source image (img2img, as the family's img2img pipeline: ``get_timesteps``
trims the schedule by ``strength``, the source is preprocessed by its ``image_processor``, VAE-encoded and
sampled with the row's own generator, and noised at the first remaining timestep); or from a source image
and a mask (inpainting with an ordinary denoiser, as ``StableDiffusionInpaintPipeline`` and the SDXL, SD3
and FLUX.1 inpaint pipelines: after every step the latents outside the mask are replaced by the source
noised to the next timestep). From then on
every job is the same: rows of one latent size share forwards whatever their start, steps or guidance.

A family subclass says how to encode prompts, draw initial latents, encode and noise a source image, call
the model and decode (stable_diffusion.py: SD 1.x/2.x and SDXL; flow_matching.py: FLUX.1 and SD3).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import diffusers
import torch
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from triton_diffusion.adapters.batched_schedulers import (
    can_batch,
    guide,
    scale_model_inputs,
    vectorised_step,
)
from triton_diffusion.adapters.captured_forwards import Capture, CapturedForwards, CaptureError
from triton_diffusion.adapters.diffusers_pipeline import counterpart_pipeline, row_generator
from triton_diffusion.adapters.lora import NO_LORA, LoraBank, LoraSet
from triton_diffusion.engine.failures import Failure
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
    # An image-conditioned start: the source (a PIL image of this size), how much of it is re-noised, and
    # for inpainting the mask (white: repaint, black: keep).
    image: Any = None
    strength: float | None = None
    mask_image: Any = None
    lora: LoraSet = NO_LORA  # the row's LoRA adapters and scales (adapters/lora.py)
    # A video job's frame count (text_to_video); None for an image.
    num_frames: int | None = None

    @property
    def size(self) -> tuple[int, int]:
        return self.height, self.width

    @property
    def shape(self) -> tuple[int, ...]:
        """The job's shape group: rows share a forward only with rows of one latent shape, so a video's
        frame count is part of it."""
        return self.size if self.num_frames is None else (*self.size, self.num_frames)

    @property
    def start(self) -> str:
        """How the job starts: ``text``, ``image`` (img2img) or ``mask`` (inpainting)."""
        if self.image is None:
            return "text"
        return "image" if self.mask_image is None else "mask"

    @property
    def summary(self) -> str:
        """For the admission log line."""
        size = f"{self.width}x{self.height}"
        if self.num_frames is not None:
            size += f", {self.num_frames} frames"
        start = "" if self.image is None else f", from an image ({self.start}, strength {self.strength})"
        return f"{size}, {self.steps} steps, {self.scheduler}, guidance {self.guidance_scale}{start}"


@dataclass(eq=False)
class InpaintSource:
    """An inpainting job's source: with an ordinary denoiser what it blends back after each step
    (StableDiffusionInpaintPipeline's loop with a 4-channel UNet); with an inpainting checkpoint the extra
    input channels of its every forward (the mask and the masked source's latents), and no blend."""

    image_latents: torch.Tensor | None  # [1, ...] the encoded source (to blend back)
    noise: torch.Tensor  # [1, ...] the job's initial noise, reused to noise the source to each timestep
    mask: torch.Tensor | None  # [1, 1, h, w] latent-size mask: 1 where the model paints, 0 where it keeps
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # an inpainting checkpoint's

    @property
    def blended(self) -> bool:
        return not self.model_inputs


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
    inpaint: InpaintSource | None = None  # an inpainting job's source, blended back after each step


@dataclass(frozen=True)
class Conditioning:
    """What the text encoders gave one job: its conditional inputs and, with guidance, unconditional."""

    conditional: dict[str, torch.Tensor]
    unconditional: dict[str, torch.Tensor] | None


class LatentStepAdapter:
    """The loop body shared by every latent diffusion family. Subclasses fill in the hooks."""

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
    captured: CapturedForwards | None = None  # set by capture_forwards
    # An inpainting checkpoint (SD/SDXL 9-channel UNets, SD3's 33-channel transformer, FLUX.1 Fill): the
    # mask and the masked source's latents are inputs of every forward (``inpaint_channels``), so it
    # serves inpainting jobs only and blends nothing back. Set by the family before this __init__.
    inpainting_checkpoint = False

    def __init__(self, pipe: Any, facts: PipelineFacts, schedulers: Any, max_sequence_length: int | None):
        traits = facts.traits
        self.facts = facts  # read by supports()
        # The family's pipeline for each start, all over the loaded modules (``pipe`` may be any of them:
        # image_to_image loads the img2img class). ``self.pipe`` is the text-to-image one: its code is what
        # the loop body mirrors; the others supply only their own start (and SDXL img2img's time ids).
        self.pipe = counterpart_pipeline(pipe, traits.text_pipeline or type(pipe).__name__)
        self.pipelines = {"text": self.pipe}
        for start, name in (("image", traits.image_pipeline), ("mask", traits.inpaint_pipeline)):
            if name is not None and self.supports(start):
                self.pipelines[start] = counterpart_pipeline(pipe, name)
        self.max_sequence_length = (
            max_sequence_length or facts.default("max_sequence_length") or self.fallback_max_sequence_length
        )
        self.device = self.pipe._execution_device
        self.dtype = self.model.dtype
        self.latent_dtype = self.dtype  # what latents are drawn and stepped in (Qwen-Image: its text's)
        self.module = sys.modules[type(self.pipe).__module__]  # the pipeline's own retrieve_timesteps & co
        # Pristine scheduler templates: each job steps a copy of its own.
        self.templates = {
            name: type(schedulers[name]).from_config(schedulers[name].config) for name in schedulers.names
        }

    # ---- hooks --------------------------------------------------------------------------------------
    @property
    def model(self) -> Any:
        """The denoising network: the pipeline's transformer (the UNet families override it)."""
        return self.pipe.transformer

    def supports(self, start: str) -> bool:
        """Whether this family's adapter can start jobs this way (``image``, ``mask``) with this model."""
        return False

    @property
    def serves_text(self) -> bool:
        """Whether jobs may start from text alone (not with an inpainting checkpoint, which needs a mask)."""
        return not self.inpainting_checkpoint

    @property
    def starts(self) -> tuple[str, ...]:
        """The starts served: ``text`` and those of ``image``/``mask`` the family declares and supports."""
        return tuple(start for start in self.pipelines if start != "text" or self.serves_text)

    def default_strength(self, start: str) -> float:
        """The ``strength`` the start's diffusers pipeline defaults to (img2img 0.8, SDXL 0.3, ...)."""
        return float(inspect.signature(self.pipelines[start].__call__).parameters["strength"].default)

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

    def pack(self, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """[n, C, h, w] latents into the loop's layout (Flux packs 2x2 patches)."""
        return latents

    def source_noise_shape(self, size: tuple[int, int]) -> tuple[int, ...]:
        """The shape of one image-conditioned row's noise, as its pipeline's ``prepare_latents`` draws it
        (before packing): the VAE's latent channels at latent size."""
        factor = self.pipe.vae_scale_factor
        return (1, self.pipe.vae.config.latent_channels, size[0] // factor, size[1] // factor)

    def encodes_source(self, request: ImageRequest) -> bool:
        """Whether the start's pipeline VAE-encodes the source (a draw from the row's generator) before it
        draws the noise: always, except the SD, SDXL and SD3 inpaint pipelines with an inpainting
        checkpoint at strength 1 (pure noise)."""
        return not (self.inpainting_checkpoint and request.strength == 1.0)

    def pack_mask(self, mask: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """A [1, 1, h, w] latent-size mask into the loop's layout (it broadcasts over the channels)."""
        return mask

    def uses_guidance(self, request: ImageRequest) -> bool:
        """Whether the job adds an unconditional row: classic CFG, as the pipelines' ``guidance_scale > 1``
        (true-CFG families and Z-Image override it)."""
        return self.guidance_scale(request) > 1.0

    def guidance_scale(self, request: ImageRequest) -> float:
        return float(request.guidance_scale or 0.0)

    def encode(self, requests: Sequence[ImageRequest]) -> list[Conditioning]:
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

    def retrieve_timesteps(
        self,
        scheduler: Any,
        steps: int,
        sigmas: Any = None,
        image_seq_len: int | None = None,
        max_shift: float = 1.15,
    ) -> torch.Tensor:
        """The pipeline module's ``retrieve_timesteps`` on the schedule device; with ``image_seq_len``, the
        flow-matching pipelines' resolution-dependent shift ``mu`` (its ``calculate_shift`` between the
        scheduler config's bounds, ``max_shift`` where the config has none)."""
        kwargs = {}
        if image_seq_len is not None:
            config = scheduler.config
            kwargs["mu"] = self.module.calculate_shift(
                image_seq_len,
                config.get("base_image_seq_len", 256),
                config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5),
                config.get("max_shift", max_shift),
            )
        timesteps, _ = self.module.retrieve_timesteps(
            scheduler, steps, self.schedule_device, sigmas=sigmas, **kwargs
        )
        return timesteps

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
        """Per-row model inputs besides the text (the guidance value of a guidance-distilled transformer);
        shared by both CFG rows."""
        if not self.guidance_embeds:
            return {}
        return {"guidance": torch.full([1], request.guidance_scale, device=self.device, dtype=torch.float32)}

    def decode(self, latents: torch.Tensor, size: tuple[int, int]) -> list[Image.Image]:
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

    @staticmethod
    def distinct_adapters(jobs: list[Job]) -> int:
        """LoRA adapters among the jobs of a forward (the engine's per-forward metric)."""
        return len({name for job in jobs for name, _ in job.params.lora})

    def encode_with_loras(self, requests: list[ImageRequest]) -> list[Conditioning]:
        """``encode``, once per distinct adapter set where the text encoders carry adapters (the pipeline
        encodes the prompt and the negative prompt with the adapted encoder), else in one call."""
        if self.loras is None or not self.loras.text_encoder_layers:
            return self.encode(requests)
        by_set: dict[LoraSet, list[int]] = {}
        for i, request in enumerate(requests):
            by_set.setdefault(request.lora, []).append(i)
        conditioning: list[Conditioning | None] = [None] * len(requests)
        for adapters, indices in by_set.items():
            with self.loras.uniform(adapters):
                for i, encoded in zip(indices, self.encode([requests[i] for i in indices]), strict=True):
                    conditioning[i] = encoded
        return conditioning  # type: ignore[return-value]

    # ---- the step adapter -------------------------------------------------------------------------------
    @torch.no_grad()  # text encoders and the VAE encoder: nothing here is differentiated
    def prepare(self, jobs: list[Job]) -> None:
        requests: list[ImageRequest] = [job.params for job in jobs]
        conditioning = self.encode_with_loras(requests)
        # One generator per row: it draws the row's noise, then (stochastic samplers) its step noise.
        generators = [row_generator(r.seed, r.image_index) for r in requests]
        schedulers, timesteps = [], []
        for request in requests:
            scheduler = copy.deepcopy(self.templates[request.scheduler])
            job_timesteps = self.set_timesteps(scheduler, request)
            begin = 0
            if request.image is not None:  # the pipeline's get_timesteps: strength trims the schedule
                begin = self.first_step(request.steps, request.strength) * scheduler.order
                job_timesteps = job_timesteps[begin:]
            if hasattr(scheduler, "set_begin_index"):
                scheduler.set_begin_index(begin)
            schedulers.append(scheduler)
            timesteps.append(job_timesteps)
        starts: dict[int, tuple[torch.Tensor, InpaintSource | None]] = {}  # each job's latents
        by_size: dict[tuple[int, ...], list[int]] = {}
        for i, request in enumerate(requests):
            by_size.setdefault(request.shape, []).append(i)
        for indices in by_size.values():
            from_text = [i for i in indices if requests[i].image is None]
            from_image = [i for i in indices if requests[i].image is not None]
            if from_text:
                latents = self.initial_latents(
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
        for i, (job, request, scheduler) in enumerate(zip(jobs, requests, schedulers, strict=True)):
            latents, inpaint = starts[i]
            extra = self.extra_inputs(request)
            if inpaint is not None:
                extra.update(inpaint.model_inputs)
            guided = self.uses_guidance(request) and conditioning[i].unconditional is not None
            job.group, job.total_steps = request.shape, len(timesteps[i])
            job.state = LatentJob(
                latents=latents,
                scheduler=scheduler,
                timesteps=timesteps[i],
                conditional=conditioning[i].conditional,
                unconditional=conditioning[i].unconditional if guided else None,
                guidance=self.guidance_scale(request),
                step_kwargs=self._step_kwargs(scheduler, generators[i]),
                extra=extra,
                inpaint=inpaint if inpaint is not None and inpaint.blended else None,
            )

    def source_latents(
        self,
        requests: Sequence[ImageRequest],
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
            self.pipelines[r.start].image_processor.preprocess(r.image, height=height, width=width).float()
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
        rows, sources = [], []
        for i, request in enumerate(requests):
            scheduler, timestep = schedulers[i], first_timesteps[i]
            # In the loop's layout from here on: noising and the inpaint blend are elementwise.
            row_noise = randn_tensor(
                shape, generator=generators[i], device=self.device, dtype=self.latent_dtype
            )
            row_noise = self.pack(row_noise, size)
            source = self.pack(image_latents[i], size) if i in image_latents else None
            if request.mask_image is None:
                rows.append(self.noise_source(scheduler, source, row_noise, timestep))
                sources.append(None)
                continue
            if request.strength == 1.0:  # is_strength_max: pure noise, scaled as a text start is
                # (flow matching has no init_noise_sigma: SD3's takes the noise as is, FLUX.1's noises the
                # source to sigma 1, the same thing)
                rows.append(row_noise * getattr(scheduler, "init_noise_sigma", 1.0))
            else:
                rows.append(self.noise_source(scheduler, source, row_noise, timestep))
            sources.append(self.inpaint_source(request, generators[i], source, row_noise, pixels[i]))
        return torch.cat(rows), sources

    def inpaint_source(
        self,
        request: ImageRequest,
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
        if self.inpainting_checkpoint:
            channels = self.inpaint_channels(request, generator, pixels)
            return InpaintSource(None, noise, None, {"inpaint_channels": channels})
        pipe = self.pipelines["mask"]
        height, width = request.size
        mask = self.mask_condition(request)
        factor = pipe.vae_scale_factor
        mask = torch.nn.functional.interpolate(mask, size=(height // factor, width // factor))
        if not isinstance(pipe.vae, diffusers.AutoencoderTiny):  # retrieve_latents samples a distribution
            shape = (1, pipe.vae.config.latent_channels, height // factor, width // factor)
            randn_tensor(shape, generator=generator, device=self.device, dtype=self.source_draw_dtype)
        mask = self.pack_mask(mask.to(device=self.device, dtype=self.dtype), request.size)
        return InpaintSource(image_latents, noise, mask)

    def inpaint_channels(
        self, request: ImageRequest, generator: torch.Generator, pixels: torch.Tensor
    ) -> torch.Tensor:
        """An inpainting checkpoint's extra input for one row: as the SD, SDXL and SD3 inpaint pipelines
        make it, their own ``prepare_mask_latents`` (the mask at latent size, the source outside it encoded
        with the row's generator) for one row without CFG (the engine gives both CFG rows the same), the
        mask's channel first. One tensor of both: one copy per forward, not two."""
        prepare = self.pipelines["mask"].prepare_mask_latents
        height, width = request.size
        mask = self.mask_condition(request)
        # SD3's takes num_images_per_prompt too; by keyword, one call fits every signature.
        extra = (
            {"num_images_per_prompt": 1}
            if "num_images_per_prompt" in inspect.signature(prepare).parameters
            else {}
        )
        vae = self.pipelines["mask"].vae
        original = vae.dtype
        try:
            mask, masked = prepare(
                mask=mask,
                masked_image=pixels * (mask < 0.5),
                batch_size=1,
                height=height,
                width=width,
                dtype=self.dtype,
                device=self.device,
                generator=generator,
                do_classifier_free_guidance=False,
                **extra,
            )
        finally:  # SDXL's encode casts the VAE to float32 and back, without a finally: an OOM half-way
            if vae.dtype != original:  # must not leave the shared VAE in float32 for every later decode
                vae.to(dtype=original)
        return torch.cat([mask, masked], dim=1)

    def mask_condition(self, request: ImageRequest) -> torch.Tensor:
        """The request's mask as its inpaint pipeline preprocesses it (grayscale, binarised, [1, 1, H, W])."""
        height, width = request.size
        return self.pipelines["mask"].mask_processor.preprocess(
            request.mask_image, height=height, width=width
        )

    @property
    def source_draw_dtype(self) -> torch.dtype:
        """The dtype in which the inpaint pipeline's VAE samples the masked source's latents."""
        return self.pipelines["mask"].vae.dtype

    def model_rows(self, job: Job) -> int:
        return 2 if job.state.unconditional is not None else 1

    def step_output(self, job: Job) -> int:
        """Which output of the scheduler's ``step`` becomes the job's latents: the stepped sample (0), or
        where the pipeline's loop keeps another (``one_step_keeps_original``, PixArt-Alpha after one step:
        the predicted original sample, 1), that index; such a job steps alone."""
        return 1 if self.facts.traits.one_step_keeps_original and job.params.steps == 1 else 0

    def forward_inputs(
        self, jobs: list[Job], job_timesteps: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], list[LoraSet]]:
        """One forward's model rows for these jobs at these timesteps: the latents (scaled by each job's
        scheduler where the family scales them), the per-row timestep vector, the conditioning inputs and
        each row's LoRA adapters; a guided job's rows are [uncond, cond]."""
        states: list[LatentJob] = [job.state for job in jobs]
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
                adapters.append(job.params.lora)  # both CFG rows: the pipeline adapts both halves
        inputs = {name: torch.cat([c[name] for c in conditioning]) for name in conditioning[0]}
        return torch.cat(latent_rows), self.timestep_rows(timesteps), inputs, adapters

    @property
    def uncapturable(self) -> str | None:
        """Why this model's forwards cannot be captured (config ``cuda_graphs``), or None."""
        if not self.captures_forwards:
            return f"{type(self.model).__name__}'s forward reads values back to the host"
        if not self.serves_text:
            return "an inpainting checkpoint's forwards are captured from text jobs, which it refuses"
        return None

    def capture_forwards(
        self, warm: Sequence[tuple[ImageRequest, int]], capture: Capture | None = None
    ) -> int:
        """Run forwards through CUDA graphs (config ``cuda_graphs``, captured_forwards.py), captured now for
        the shape of each ``warm`` request (one per size to serve captured) at every row bucket up to its
        model rows; others run eagerly. Returns the graphs captured; raises CaptureError. (``capture``:
        CUDA's, unless a test's.)"""
        if self.uncapturable is not None:
            raise CaptureError(self.uncapturable)
        captured = CapturedForwards(self.predict, self.device, capture)
        count = 0
        for request, max_rows in warm:
            job = Job(request=None, params=request)  # never stepped: only its first forward's inputs are used
            try:
                self.prepare([job])
                with torch.inference_mode():
                    latents, timesteps, inputs, _ = self.forward_inputs([job], [job.state.timesteps[0]])
            except Exception as exc:
                if Failure.of(exc).lost:
                    raise
                raise CaptureError(f"the warm-up request at {request.size} failed: {exc!r}") from exc
            with torch.inference_mode():
                count += captured.warm(latents, timesteps, inputs, request.size, max_rows)
        self.captured = captured
        return count

    def step(self, jobs: list[Job]) -> list[Job]:
        states: list[LatentJob] = [job.state for job in jobs]
        job_timesteps = [state.timesteps[job.steps_done] for job, state in zip(jobs, states, strict=True)]
        latents, timesteps, inputs, adapters = self.forward_inputs(jobs, job_timesteps)
        size = jobs[0].params.size  # one shape group per forward
        forward = self.predict if self.captured is None else self.captured
        with torch.inference_mode(), self.adapted_rows(adapters):
            predictions = forward(latents, timesteps, inputs, size)
        # The forward succeeded: only now does any job's state change.
        noise = self._guided_noise(states, predictions)
        by_class: dict[type, list[int]] = {}
        alone: list[int] = []
        for j, state in enumerate(states):
            if can_batch(state.scheduler) and not self.step_output(jobs[j]):
                by_class.setdefault(type(state.scheduler), []).append(j)
            else:
                alone.append(j)
        # Every group's rows are gathered before any job steps: a raise here (out of memory) leaves every
        # job as it was, so the engine's retry cannot step a job twice.
        groups = [(members, _rows(noise, members)) for members in by_class.values()]
        for j in alone:
            self._step_alone(jobs[j], noise[j : j + 1], job_timesteps[j], self.step_output(jobs[j]))
        for members, group_noise in groups:
            group_timesteps = [job_timesteps[j] for j in members]
            self._step_together([jobs[j] for j in members], group_noise, group_timesteps)
        for job in jobs:
            if job.state.inpaint is not None and job.failure is None:  # blended (an ordinary denoiser)
                self._blend_source(job)
        return [job for job in jobs if job.failure is None and job.steps_done + 1 >= job.total_steps]

    def _blend_source(self, job: Job) -> None:
        """StableDiffusionInpaintPipeline after each step (4-channel UNet): outside the mask the latents
        become the source noised to the next timestep (the clean source after the last step)."""
        state: LatentJob = job.state
        source = state.inpaint
        try:
            proper = source.image_latents
            i = job.steps_done
            if i < len(state.timesteps) - 1:
                next_timestep = state.timesteps[i + 1 : i + 2]  # a view where it lives: no host sync
                proper = self.noise_source(state.scheduler, proper, source.noise, next_timestep)
            state.latents = (1 - source.mask) * proper + source.mask * state.latents
        except Exception as exc:  # noqa: BLE001  (this job's own blend: it fails alone)
            _fail_alone(job, exc)

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
            stepped = vectorised_step(schedulers, noise, timesteps, latents, kwargs)
        except Exception as exc:  # noqa: BLE001  (redone job by job below: the culprit fails alone)
            if Failure.of(exc).lost:
                raise
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
    def _step_alone(job: Job, noise: torch.Tensor, timestep: torch.Tensor, output: int = 0) -> None:
        """One job's own scheduler step (its ``output``-th result becomes the latents); its failure is
        this job's alone."""
        state: LatentJob = job.state
        try:
            scheduler = state.scheduler
            outputs = scheduler.step(noise, timestep, state.latents, **state.step_kwargs, return_dict=False)
            state.latents = outputs[output]  # requests whose scheduler lacks it are refused at parse
        except Exception as exc:  # noqa: BLE001  (this job's own scheduler: it fails alone)
            _fail_alone(job, exc)

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
        if not (self.scales_model_input or self.always_passes_step_kwargs):
            return {}
        accepted = set(inspect.signature(scheduler.step).parameters)
        kwargs: dict[str, Any] = {}
        if "eta" in accepted:
            kwargs["eta"] = 0.0
        if "generator" in accepted:
            kwargs["generator"] = [generator]
        return kwargs


def sample_latents(encoded: Any, generators: list[torch.Generator]) -> torch.Tensor:
    """The pipelines' ``retrieve_latents`` for a batch encoded in one VAE call: each row's latent
    distribution sampled with its own generator (diffusers encodes row by row for a list of generators)."""
    distribution = getattr(encoded, "latent_dist", None)
    if distribution is None:  # an encoder without a distribution (VQ, tiny autoencoders)
        return encoded.latents
    rows = [
        type(distribution)(distribution.parameters[i : i + 1]).sample(generator)
        for i, generator in enumerate(generators)
    ]
    return torch.cat(rows)


def row_conditioning(
    count: int, conditional: dict[str, torch.Tensor], unconditional: dict[str, torch.Tensor] | None
) -> list[Conditioning]:
    """Each of ``count`` requests' conditioning from one text-encoder call's batched outputs: row i of
    every tensor (and of the unconditional ones, with guidance)."""

    def row(tensors: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        return {name: values[i : i + 1] for name, values in tensors.items()}

    return [
        Conditioning(row(conditional, i), None if unconditional is None else row(unconditional, i))
        for i in range(count)
    ]


def _mean_and_inverse_std(vae: Any, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Wan-style VAE's (Wan, Qwen-Image) per-channel mean and 1 / std, shaped for 5-D latents."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
    return mean, inverse_std


def normalized_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """Encoded 5-D latents to the model's scale, as those pipelines' ``_encode_vae_image``:
    ``(latents - mean) * (1 / std)``."""
    mean, inverse_std = _mean_and_inverse_std(vae, latents)
    return (latents - mean) * inverse_std


def denormalized_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """5-D latents back to the VAE's scale, as those pipelines do before decoding:
    ``latents / (1 / std) + mean``, in that order (the same rounding)."""
    mean, inverse_std = _mean_and_inverse_std(vae, latents)
    return latents / inverse_std + mean


def _fail_alone(job: Job, exc: Exception) -> None:
    """A failure of this job's own math fails only this job; a lost device is everyone's (the engine
    answers what it holds and the process restarts)."""
    if Failure.of(exc).lost:
        raise exc
    job.failure = f"{type(exc).__name__}: {exc}"


def _rows(values: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``values[rows]`` by slices (no index tensor to copy to the device); the tensor itself when whole."""
    if rows == list(range(values.shape[0])):
        return values
    return torch.cat([values[r : r + 1] for r in rows])
