"""Step adapter for Wan 2.1 text-to-video (``WanPipeline``): 5-D latents [1, C, F', h, w], a UMT5 text
encoder, a 3D transformer that predicts the flow velocity, and the pipeline's flow-matching scheduler
(FlowMatchEulerDiscreteScheduler, or UniPC with flow sigmas as the released checkpoints ship it). The loop
body mirrors ``WanPipeline.__call__``: latents are drawn and kept in float32 and cast to the transformer's
dtype for each forward, no input scaling, classifier-free guidance where ``guidance_scale`` > 1 (the
pipeline's ``do_classifier_free_guidance``), with a missing negative prompt encoded as "" as its
``encode_prompt`` does, and the scheduler steps.

A video's frame count is part of its shape (``ImageParams.shape``): videos share forwards only with
videos of the same size and frame count. Two-stage Wan 2.2 (``transformer_2`` with ``boundary_ratio``) and
TI2V (``expand_timesteps``: a timestep per latent patch) have no step adapter: the request-level engine
serves them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from diffusers.utils.torch_utils import get_module_execution_device

from triton_diffusion.adapters.image_params import ImageParams
from triton_diffusion.adapters.latent_loop import LatentStepAdapter
from triton_diffusion.adapters.row_sizes import Packing, RowSizes
from triton_diffusion.adapters.vae import denormalized_latents
from triton_diffusion.codecs.video import to_uint8


class WanAdapter(LatentStepAdapter):
    fallback_max_sequence_length = 512
    # WanPipeline runs each CFG branch under its own cache_context. (TaylorSeer's patterns match none of
    # Wan's attn1/attn2: there it would do nothing.)
    cache_methods = ("fbc",)
    cache_per_branch = True
    packing = Packing(why_not="not built: WanAttnProcessor would need the key mask, and frames a 3-D canvas")

    def row_sizes(self) -> RowSizes:
        # A video's tokens: its latent frames (the VAE's temporal compression) x its spatial grid.
        return RowSizes(
            scale_factor=self.pipe.vae_scale_factor_spatial,
            patch=self.token_patch,
            temporal=self.pipe.vae_scale_factor_temporal,
            guided=self.uses_guidance,
            device=self.device,
            packing=self.packing,
        )

    def __init__(self, pipe: Any, facts: Any, schedulers: Any, max_sequence_length: int | None) -> None:
        config = pipe.config
        if getattr(config, "boundary_ratio", None) is not None or pipe.transformer is None:
            raise NotImplementedError("two-stage Wan (transformer_2) has no step adapter")
        if getattr(config, "expand_timesteps", False):
            raise NotImplementedError("Wan with a timestep per latent patch (TI2V) has no step adapter")
        super().__init__(pipe, facts, schedulers, max_sequence_length)

    def encode_texts(self, texts: list[str]) -> list[dict[str, torch.Tensor]]:
        # The base encode hands prompts and the guided rows' negative prompts here in one call:
        # encode_prompt encodes a negative prompt exactly as a prompt (a missing one as "").
        embeds, _ = self.pipe.encode_prompt(
            prompt=texts,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        embeds = embeds.to(self.dtype)  # the pipeline casts them to the transformer's dtype
        return [{"encoder_hidden_states": embeds[i : i + 1]} for i in range(len(texts))]

    def initial_latents(
        self, requests: Sequence[ImageParams], schedulers: Sequence[Any], generators: list[torch.Generator]
    ) -> torch.Tensor:
        first = requests[0]
        channels = self.model.config.in_channels
        # float32, as WanPipeline draws and keeps them; each forward casts them to the transformer's dtype.
        return self.pipe.prepare_latents(
            len(requests),
            channels,
            first.height,
            first.width,
            first.num_frames,
            torch.float32,
            self.device,
            generators,
        )

    def set_timesteps(self, scheduler: Any, request: ImageParams) -> torch.Tensor:
        scheduler.set_timesteps(request.steps, device=self.schedule_device)
        return scheduler.timesteps

    def predict(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        size: tuple[int, int],
    ) -> Any:
        return self.model(
            hidden_states=latents.to(self.dtype),
            timestep=timesteps,
            encoder_hidden_states=inputs["encoder_hidden_states"],
            attention_kwargs=None,
            return_dict=False,
        )[0]

    def decode(self, latents: torch.Tensor, size: tuple[int, int]) -> list[np.ndarray]:
        """Each video's uint8 frames [F, H, W, 3], decoded as WanPipeline decodes (the latents unscaled
        with the VAE's mean and std, ``postprocess_video`` to float frames), then ``to_uint8``."""
        vae = self.pipe.vae
        latents = latents.to(get_module_execution_device(vae), dtype=vae.dtype)
        video = vae.decode(denormalized_latents(vae, latents), return_dict=False)[0]
        frames = self.pipe.video_processor.postprocess_video(video, output_type="np")
        return [to_uint8(one) for one in frames]

    def preview_latent(self, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        # The middle latent frame, as the request-level engine's previews of a video.
        return latents[0, :, latents.shape[2] // 2]
