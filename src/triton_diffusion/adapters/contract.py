"""What a latent diffusion family provides to the shared loop (latent_loop.py, starts.py): the hooks it
must implement (:class:`LatentFamily`) and those it may override (:class:`LatentFamilyOptions`, with the
loop's defaults). A family is a subclass of ``LatentStepAdapter`` (stable_diffusion.py, flow_matching.py,
dit.py, qwen_image.py, z_image.py, wan.py); these Protocols say which of its methods the loop relies on.

Class attributes a family may set: ``scales_model_input``, ``always_passes_step_kwargs``,
``fallback_max_sequence_length``, ``guidance_embeds``, ``captures_forwards``, ``inpainting_checkpoint``,
``cache_methods`` and ``cache_per_branch`` (documented where latent_loop.py declares them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from PIL import Image

from triton_diffusion.adapters.image_requests import Conditioning, ImageRequest


class LatentFamily(Protocol):
    """The hooks every family implements."""

    def encode(self, requests: Sequence[ImageRequest]) -> list[Conditioning]:
        """Each request's text conditioning, in one text-encoder call where the pipeline allows (the default
        ``encode`` calls ``encode_texts``: a family implements one of the two)."""

    def initial_latents(
        self, requests: Sequence[ImageRequest], schedulers: Sequence[Any], generators: list[torch.Generator]
    ) -> torch.Tensor:
        """[n, ...] starting latents of text jobs of one shape, each row from its own generator."""

    def set_timesteps(self, scheduler: Any, request: ImageRequest) -> torch.Tensor:
        """The job's schedule on its own scheduler, as the pipeline's ``retrieve_timesteps`` makes it."""

    def predict(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        size: tuple[int, int],
    ) -> torch.Tensor:
        """The denoiser over every row of one forward (all of one shape)."""

    def decode(self, latents: torch.Tensor, size: tuple[int, int]) -> list[Image.Image]:
        """Done jobs' latents of one shape into images (or videos), as the pipeline decodes them."""


class LatentFamilyOptions(Protocol):
    """Hooks a family may override; the loop's defaults fit the UNet and DiT pipelines that need none."""

    @property
    def model(self) -> Any:
        """The denoiser (default: the pipeline's transformer)."""

    def supports(self, start: str) -> bool:
        """Which image-conditioned starts (``image``, ``mask``) it serves with this model (default: none)."""

    def encode_texts(self, texts: list[str]) -> list[dict[str, torch.Tensor]]:
        """Each text's conditioning, for the default ``encode``."""

    def uses_guidance(self, request: ImageRequest) -> bool:
        """Whether the job adds an unconditional row (default: guidance_scale > 1)."""

    def guidance_scale(self, request: ImageRequest) -> float:
        """The (true) CFG scale applied (default: guidance_scale)."""

    def extra_inputs(self, request: ImageRequest) -> dict[str, torch.Tensor]:
        """Per-row model inputs besides the text (default: the guidance of a guidance-distilled model)."""

    def timestep_rows(self, timesteps: Sequence[torch.Tensor]) -> torch.Tensor:
        """The per-row timestep vector the model takes (default: float32, as is)."""

    def pack(self, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """[n, C, h, w] latents into the loop's layout (default: as they are; FLUX.1 packs 2x2 patches)."""

    def preview_latent(self, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """[C, h, w] of one job's latents for a preview (default: its first row)."""

    def first_step(self, steps: int, strength: float) -> int:
        """Where an image-conditioned job enters its schedule (default: SD's get_timesteps)."""

    def encode_source(self, pixels: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        """[n, ...] latents of preprocessed source images (image-conditioned families)."""

    def noise_source(
        self, scheduler: Any, image_latents: torch.Tensor, noise: torch.Tensor, timestep: torch.Tensor
    ) -> torch.Tensor:
        """One row's source noised to ``timestep`` (default: ``scheduler.add_noise``)."""
