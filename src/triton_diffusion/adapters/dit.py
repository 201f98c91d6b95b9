"""Step adapter for the cross-attention DiT pipelines: PixArt-Sigma and PixArt-Alpha
(``PixArtSigmaPipeline``, ``PixArtAlphaPipeline``: T5 text, a DiT with adaLN-single and learned variance,
DPM-Solver) and Sana (``SanaPipeline``: Gemma-2 text behind
its "complex human instruction", a linear-attention DiT, DPM-Solver on flow sigmas). The loop body mirrors
their ``__call__``:

- prompts and negative prompts come from the pipeline's own ``encode_prompt`` (padded to
  ``max_sequence_length``) with their attention masks; every row keeps its own mask, so the forward's
  ``encoder_attention_mask`` is per row and a row's padding is masked whoever it shares a forward with;
- classifier-free guidance where the row's ``guidance_scale`` > 1 (a missing negative prompt is "");
- each row's own timestep (Sana's times the transformer's ``timestep_scale``); PixArt scales the model
  input and draws noise scaled by ``init_noise_sigma``, Sana does neither and keeps its latents in float32,
  casting them to the transformer's dtype for each forward;
- the learned-variance half of the prediction is dropped where ``out_channels // 2`` is the latent
  channels (the pipelines guide first, then drop: elementwise, so dropping first gives the same values);
- resolution binning (``use_resolution_binning``, on by default and not overridden by the served
  request-level path): a job renders at its size's aspect-ratio bin and its image is resized and
  cropped back to the size it asked for. Its shape group is the bin, so jobs of one bin share forwards
  whatever size each asked for.

- PixArt-Alpha's own loop: its 1024-pixel models (``sample_size`` 128) condition on the rendered
  resolution and aspect ratio (per row here, in the text's dtype, as its "micro-conditions"), and a job of
  one step keeps the scheduler's predicted original sample rather than the stepped latents (a scheduler
  that returns none, DPM-Solver, fails that job by name; the pipeline raises an IndexError).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from triton_diffusion.adapters.diffusers_pipeline import pipeline_timesteps
from triton_diffusion.adapters.image_params import (
    Conditioning,
    ImageParams,
    image_params,
    latent_state,
    row_conditioning,
)
from triton_diffusion.adapters.latent_loop import LatentStepAdapter
from triton_diffusion.adapters.row_sizes import Packing
from triton_diffusion.adapters.starts import JobStarts
from triton_diffusion.engine.jobs import Job, JobStart


@dataclass(frozen=True)
class DiTLoop:
    """What differs between the pipelines' loops, read from their ``__call__``."""

    # The transformer's sample_size -> the aspect-ratio bins (a table in the pipeline's module) it uses.
    bins: dict[int, str]
    # PixArt calls scheduler.scale_model_input and scales the noise by init_noise_sigma; Sana does neither.
    scales_model_input: bool
    # Sana draws and steps float32 latents (cast to the transformer's dtype per forward), multiplies the
    # timestep by timestep_scale and turns the prediction to float32.
    float32_latents: bool
    # PixArt-Alpha: a sample_size-128 transformer takes the rendered resolution and aspect ratio.
    micro_conditions: bool = False


LOOPS = {
    "PixArtSigmaPipeline": DiTLoop(
        bins={
            256: "ASPECT_RATIO_2048_BIN",
            128: "ASPECT_RATIO_1024_BIN",
            64: "ASPECT_RATIO_512_BIN",
            32: "ASPECT_RATIO_256_BIN",
        },
        scales_model_input=True,
        float32_latents=False,
    ),
    "PixArtAlphaPipeline": DiTLoop(
        bins={128: "ASPECT_RATIO_1024_BIN", 64: "ASPECT_RATIO_512_BIN", 32: "ASPECT_RATIO_256_BIN"},
        scales_model_input=True,
        float32_latents=False,
        micro_conditions=True,
    ),
    "SanaPipeline": DiTLoop(
        bins={
            128: "ASPECT_RATIO_4096_BIN",
            64: "ASPECT_RATIO_2048_BIN",
            32: "ASPECT_RATIO_1024_BIN",
            16: "ASPECT_RATIO_512_BIN",
        },
        scales_model_input=False,
        float32_latents=True,
    ),
}


