"""Step adapter for the Stable Diffusion UNet family: SD 1.x/2.x (``StableDiffusionPipeline``) and SDXL
(``StableDiffusionXLPipeline``: two text encoders, pooled embeddings and size "time ids" through
``added_cond_kwargs``). The loop body mirrors the pipelines' ``__call__``: the scheduler scales the model
input, the UNet predicts noise for ``[uncond, cond]`` rows, CFG combines them, the scheduler steps.

A missing negative prompt: SD turns it into "" (so does this adapter); SDXL zeroes the negative embeddings
(``force_zeros_for_empty_prompt``), here per row, so rows with and without one share forwards exactly.

Image-conditioned jobs start as ``StableDiffusionImg2ImgPipeline`` / ``StableDiffusionXLImg2ImgPipeline``
start them (and inpainting as ``StableDiffusionInpaintPipeline`` / ``StableDiffusionXLInpaintPipeline``
with a 4-channel UNet). An SD inpainting UNet (9 input channels: the latents, the mask and the masked
source's latents, as ``stable-diffusion-inpainting`` and SDXL's ``stable-diffusion-xl-1.0-inpainting-0.1``)
serves inpainting jobs only, as ``StableDiffusionInpaintPipeline`` / ``StableDiffusionXLInpaintPipeline``
run it: the mask and masked latents go into every forward, nothing is blended back. SDXL img2img and
inpainting conditions on its own time ids (``requires_aesthetics_score``: aesthetic scores instead of the
target size, and other ones for the unconditional row), so those are per row too.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from triton_diffusion.adapters import diffusers_compat as compat
from triton_diffusion.adapters.diffusers_pipeline import pipeline_timesteps
from triton_diffusion.adapters.image_params import Conditioning, ImageParams, row_conditioning
from triton_diffusion.adapters.latent_loop import LatentStepAdapter
from triton_diffusion.adapters.starts import JobStarts
from triton_diffusion.adapters.vae import sample_latents


class StableDiffusionStarts(JobStarts):
    """The SD and SDXL img2img and inpaint pipelines' start: which starts a UNet serves, and the source
    encoded as each pipeline encodes it (SDXL's upcast VAE and its latents' mean and std)."""

    adapter: StableDiffusionAdapter

    def supports(self, start: str) -> bool:
        # Inpainting is the masked blend of an ordinary UNet, or an inpainting UNet's own (which takes the
        # mask and masked source as extra input channels, so it serves nothing else).
        # SDXL's inpaint pipeline encodes the source without the VAE's latents mean and std (its img2img
        # pipeline normalises with them), so a VAE that has them serves img2img only.
        normalised = (
            self.adapter.xl and getattr(self.adapter.pipe.vae.config, "latents_mean", None) is not None
        )
        if self.adapter.inpainting_checkpoint:
            return start == "mask" and not normalised
        if start == "mask":
            return self.adapter.pipe.unet.config.in_channels == 4 and not normalised
        return start == "image"

    def encode_source(self, pixels: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        adapter = self.adapter
        vae = adapter.pipe.vae
        pixels = pixels.to(device=adapter.device, dtype=adapter.dtype)
        if not self.adapter.xl:  # the img2img and inpaint pipelines' encode: sample, then scale
            return vae.config.scaling_factor * sample_latents(vae.encode(pixels), generators)
        # StableDiffusionXLImg2ImgPipeline.prepare_latents: VAEs that overflow in fp16 encode in fp32, and
        # latents are normalised with the VAE's mean and std where it has them.
        upcast = bool(vae.config.force_upcast)
        original = vae.dtype
        try:
            if upcast:
                pixels = pixels.float()
                vae.to(dtype=torch.float32)
            latents = sample_latents(vae.encode(pixels), generators)
        finally:
            if upcast:
                vae.to(dtype=original)
        latents = latents.to(adapter.dtype)
        mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
        if mean is not None and std is not None:
            mean = torch.tensor(mean).view(1, 4, 1, 1).to(device=adapter.device, dtype=adapter.dtype)
            std = torch.tensor(std).view(1, 4, 1, 1).to(device=adapter.device, dtype=adapter.dtype)
            return (latents - mean) * vae.config.scaling_factor / std
        return vae.config.scaling_factor * latents

    @property
    def source_draw_dtype(self) -> torch.dtype:
        # SDXL's inpaint pipeline encodes the masked source with its VAE in float32 where force_upcast.
        if self.adapter.xl and self.adapter.pipe.vae.config.force_upcast:
            return torch.float32
        return self.adapter.pipe.vae.dtype


class StableDiffusionAdapter(LatentStepAdapter):
    starts_class = StableDiffusionStarts
    scales_model_input = True

    def __init__(self, pipe: Any, facts: Any, schedulers: Any, max_sequence_length: int | None) -> None:
        if pipe.unet.config.time_cond_proj_dim is not None:
            raise NotImplementedError("a guidance-embedding UNet (LCM) has no step adapter")
        self.xl = pipe.unet.config.addition_embed_type == "text_time"
        # Read by the starter's supports() in __init__.
        self.inpainting_checkpoint = pipe.unet.config.in_channels == 9  # the latents, mask, masked latents
        super().__init__(pipe, facts, schedulers, max_sequence_length)

    @property
    def model(self) -> Any:
        return self.pipe.unet

    @property
    def schedule_device(self) -> str:
        # DDIM, PNDM and the like index their CPU tables with the timestep: a GPU timestep would make
        # every job's scheduler step wait for the GPU (diffusers' own loop waits once per step).
        # Euler, DPM-Solver and Heun keep their sigmas on the CPU anyway.
        return "cpu"

    def encode(self, requests: Sequence[ImageParams]) -> list[Conditioning]:
        prompts = [r.prompt for r in requests]
        cfg = any(self.uses_guidance(r) for r in requests)
        negatives = [r.negative_prompt or "" for r in requests] if cfg else None
        if not self.xl:
            embeds, negative_embeds = self.pipe.encode_prompt(prompts, self.device, 1, cfg, negatives)
            unconditional = {"encoder_hidden_states": negative_embeds} if cfg else None
            return row_conditioning(len(requests), {"encoder_hidden_states": embeds}, unconditional)
        embeds, negative_embeds, pooled, negative_pooled = self.pipe.encode_prompt(
            prompt=prompts,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=cfg,
            negative_prompt=negatives,
        )
        projection = self.pipe.text_encoder_2.config.projection_dim
        out = []
        for i, request in enumerate(requests):
            time_ids, negative_time_ids = self._time_ids(request, embeds.dtype, projection)
            conditional = {
                "encoder_hidden_states": embeds[i : i + 1],
                "text_embeds": pooled[i : i + 1],
                "time_ids": time_ids,
            }
            unconditional = None
            if cfg:
                negative, negative_text = negative_embeds[i : i + 1], negative_pooled[i : i + 1]
                if request.negative_prompt is None and self.pipe.config.force_zeros_for_empty_prompt:
                    negative, negative_text = torch.zeros_like(negative), torch.zeros_like(negative_text)
                unconditional = {
                    "encoder_hidden_states": negative,
                    "text_embeds": negative_text,
                    "time_ids": negative_time_ids,
                }
            out.append(Conditioning(conditional, unconditional))
        return out

    def _time_ids(self, request: ImageParams, dtype: torch.dtype, projection: int) -> tuple[Any, Any]:
        """SDXL's size conditioning for the row and its unconditional row, as its pipeline makes it: the
        text-to-image one (the same for both rows), or the img2img/inpaint one (with aesthetic scores
        where ``requires_aesthetics_score`` is set, another one for the unconditional row)."""
        size = request.size
        if request.image is None:
            time_ids = compat.add_time_ids(self.pipe, size, (0, 0), size, dtype, projection).to(self.device)
            return time_ids, time_ids
        pipe = self.pipelines[request.start]
        defaults = inspect.signature(pipe.__call__).parameters
        aesthetic, negative_aesthetic = (
            defaults[name].default for name in ("aesthetic_score", "negative_aesthetic_score")
        )
        time_ids, negative_time_ids = compat.add_time_ids(
            pipe, size, (0, 0), size, aesthetic, negative_aesthetic, size, (0, 0), size, dtype, projection
        )
        return time_ids.to(self.device), negative_time_ids.to(self.device)

    def initial_latents(
        self, requests: Sequence[ImageParams], schedulers: Sequence[Any], generators: list[torch.Generator]
    ) -> torch.Tensor:
        # prepare_latents draws the noise, then scales it by the pipeline scheduler's init_noise_sigma:
        # here each row by its own scheduler's.
        height, width = requests[0].size
        factor = self.pipe.vae_scale_factor
        shape = (len(requests), self.model.config.in_channels, height // factor, width // factor)
        noise = randn_tensor(shape, generator=generators, device=self.device, dtype=self.dtype)
        return torch.cat([noise[i : i + 1] * s.init_noise_sigma for i, s in enumerate(schedulers)])

    def set_timesteps(self, scheduler: Any, request: ImageParams) -> torch.Tensor:
        return pipeline_timesteps(self.module, scheduler, request.steps, self.schedule_device)

    def predict(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        size: tuple[int, int],
    ) -> Any:
        added = {"text_embeds": inputs["text_embeds"], "time_ids": inputs["time_ids"]} if self.xl else None
        if self.inpainting_checkpoint:  # after the scheduler's input scaling, as the inpaint pipeline's loop
            latents = torch.cat([latents, inputs["inpaint_channels"]], dim=1)
        return self.model(
            latents,
            timesteps,
            encoder_hidden_states=inputs["encoder_hidden_states"],
            timestep_cond=None,
            cross_attention_kwargs=None,
            added_cond_kwargs=added,
            return_dict=False,
        )[0]

    def decode(self, latents: torch.Tensor, size: tuple[int, int]) -> list[Image.Image]:
        pipe, vae = self.pipe, self.pipe.vae
        if not self.xl:
            image = vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]
            image, nsfw = pipe.run_safety_checker(image, self.device, self.dtype)
            denormalize = [True] * image.shape[0] if nsfw is None else [not flagged for flagged in nsfw]
            return pipe.image_processor.postprocess(image, output_type="pil", do_denormalize=denormalize)
        # SDXL's own decode: fp16 VAEs that overflow are run in fp32, latents de-normalized if configured.
        upcast = vae.dtype == torch.float16 and vae.config.force_upcast
        try:
            if upcast:  # inside the try: an OOM half-way through the cast must still cast back
                vae.to(dtype=torch.float32)
                latents = latents.to(next(iter(vae.post_quant_conv.parameters())).dtype)
            mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
            if mean is not None and std is not None:
                mean = torch.tensor(mean).view(1, 4, 1, 1).to(latents.device, latents.dtype)
                std = torch.tensor(std).view(1, 4, 1, 1).to(latents.device, latents.dtype)
                latents = latents * std / vae.config.scaling_factor + mean
            else:
                latents = latents / vae.config.scaling_factor
            image = vae.decode(latents, return_dict=False)[0]
        finally:
            if upcast:  # back to fp16 also when the decode raised (an OOM is retried job by job)
                vae.to(dtype=torch.float16)
        if getattr(pipe, "watermark", None) is not None:
            image = pipe.watermark.apply_watermark(image)
        return pipe.image_processor.postprocess(image, output_type="pil")
