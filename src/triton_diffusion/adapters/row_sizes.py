"""What a latent job's size means to a forward, composed into every latent step adapter
(``LatentStepAdapter.sizes``): a job's denoiser tokens (what the token budget and the cost model count),
the group it shares forwards with, and, where the family packs sizes (packed_rows.py), the packed forward.

A family says what its sizes are made of (the VAE's scale factor, the denoiser's patch, a video's temporal
compression) and whether and how its sizes pack (:class:`Packing`); nothing here calls back into the
adapter but the two functions it is given (whether a request is guided, and the model's forward).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from triton_diffusion.adapters.image_params import ImageParams, LatentJob, image_params
from triton_diffusion.adapters.packed_rows import (
    ANY_SIZE,
    Grid,
    canvas_for,
    padded_counts,
    place_patches,
    place_tokens,
    take_patches,
    take_tokens,
)
from triton_diffusion.engine.jobs import Job

# The model's forward as the loop calls it: (latents, timesteps, inputs, size) -> predictions.
Predict = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], tuple[int, int]], Any]


@dataclass(frozen=True)
class Packing:
    """Whether jobs of different sizes share a forward, and how a packed forward lays rows out.

    ``on``: FLUX.1 and SD3 where their checkpoint allows; the model turns it off with config
    ``pack_sizes: false`` (else, and for a UNet, whose convolutions cannot share a tensor across sizes, a
    forward holds one latent shape); ``why_not`` says why it is off. ``layout``: the loop's latents, as
    ``tokens`` (FLUX.1's packed 2x2 patches) or spatial ``patches`` (SD3); ``text_first``: where the
    attention puts the text (FLUX.1 first, SD3 last); ``centred_in``: the side of the position table a
    size is a centred crop of (SD3's PatchEmbed; None: positions from the origin, FLUX.1's ids)."""

    on: bool = False
    why_not: str = "its denoiser is a UNet: convolutions cannot share a tensor across sizes"
    layout: str = "tokens"
    text_first: bool = True
    centred_in: int | None = None


class RowSizes:
    """A family's job sizes: ``scale_factor`` pixels per latent pixel (per side), ``patch`` latent pixels
    per denoiser token (per side: the transformer's patch; FLUX.1 and Qwen-Image pack 2x2 latents in the
    pipeline instead; a UNet 1), ``temporal`` frames per latent frame (a video family; None: an image)."""

    def __init__(
        self,
        *,
        scale_factor: int,
        patch: int,
        guided: Callable[[ImageParams], bool],
        device: torch.device | str,
        temporal: int | None = None,
        packing: Packing | None = None,
    ) -> None:
        self.scale_factor, self.patch, self.temporal = scale_factor, patch, temporal
        self.guided = guided  # the family's uses_guidance: 2 rows with classifier-free guidance, else 1
        self.device = device
        self.packing = packing or Packing()

    def stop_packing(self, why: str) -> None:
        """One size per forward from now on (config ``pack_sizes: false``, CUDA graphs), and why."""
        if self.packing.on:
            self.packing = replace(self.packing, on=False, why_not=why)

    def token_grid(self, size: tuple[int, int]) -> tuple[int, int]:
        """(height, width) in denoiser tokens of one frame of an image of ``size`` pixels."""
        factor = self.scale_factor * self.patch
        return size[0] // factor, size[1] // factor

    def latent_frames(self, request: ImageParams) -> int:
        """Latent frames of a job (a video's temporal compression; an image: 1)."""
        if self.temporal is None:
            return 1
        assert request.num_frames is not None  # a video's frame count is filled in at parse
        return (request.num_frames - 1) // self.temporal + 1

    def tokens_of(self, request: ImageParams) -> int:
        """The denoiser tokens a job adds to a forward (what a forward's cost and the token budget count):
        its rows (2 with classifier-free guidance) x its latent tokens, frames included."""
        height, width = self.token_grid(request.size)
        rows = 2 if self.guided(request) else 1
        return rows * height * width * self.latent_frames(request)

    def computed(self, jobs: Sequence[Job]) -> tuple[int, int]:
        """The rows and tokens a forward of these jobs computes, padding included (:func:`padded_counts`):
        the engine's token budget and cost fit count this (engine/step_engine.py CountsComputed)."""
        grids = [
            job.state.grid if isinstance(job.state, LatentJob) else self.grid_of(image_params(job))
            for job in jobs
        ]
        return padded_counts(grids, [job.spec.tokens for job in jobs])

    def grid_of(self, request: ImageParams) -> Grid | None:
        """An image job's denoiser rows and token grid, what a packed forward pads it to (a video: None,
        its frames are never packed)."""
        if request.num_frames is not None:
            return None
        return (2 if self.guided(request) else 1, *self.token_grid(request.size))

    def group_of(self, request: ImageParams) -> Hashable:
        """Whom a started job shares forwards with: jobs of every size where the family packs sizes, else
        of its latent shape. A job with a step cache keeps to its shape: its cache's hooks run later blocks
        on the rows that compute, gathered, which a packed forward's shared key mask does not follow; so
        does one that may be given a step cache on the way (``degrade_cache``)."""
        if self.packing.on and not request.step_cache and not request.degrade_cache:
            return ANY_SIZE
        return request.shape

    def also_joins(self, request: ImageParams) -> Hashable:
        """The other group whose forwards a started job may step in: a job of every size's group also
        joins its own size's (where jobs with a step cache keep to it); None: only its own group."""
        return request.shape if self.group_of(request) == ANY_SIZE else None

    def predict_packed(
        self,
        predict: Predict,
        latent_rows: list[torch.Tensor],
        timesteps: torch.Tensor,
        inputs: dict[str, torch.Tensor],
        sizes: list[tuple[int, int]],
    ) -> tuple[list[torch.Tensor], int]:
        """``predict`` over rows of different ``sizes`` in one call: each row on the canvas (in tokens or
        in patches, as the family's loop lays its latents out), the key mask in the family's order of image
        and text, the model called at the canvas's size, each row's prediction taken back in its own shape;
        and the canvas slots computed for no row."""
        packing = self.packing
        canvas = canvas_for([self.token_grid(size) for size in sizes], packing.centred_in)
        patch, as_tokens = self.patch, packing.layout == "tokens"
        latents = (
            place_tokens(latent_rows, canvas) if as_tokens else place_patches(latent_rows, canvas, patch)
        )
        text = inputs["encoder_hidden_states"].shape[1]
        mask = canvas.key_mask(text, text_first=packing.text_first, device=self.device)
        factor = self.scale_factor * patch
        size = (canvas.height * factor, canvas.width * factor)
        predictions = predict(latents, timesteps, {**inputs, "attention_mask": mask}, size)
        rows = take_tokens(predictions, canvas) if as_tokens else take_patches(predictions, canvas, patch)
        return rows, canvas.padded_tokens
