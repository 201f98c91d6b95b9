"""A cheap low-resolution preview of a denoising row: a linear latent-to-RGB projection, no VAE decode."""

from __future__ import annotations

import torch
from PIL import Image

from triton_diffusion.codecs.image import encode_image

# The widely used linear approximation of the Stable Diffusion 1.x/2.x VAE for 4-channel latents.
SD_LATENT_RGB = torch.tensor(
    [
        [0.3512, 0.2297, 0.3227],
        [0.3250, 0.4974, 0.2350],
        [-0.2829, 0.1762, 0.2721],
        [-0.2120, -0.2616, -0.7177],
    ]
)


def latent_to_rgb(latent: torch.Tensor) -> torch.Tensor:
    """(C, h, w) latent -> (3, h, w) in [0, 1]."""
    latent = latent.detach().float().cpu()
    channels = latent.shape[0]
    if channels == SD_LATENT_RGB.shape[0]:
        rgb = torch.einsum("chw,cr->rhw", latent, SD_LATENT_RGB)
    else:
        # Any other latent space: average three groups of channels, a stable if rough colour mapping.
        rgb = torch.stack([group.mean(dim=0) for group in torch.tensor_split(latent, 3, dim=0)])
    low = rgb.amin(dim=(1, 2), keepdim=True)
    high = rgb.amax(dim=(1, 2), keepdim=True)
    return (rgb - low) / (high - low).clamp_min(1e-6)


def preview_png(latent: torch.Tensor) -> bytes:
    rgb = (latent_to_rgb(latent) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    return encode_image(Image.fromarray(rgb), "png")