class DiTStarts(JobStarts):
    """A DiT job starts at its render size (its aspect-ratio bin, where the pipeline bins sizes)."""

    adapter: DiTAdapter

    def start_requests(self, requests: list[ImageParams]) -> list[JobStart]:
        # The shared loop starts each job at its render size (its latents, its shape group); the job's
        # params keep the size it asked for, to which finish resizes its image back (step hands predict
        # that size, which these transformers do not read: the latents carry their shape).
        sizes = [self.adapter.render_size(r) for r in requests]
        return super().start_requests(
            [
                replace(r, height=height, width=width)
                for r, (height, width) in zip(requests, sizes, strict=True)
            ]
        )


class DiTAdapter(LatentStepAdapter):
    starts_class = DiTStarts
    # Both pipelines pass prepare_extra_step_kwargs' eta and generator (Sana too, though it scales no input).
    always_passes_step_kwargs = True
    fallback_max_sequence_length = 300
    # PixArt's BasicTransformerBlock (Sana's blocks are not in diffusers' registry: none). CFG is one
    # batch of two: a job's rows decide together. (TaylorSeer's patterns match none of PixArt's attn1/attn2.)
    cache_methods = ("fbc",)
    # PixArt's position table is interpolated to each size (not a crop of one), and Sana's linear
    # attention has no key mask: a size per forward.
    packing = Packing(
        why_not="positions interpolated per size (PixArt); linear attention without a key mask (Sana)"
    )

    def __init__(self, pipe: Any, facts: Any, schedulers: Any, max_sequence_length: int | None) -> None:
        super().__init__(pipe, facts, schedulers, max_sequence_length)
        loop = LOOPS.get(type(self.pipe).__name__)
        if loop is None:
            raise NotImplementedError(f"{type(self.pipe).__name__} has no DiT step adapter")
        self.loop = loop
        self.scales_model_input = loop.scales_model_input
        # encode_prompt's text options as __call__ passes them by default (PixArt cleans captions by
        # default in __call__, not in encode_prompt; Sana prepends its instruction to prompts).
        self.text_options = {
            name: facts.default(name)
            for name in ("clean_caption", "complex_human_instruction")
            if facts.accepts(name)
        }
        self.bins: dict | None = None
        if facts.default("use_resolution_binning"):
            sample_size = self.model.config.sample_size
            table = loop.bins.get(sample_size)
            if table is None:  # the pipeline raises "Invalid sample size" for every request too
                raise NotImplementedError(f"no aspect-ratio bins for sample_size {sample_size}")
            self.bins = getattr(self.module, table)
        self.latent_dtype = torch.float32 if loop.float32_latents else self.pipe.text_encoder.dtype
        # PixArtAlphaPipeline's "micro-conditions", for its 1024-pixel models only.
        self.micro_conditions = loop.micro_conditions and self.model.config.sample_size == 128
        self.learned_sigma = self.model.config.out_channels // 2 == self.model.config.in_channels

    @property
    def schedule_device(self) -> str:
        # DPM-Solver, Euler and DDIM keep their tables on the CPU: a GPU timestep would make each job's
        # scheduler step wait for the GPU. The values are the same on either device.
        return "cpu"

    def render_size(self, request: ImageParams) -> tuple[int, int]:
        """The size the pipeline renders the request at: its aspect-ratio bin, or its own size."""
        if self.bins is None:
            return request.size
        processor = self.pipe.image_processor
        return processor.classify_height_width_bin(request.height, request.width, ratios=self.bins)

    def encode(self, requests: Sequence[ImageParams]) -> list[Conditioning]:
        cfg = any(self.uses_guidance(r) for r in requests)
        embeds, mask, negative_embeds, negative_mask = self.pipe.encode_prompt(
            [r.prompt for r in requests],
            cfg,
            negative_prompt=[r.negative_prompt or "" for r in requests],  # the pipelines' default is ""
            num_images_per_prompt=1,
            device=self.device,
            max_sequence_length=self.max_sequence_length,
            **self.text_options,
        )
        conditional = {"encoder_hidden_states": embeds, "encoder_attention_mask": mask}
        unconditional = {"encoder_hidden_states": negative_embeds, "encoder_attention_mask": negative_mask}
        return row_conditioning(len(requests), conditional, unconditional if cfg else None)

    def initial_latents(
        self, requests: Sequence[ImageParams], schedulers: Sequence[Any], generators: list[torch.Generator]
    ) -> torch.Tensor:
        height, width = requests[0].size  # the render size (prepare)
        factor = self.pipe.vae_scale_factor
        shape = (len(requests), self.model.config.in_channels, height // factor, width // factor)
        noise = randn_tensor(shape, generator=generators, device=self.device, dtype=self.latent_dtype)
        if not self.loop.scales_model_input:
            return noise
        # PixArt's prepare_latents scales by the pipeline scheduler's init_noise_sigma: each row by its own.
        return torch.cat([noise[i : i + 1] * s.init_noise_sigma for i, s in enumerate(schedulers)])

    def set_timesteps(self, scheduler: Any, request: ImageParams) -> torch.Tensor:
        return pipeline_timesteps(self.module, scheduler, request.steps, self.schedule_device)

    def extra_inputs(self, request: ImageParams) -> dict[str, torch.Tensor]:
        if not self.micro_conditions:
            return {}
        # PixArtAlphaPipeline: the rendered (binned) size, in the text's dtype, for both CFG rows.
        height, width = request.size  # the render size (prepare)
        dtype = self.pipe.text_encoder.dtype
        resolution = torch.tensor([[height, width]]).to(dtype=dtype, device=self.device)
        aspect_ratio = torch.tensor([[float(height / width)]]).to(dtype=dtype, device=self.device)
        return {"resolution": resolution, "aspect_ratio": aspect_ratio}

    def timestep_rows(self, timesteps: Sequence[torch.Tensor]) -> torch.Tensor:
        rows = super().timestep_rows(timesteps)
        if self.loop.float32_latents:  # Sana: t.expand(batch) * timestep_scale
            return rows * self.model.config.timestep_scale
        return rows

    def predict(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        size: tuple[int, int],
    ) -> Any:
        embeds, mask = inputs["encoder_hidden_states"], inputs["encoder_attention_mask"]
        if self.loop.float32_latents:
            prediction = self.model(
                latents.to(dtype=self.dtype),
                encoder_hidden_states=embeds.to(dtype=self.dtype),
                encoder_attention_mask=mask,
                timestep=timesteps,
                return_dict=False,
                attention_kwargs=None,
            )[0].float()
        else:
            prediction = self.model(
                latents,
                encoder_hidden_states=embeds,
                encoder_attention_mask=mask,
                timestep=timesteps,
                added_cond_kwargs={
                    "resolution": inputs.get("resolution"),
                    "aspect_ratio": inputs.get("aspect_ratio"),
                },
                return_dict=False,
            )[0]
        if self.learned_sigma:
            return prediction.chunk(2, dim=1)[0]
        return prediction

    def decode(self, latents: torch.Tensor, size: tuple[int, int]) -> list[Image.Image]:
        return self._images(latents, [size] * latents.shape[0])

    def finish(self, jobs: list[Job]) -> list[Image.Image]:
        """Decode the done jobs of one render size together; each image goes back to its asked size."""
        latents = torch.cat([latent_state(job.state).latents for job in jobs])
        with torch.inference_mode():
            return self._images(latents, [image_params(job).size for job in jobs])

    def _images(self, latents: torch.Tensor, sizes: list[tuple[int, int]]) -> list[Image.Image]:
        vae, processor = self.pipe.vae, self.pipe.image_processor
        pixels = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        images = []
        for row, (height, width) in enumerate(sizes):
            image = pixels[row : row + 1]
            if self.bins is not None:
                image = processor.resize_and_crop_tensor(image, width, height)
            images.extend(processor.postprocess(image, output_type="pil"))
        return images
