"""Step adapter for Z-Image text-to-image (``ZImagePipeline``): a Qwen3 text encoder, a single-stream DiT
that takes a list of rows (each its own latents and its own caption of its own length: the transformer
pads and masks them per row itself), the flow-matching scheduler. The loop body mirrors the pipeline's
``__call__``:

- ``encode_prompt`` gives each prompt its unpadded caption features; a job keeps them zero-padded to
  ``max_sequence_length`` with its length (so rows stack), and each forward hands the transformer the
  list of every row's own features, as the pipeline does;
- classifier-free guidance where the row's ``guidance_scale`` > 0 (the pipeline's
  ``do_classifier_free_guidance``; a missing negative prompt is ""), combined as
  ``pos + g * (pos - neg)`` in float32, then negated (the transformer predicts the reverse velocity);
- latents drawn and stepped in float32, cast to the transformer's dtype for each forward; each row's
  timestep enters as ``(1000 - t) / 1000``.

The pipeline's defaults ``cfg_normalization=False`` and ``cfg_truncation=1.0`` (never truncated) are what
it runs for a served request; other defaults have no step adapter (the request-level engine serves them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from triton_diffusion.adapters import diffusers_compat as compat
from triton_diffusion.adapters.diffusers_pipeline import pipeline_timesteps
from triton_diffusion.adapters.image_params import ImageParams, LatentJob
from triton_diffusion.adapters.latent_loop import LatentStepAdapter
from triton_diffusion.adapters.row_sizes import Packing


class ZImageAdapter(LatentStepAdapter):
    fallback_max_sequence_length = 512
    captures_forwards = False  # predict reads the caption lengths back to the host
    packing = Packing(why_not="not built: its forward pads each caption and image itself, per call")

    @property
    def token_patch(self) -> int:
        return int(self.model.config.all_patch_size[0])

    def __init__(self, pipe: Any, facts: Any, schedulers: Any, max_sequence_length: int | None) -> None:
        if facts.default("cfg_normalization") or (facts.default("cfg_truncation") or 1.0) < 1.0:
            raise NotImplementedError("Z-Image with CFG normalisation or truncation has no step adapter")
        super().__init__(pipe, facts, schedulers, max_sequence_length)
        if not hasattr(self.module, "get_default_z_image_sigmas"):  # an older diffusers: request-level
            raise NotImplementedError("this diffusers' Z-Image module has no get_default_z_image_sigmas")

    def uses_guidance(self, request: ImageParams) -> bool:
        return self.guidance_scale(request) > 0.0

    def encode_texts(self, texts: list[str]) -> list[dict[str, torch.Tensor]]:
        # The base encode hands prompts and the guided rows' negative prompts here in one call: the
        # pipeline encodes a negative prompt exactly as a prompt (a missing one as ""). _encode_prompt
        # rewrites the list it is given (the chat template), so it gets its own.
        length = self.max_sequence_length
        features = compat.encode_prompt_features(self.pipe, list(texts), self.device, length)
        text = []
        for row in features:
            padded = row.new_zeros(1, self.max_sequence_length, row.shape[-1])
            padded[0, : row.shape[0]] = row
            # The length stays on the host: each forward unpads its rows without waiting for the GPU.
            text.append({"cap_feats": padded, "cap_length": torch.tensor([row.shape[0]])})
        return text

    def initial_latents(
        self, requests: Sequence[ImageParams], schedulers: Sequence[Any], generators: list[torch.Generator]
    ) -> torch.Tensor:
        height, width = requests[0].size
        channels = self.model.in_channels
        return self.pipe.prepare_latents(
            len(requests), channels, height, width, torch.float32, self.device, generators
        )

    def set_timesteps(self, scheduler: Any, request: ImageParams) -> torch.Tensor:
        factor = self.pipe.vae_scale_factor * 2
        image_seq_len = (request.height // factor) * (request.width // factor)
        sigmas = self.module.get_default_z_image_sigmas(request.steps)
        return pipeline_timesteps(
            self.module, scheduler, request.steps, self.schedule_device, sigmas, image_seq_len, max_shift=1.15
        )

    def timestep_rows(self, timesteps: Sequence[torch.Tensor]) -> torch.Tensor:
        # ZImagePipeline: (1000 - t.expand(batch)) / 1000, in the timesteps' own dtype.
        return (1000 - self.stacked_timesteps(timesteps, None)) / 1000

    def predict(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        size: tuple[int, int],
    ) -> Any:
        features, lengths = inputs["cap_feats"], inputs["cap_length"].tolist()
        captions = [features[row, :length] for row, length in enumerate(lengths)]
        rows = list(latents.to(self.dtype).unsqueeze(2).unbind(dim=0))
        outputs = self.model(rows, timesteps, captions, joint_attention_kwargs=None, return_dict=False)[0]
        # Negated here rather than after guidance: IEEE rounding is symmetric, so it is the same value.
        return -torch.stack([output.float() for output in outputs]).squeeze(2)

    def _guided_noise(self, states: list[LatentJob], predictions: torch.Tensor) -> torch.Tensor:
        """Z-Image's guidance ``pos + g * (pos - neg)``, row by row as the pipeline computes it."""
        noise, row = [], 0
        for state in states:
            if state.unconditional is None:
                noise.append(predictions[row : row + 1])
                row += 1
                continue
            neg, pos = predictions[row : row + 1], predictions[row + 1 : row + 2]  # [uncond, cond] per job
            noise.append(pos + state.guidance * (pos - neg))
            row += 2
        return torch.cat(noise)

    def decode(self, latents: torch.Tensor, size: tuple[int, int]) -> list[Image.Image]:
        vae = self.pipe.vae
        latents = latents.to(vae.dtype)
        latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="pil")
