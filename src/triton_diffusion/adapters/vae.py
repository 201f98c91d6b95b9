"""VAE helpers the step adapters share: sampling each row's latent distribution with its own generator,
and the per-channel normalisation of Wan-style VAEs (Wan, Qwen-Image)."""

from __future__ import annotations

from typing import Any

import torch


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
