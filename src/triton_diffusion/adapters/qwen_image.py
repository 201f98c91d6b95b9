"""Step adapter for Qwen-Image text-to-image (``QwenImagePipeline``): a Qwen2.5-VL text encoder, packed
2x2 latents as FLUX.1, a dual-stream transformer with joint attention over text and image tokens, the
flow-matching scheduler. The loop body mirrors the pipeline's ``__call__``:

- prompts have their own lengths (``encode_prompt`` drops the template and keeps each prompt's tokens).
  Each row keeps its embeddings zero-padded to ``max_sequence_length`` and its mask; a forward takes the
  text up to its longest row, masks each row's padding (``encoder_hidden_states_mask``) and passes no
  mask when no row is padded, as the pipeline does for a prompt alone. Text RoPE positions count from the
  first token, so a row's text positions do not depend on the others' lengths;
- true CFG per row: a row with a negative prompt and ``true_cfg_scale`` > 1 adds an unconditional row
  (the pipeline runs it as its own forward), combined as ``neg + s * (cond - neg)`` and rescaled to the
  conditional prediction's norm per token, exactly as the pipeline;
- ``img_shapes`` of the forward's size for every row (rows of one forward have one size), each row's own
  timestep in the latents' dtype divided by 1000, and the guidance embedding per row for a
  guidance-distilled transformer.

An image-conditioned job (img2img) starts as ``QwenImageImg2ImgPipeline`` starts it: the schedule trimmed by
steps x strength unrounded, the source encoded as a one-frame video by the VAE (each row sampled with its
own generator) and normalised with the VAE's per-channel mean and std, then noised to the first remaining
sigma (``scale_noise``) and packed; from then on it shares forwards with text-only rows of its size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from triton_diffusion.adapters import diffusers_compat as compat
from triton_diffusion.adapters.diffusers_pipeline import pipeline_timesteps
from triton_diffusion.adapters.flow_matching import FlowMatchingStarts
from triton_diffusion.adapters.image_params import ImageParams, LatentJob
from triton_diffusion.adapters.latent_loop import LatentStepAdapter
from triton_diffusion.adapters.row_sizes import Packing
from triton_diffusion.adapters.vae import denormalized_latents, normalized_latents, sample_latents


class QwenImageStarts(FlowMatchingStarts):
    """``QwenImageImg2ImgPipeline``'s start: its source encoded in the text's dtype with one frame and
    normalised by the VAE's mean and std (no inpainting)."""

    adapter: QwenImageAdapter

    def supports(self, start: str) -> bool:
        return start == "image"

    def encode_source(self, pixels: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        # QwenImageImg2ImgPipeline.prepare_latents and _encode_vae_image: [n, 3, 1, H, W] in the text's
        # dtype, normalised as (latents - mean) * (1 / std), frames moved before channels: [n, 1, z, h, w].
        adapter = self.adapter
        vae = adapter.pipe.vae
        pixels = pixels.to(device=adapter.device, dtype=adapter.latent_dtype).unsqueeze(2)
        return normalized_latents(vae, sample_latents(vae.encode(pixels), generators)).transpose(1, 2)

    def source_noise_shape(self, size: tuple[int, int]) -> tuple[int, ...]:
        rows, columns = self.adapter.packed_grid(size)
        return (1, 1, self.adapter.model.config.in_channels // 4, 2 * rows, 2 * columns)


class QwenImageAdapter(LatentStepAdapter):
    starts_class = QwenImageStarts
    fallback_max_sequence_length = 512
    captures_forwards = False  # predict trims the text to the longest row's length, read from the GPU
    packing = Packing(
        why_not="not built: its rotary takes image shapes per row and its text lengths differ per row"
    )

    def __init__(self, pipe: Any, facts: Any, schedulers: Any, max_sequence_length: int | None) -> None:
        super().__init__(pipe, facts, schedulers, max_sequence_length)
        self.guidance_embeds = bool(self.model.config.guidance_embeds)
        # The pipeline draws and steps latents in the prompt embeddings' (the text encoder's) dtype.
        self.latent_dtype = self.pipe.text_encoder.dtype

    def pack(self, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        count, _, channels, height, width = latents.shape  # [n, 1, C, h, w]
        return compat.pack_latents(self.pipe, latents, count, channels, height, width)

    def uses_guidance(self, request: ImageParams) -> bool:
        return (request.true_cfg_scale or 0.0) > 1.0 and request.negative_prompt is not None

    def guidance_scale(self, request: ImageParams) -> float:
        return float(request.true_cfg_scale or 0.0)

    def encode_texts(self, texts: list[str]) -> list[dict[str, torch.Tensor]]:
        # The base encode hands prompts and the guided rows' negative prompts here in one call: the
        # pipeline encodes a negative prompt exactly as a prompt (a guided row always has one).
        embeds, mask = self.pipe.encode_prompt(
            prompt=texts,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        lengths = [embeds.shape[1]] * len(texts) if mask is None else mask.sum(dim=1).tolist()
        max_length = self.max_sequence_length
        assert max_length is not None  # the family's fallback at least
        padded = embeds.new_zeros(len(texts), max_length, embeds.shape[2])
        padded[:, : embeds.shape[1]] = embeds
        # Masks stay on the host: each forward reads its longest row from them without waiting for the GPU.
        masks = torch.zeros(len(texts), max_length, dtype=torch.long)
        for row, length in enumerate(lengths):
            masks[row, : int(length)] = 1
        return [
            {"encoder_hidden_states": padded[i : i + 1], "encoder_hidden_states_mask": masks[i : i + 1]}
            for i in range(len(texts))
        ]

    def initial_latents(
        self, requests: Sequence[ImageParams], schedulers: Sequence[Any], generators: list[torch.Generator]
    ) -> torch.Tensor:
        height, width = requests[0].size
        channels = self.model.config.in_channels // 4
        return self.pipe.prepare_latents(
            len(requests), channels, height, width, self.latent_dtype, self.device, generators
        )

    def packed_grid(self, size: tuple[int, int]) -> tuple[int, int]:
        """The packed latent grid (rows, columns) of an image size."""
        factor = self.pipe.vae_scale_factor * 2
        return size[0] // factor, size[1] // factor

    def set_timesteps(self, scheduler: Any, request: ImageParams) -> torch.Tensor:
        steps = request.steps
        sigmas = np.linspace(1.0, 1 / steps, steps)
        rows, columns = self.packed_grid(request.size)
        return pipeline_timesteps(
            self.module,
            scheduler,
            steps,
            self.schedule_device,
            sigmas,
            image_seq_len=rows * columns,
            max_shift=1.15,
        )

    def timestep_rows(self, timesteps: Sequence[torch.Tensor]) -> torch.Tensor:
        # QwenImagePipeline: t.expand(batch).to(latents.dtype), then / 1000.
        return self.stacked_timesteps(timesteps, self.latent_dtype) / 1000

    def predict(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        size: tuple[int, int],
    ) -> Any:
        mask = inputs["encoder_hidden_states_mask"]
        length = int(mask.sum(dim=1).max())
        embeds, mask = inputs["encoder_hidden_states"][:, :length], mask[:, :length]
        model_mask = None if bool(mask.all()) else self.to_device(mask)
        return self.model(
            hidden_states=latents,
            timestep=timesteps,
            guidance=inputs.get("guidance"),
            encoder_hidden_states_mask=model_mask,
            encoder_hidden_states=embeds,
            img_shapes=[[(1, *self.packed_grid(size))]] * latents.shape[0],
            attention_kwargs={},
            return_dict=False,
        )[0]

    def _guided_noise(self, states: list[LatentJob], predictions: torch.Tensor) -> torch.Tensor:
        """True CFG as the pipeline: the combined prediction rescaled to the conditional one's norm over
        the channels of each token, row by row."""
        combined = super()._guided_noise(states, predictions)
        noise, row = [], 0
        for j, state in enumerate(states):
            mixed = combined[j : j + 1]
            if state.unconditional is None:
                noise.append(mixed)
                row += 1
                continue
            cond = predictions[row + 1 : row + 2]  # rows are [uncond, cond] per guided job
            cond_norm = torch.norm(cond, dim=-1, keepdim=True)
            noise.append(mixed * (cond_norm / torch.norm(mixed, dim=-1, keepdim=True)))
            row += 2
        return torch.cat(noise)

    def _unpack(self, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        return compat.unpack_latents(self.pipe, latents, size[0], size[1])

    def decode(self, latents: torch.Tensor, size: tuple[int, int]) -> list[Image.Image]:
        vae = self.pipe.vae
        latents = denormalized_latents(vae, self._unpack(latents, size).to(vae.dtype))
        image = vae.decode(latents, return_dict=False)[0][:, :, 0]
        return self.pipe.image_processor.postprocess(image, output_type="pil")

    def preview_latent(self, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        return self._unpack(latents, size)[0, :, 0]
