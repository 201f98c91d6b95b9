"""Step adapters for flow-matching transformer pipelines: FLUX.1 (``FluxPipeline``: packed 2x2 latents,
CLIP + T5 text, a guidance embedding, true CFG with a negative prompt) and SD3 (``StableDiffusion3Pipeline``:
classic CFG over ``[uncond, cond]`` rows). The loop bodies mirror the pipelines' ``__call__``: no input
scaling, the transformer predicts the velocity, the flow-matching scheduler steps.

Flux turns true CFG on for the whole call when any row has a negative prompt; here it is per row (a row
with a negative prompt and ``true_cfg_scale`` > 1 adds one unconditional row), so such requests share
forwards with the others, each exactly as ``FluxPipeline`` would run it alone. An image-conditioned FLUX.1
or SD3 job starts as ``FluxImg2ImgPipeline`` / ``StableDiffusion3Img2ImgPipeline`` start it
(:class:`FlowMatchingStarts`), FLUX.1's then packed; inpainting as their inpaint pipelines run it.
A FLUX.1 Fill checkpoint (``FluxFillPipeline``: its transformer takes the packed masked source's latents
and the packed mask beside the latents) serves inpainting jobs only, as that pipeline runs them: the
source noised to the first sigma, the mask and masked latents in every forward, nothing blended back. So
does an SD3 inpainting transformer (33 input channels: the latents, the mask and the masked source's
latents), as ``StableDiffusion3InpaintPipeline`` runs it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from triton_diffusion.adapters import diffusers_compat as compat
from triton_diffusion.adapters.diffusers_pipeline import pipeline_timesteps
from triton_diffusion.adapters.image_params import Conditioning, ImageParams, row_conditioning
from triton_diffusion.adapters.latent_loop import LatentStepAdapter
from triton_diffusion.adapters.packed_rows import MaskedJointAttnProcessor
from triton_diffusion.adapters.row_sizes import Packing
from triton_diffusion.adapters.starts import JobStarts
from triton_diffusion.adapters.vae import sample_latents

# FLUX.1's position ids kept per (text length, canvas size): a few, as the sizes that meet change.
IDS_KEPT = 16


class FlowMatchingStarts(JobStarts):
    """img2img as ``FluxImg2ImgPipeline`` and ``StableDiffusion3Img2ImgPipeline`` start it: the schedule
    trimmed by steps x strength unrounded, the source encoded (each row sampled with its own generator),
    shifted and scaled, then noised to the first remaining sigma with the row's noise (``scale_noise``).
    Inpainting as ``FluxInpaintPipeline`` and ``StableDiffusion3InpaintPipeline`` run it with an ordinary
    transformer: the same start, and the source noised by ``scale_noise`` blended back after each step;
    an inpainting checkpoint (SD3's 33 channels, FLUX.1 Fill's) serves inpainting only."""

    def supports(self, start: str) -> bool:
        adapter = self.adapter
        if adapter.inpainting_checkpoint:
            return start == "mask"
        if start == "mask":  # not an inpainting transformer
            packed = 4 if adapter.facts.traits.packed_latents else 1
            return adapter.model.config.in_channels == packed * adapter.pipe.vae.config.latent_channels
        return start == "image"

    def first_step(self, steps: int, strength: float) -> int:
        # get_timesteps: steps x strength is not rounded before it is subtracted.
        return int(max(steps - min(steps * strength, steps), 0))

    def encode_source(self, pixels: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        adapter = self.adapter
        vae = adapter.pipe.vae
        latents = sample_latents(
            vae.encode(pixels.to(device=adapter.device, dtype=adapter.dtype)), generators
        )
        return (latents - vae.config.shift_factor) * vae.config.scaling_factor

    def noise_source(
        self, scheduler: Any, image_latents: torch.Tensor, noise: torch.Tensor, timestep: torch.Tensor
    ) -> torch.Tensor:
        return scheduler.scale_noise(image_latents, timestep, noise)


class FluxStarts(FlowMatchingStarts):
    """FLUX.1's: FluxFillPipeline's source and mask channels, and its inpaint pipeline's packed mask."""

    def encodes_source(self, request: ImageParams) -> bool:
        return True  # FluxFillPipeline's prepare_latents encodes the source at every strength

    def inpaint_channels(
        self, request: ImageParams, generator: torch.Generator, pixels: torch.Tensor
    ) -> torch.Tensor:
        # FluxFillPipeline: the source outside the mask, encoded with the row's generator after its noise,
        # and the mask, each packed by the pipeline's own prepare_mask_latents; the masked latents first.
        adapter = self.adapter
        pipe = adapter.pipelines["mask"]
        height, width = request.size
        mask = self.mask_condition(request)
        masked = (pixels * (1 - mask)).to(device=adapter.device, dtype=adapter.dtype)
        channels = pipe.vae.config.latent_channels
        mask, masked = pipe.prepare_mask_latents(
            mask, masked, 1, channels, 1, height, width, adapter.dtype, adapter.device, generator
        )
        return torch.cat((masked, mask), dim=-1)

    def pack_mask(self, mask: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        # FluxInpaintPipeline.prepare_mask_latents: the mask repeated over the channels, then packed.
        adapter = self.adapter
        return adapter.pack(mask.repeat(1, adapter.model.config.in_channels // 4, 1, 1), size)


class FluxAdapter(LatentStepAdapter):
    starts_class = FluxStarts
    fallback_max_sequence_length = 512
    cache_methods = ("fbc", "taylorseer")
    # A state per true-CFG branch in every start (step_caches.py): FluxPipeline's cache_context("cond") and
    # ("uncond"), which the img2img and inpaint pipelines do not set but the request-level engine names.
    cache_per_branch = True

    def __init__(self, pipe: Any, facts: Any, schedulers: Any, max_sequence_length: int | None) -> None:
        # Read by supports() in __init__: a Fill transformer takes the packed latents, the packed masked
        # source's latents and the packed (vae factor)^2-channel mask.
        packed = 4 * pipe.vae.config.latent_channels
        self.inpainting_checkpoint = facts.class_name == "FluxFillPipeline"
        fill_channels = 2 * packed + 4 * pipe.vae_scale_factor**2
        if self.inpainting_checkpoint and pipe.transformer.config.in_channels != fill_channels:
            raise NotImplementedError("a FluxFillPipeline whose transformer is not a Fill transformer")
        # Sizes share forwards (a patch's ids are its own position from the origin, packed_rows.py); a
        # Fill checkpoint's mask channels are not placed on a canvas.
        # The key mask reaches the attention through FluxAttnProcessor as is: diffusers' native attention
        # (SDPA) honours it; another backend (flash, sage: set_attention_backend) is not assured to.
        backends = {compat.attention_backend(p) for p in pipe.transformer.attn_processors.values()}
        native = (
            backends <= {None, "native"} and os.environ.get("DIFFUSERS_ATTN_BACKEND", "native") == "native"
        )
        self.packing = Packing(
            on=not self.inpainting_checkpoint and native,
            why_not="a FLUX.1 Fill checkpoint: its mask channels are not packed"
            if self.inpainting_checkpoint
            else "an attention backend other than native SDPA: the key mask is not assured",
        )
        super().__init__(pipe, facts, schedulers, max_sequence_length)
        self.guidance_embeds = bool(pipe.transformer.config.guidance_embeds)
        self._ids_by_shape: dict[tuple[int, tuple[int, int]], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def token_patch(self) -> int:
        return 2  # FluxPipeline packs 2x2 latent patches into a token

    def pack(self, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        count, channels, height, width = latents.shape
        return compat.pack_latents(self.pipe, latents, count, channels, height, width)

    def uses_guidance(self, request: ImageParams) -> bool:
        return (request.true_cfg_scale or 0.0) > 1.0 and request.negative_prompt is not None

    def guidance_scale(self, request: ImageParams) -> float:
        return float(request.true_cfg_scale or 0.0)

    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        return embeds, pooled

    def encode(self, requests: Sequence[ImageParams]) -> list[Conditioning]:
        embeds, pooled = self._encode([r.prompt for r in requests])
        guided = [i for i, r in enumerate(requests) if self.uses_guidance(r)]
        negatives: dict[int, dict[str, torch.Tensor]] = {}
        if guided:
            negatives_of = [requests[i].negative_prompt or "" for i in guided]  # each set (uses_guidance)
            negative_embeds, negative_pooled = self._encode(negatives_of)
            for row, i in enumerate(guided):
                negatives[i] = {
                    "encoder_hidden_states": negative_embeds[row : row + 1],
                    "pooled_projections": negative_pooled[row : row + 1],
                }
        return [
            Conditioning(
                {"encoder_hidden_states": embeds[i : i + 1], "pooled_projections": pooled[i : i + 1]},
                negatives.get(i),
            )
            for i in range(len(requests))
        ]

    def initial_latents(
        self, requests: Sequence[ImageParams], schedulers: Sequence[Any], generators: list[torch.Generator]
    ) -> torch.Tensor:
        height, width = requests[0].size
        channels = self.model.config.in_channels // 4
        latents, _ = self.pipe.prepare_latents(
            len(requests), channels, height, width, self.dtype, self.device, generators
        )
        return latents

    def set_timesteps(self, scheduler: Any, request: ImageParams) -> torch.Tensor:
        steps = request.steps
        sigmas = None if scheduler.config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        factor = self.pipe.vae_scale_factor
        image_seq_len = (request.height // factor // 2) * (request.width // factor // 2)
        return pipeline_timesteps(
            self.module, scheduler, steps, self.schedule_device, sigmas, image_seq_len, max_shift=1.15
        )

    def timestep_rows(self, timesteps: Sequence[torch.Tensor]) -> torch.Tensor:
        # FluxPipeline: t.expand(batch).to(latents.dtype), then / 1000.
        return self.stacked_timesteps(timesteps, self.dtype) / 1000

    def predict(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        size: tuple[int, int],
    ) -> Any:
        embeds = inputs["encoder_hidden_states"]
        mask = inputs.get("attention_mask")
        text_ids, image_ids = self._position_ids(embeds.shape[1], size)
        if self.inpainting_checkpoint:  # FluxFillPipeline: the mask and masked latents beside the latents
            latents = torch.cat((latents, inputs["inpaint_channels"]), dim=2)
        return self.model(
            hidden_states=latents,
            timestep=timesteps,
            guidance=inputs.get("guidance"),
            pooled_projections=inputs["pooled_projections"],
            encoder_hidden_states=embeds,
            txt_ids=text_ids,
            img_ids=image_ids,
            # A packed forward's key mask, [rows, 1, 1, keys] as SDPA takes it (FluxAttnProcessor passes it).
            joint_attention_kwargs={} if mask is None else {"attention_mask": mask[:, None, None, :]},
            return_dict=False,
        )[0]

    def _position_ids(self, text_length: int, size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """As FluxPipeline makes them: text ids are zeros, one per text token (the same for every prompt);
        image ids are each latent patch's position (64x128 and 128x64: one length, other positions).
        Constants of the shape, so kept per shape rather than rebuilt (and copied to the GPU) every step."""
        key = (text_length, size)
        if key not in self._ids_by_shape:
            text_ids = torch.zeros(text_length, 3).to(device=self.device, dtype=self.pipe.text_encoder.dtype)
            factor = self.pipe.vae_scale_factor * 2
            image_ids = compat.latent_image_ids(
                self.pipe, size[0] // factor, size[1] // factor, self.device, self.dtype
            )
            if len(self._ids_by_shape) >= IDS_KEPT:  # canvases follow the sizes that met: keep a few
                del self._ids_by_shape[next(iter(self._ids_by_shape))]
            self._ids_by_shape[key] = (text_ids, image_ids)
        return self._ids_by_shape[key]

    def _unpack(self, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        return compat.unpack_latents(self.pipe, latents, size[0], size[1])

    def decode(self, latents: torch.Tensor, size: tuple[int, int]) -> list[Image.Image]:
        vae = self.pipe.vae
        latents = self._unpack(latents, size)
        latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="pil")

    def preview_latent(self, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        return self._unpack(latents, size)[0]


class StableDiffusion3Adapter(LatentStepAdapter):
    starts_class = FlowMatchingStarts
    fallback_max_sequence_length = 256
    # First Block Cache fails on SD3's last block in diffusers (context_pre_only returns no encoder
    # states), so it has no reference to be exact against: TaylorSeer only. CFG is one batch of two.
    cache_methods = ("taylorseer",)

    def __init__(self, pipe: Any, facts: Any, schedulers: Any, max_sequence_length: int | None) -> None:
        # Read by supports() in __init__: the latents, the mask and the masked source's latents.
        self.inpainting_checkpoint = (
            pipe.transformer.config.in_channels == 2 * pipe.vae.config.latent_channels + 1
        )
        # Sizes share forwards where each size's positions are a crop of one table (packed_rows.py) and
        # every attention is joint (SD3.5's second attention would need the mask too).
        config = pipe.transformer.config
        why_not = next(
            (
                why
                for why, applies in (
                    (
                        "an inpainting checkpoint: its mask channels are not packed",
                        self.inpainting_checkpoint,
                    ),
                    ("no position table to crop (pos_embed_max_size)", not config.get("pos_embed_max_size")),
                    ("SD3.5's dual attention layers", bool(config.get("dual_attention_layers"))),
                )
                if applies
            ),
            "",
        )
        # A packed forward: spatial latents, each size a centred crop of the position table (PatchEmbed),
        # the text after the image in the joint attention.
        self.packing = Packing(
            on=not why_not,
            why_not=why_not,
            layout="patches",
            text_first=False,
            centred_in=config.get("pos_embed_max_size"),
        )
        super().__init__(pipe, facts, schedulers, max_sequence_length)
        if self.sizes.packing.on:  # diffusers' own processor unless a packed forward passes a mask
            self.model.set_attn_processor(MaskedJointAttnProcessor())

    def encode(self, requests: Sequence[ImageParams]) -> list[Conditioning]:
        cfg = any(self.uses_guidance(r) for r in requests)
        embeds, negative_embeds, pooled, negative_pooled = self.pipe.encode_prompt(
            prompt=[r.prompt for r in requests],
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=cfg,
            negative_prompt=[r.negative_prompt or "" for r in requests] if cfg else None,
            max_sequence_length=self.max_sequence_length,
        )
        conditional = {"encoder_hidden_states": embeds, "pooled_projections": pooled}
        unconditional = {"encoder_hidden_states": negative_embeds, "pooled_projections": negative_pooled}
        return row_conditioning(len(requests), conditional, unconditional if cfg else None)

    def initial_latents(
        self, requests: Sequence[ImageParams], schedulers: Sequence[Any], generators: list[torch.Generator]
    ) -> torch.Tensor:
        height, width = requests[0].size
        channels = self.model.config.in_channels
        count = len(requests)
        return self.pipe.prepare_latents(count, channels, height, width, self.dtype, self.device, generators)

    def set_timesteps(self, scheduler: Any, request: ImageParams) -> torch.Tensor:
        image_seq_len = None  # no shift unless the scheduler shifts dynamically
        if scheduler.config.get("use_dynamic_shifting", None):
            factor, patch = self.pipe.vae_scale_factor, self.model.config.patch_size
            image_seq_len = (request.height // factor // patch) * (request.width // factor // patch)
        return pipeline_timesteps(
            self.module,
            scheduler,
            request.steps,
            self.schedule_device,
            image_seq_len=image_seq_len,
            max_shift=1.16,
        )

    def predict(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        size: tuple[int, int],
    ) -> Any:
        if self.inpainting_checkpoint:  # the mask and masked latents after the latents, as the pipeline
            latents = torch.cat([latents, inputs["inpaint_channels"]], dim=1)
        mask = inputs.get("attention_mask")  # a packed forward's (MaskedJointAttnProcessor)
        return self.model(
            hidden_states=latents,
            timestep=timesteps,
            encoder_hidden_states=inputs["encoder_hidden_states"],
            pooled_projections=inputs["pooled_projections"],
            joint_attention_kwargs=None if mask is None else {"attention_mask": mask},
            return_dict=False,
        )[0]

    def decode(self, latents: torch.Tensor, size: tuple[int, int]) -> list[Image.Image]:
        vae = self.pipe.vae
        latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="pil")
