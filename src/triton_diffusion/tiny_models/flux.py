"""FLUX.1: ``tiny-flux``, a tiny default the model repository serves: a flow-matching MMDiT with CLIP and T5
text encoders and guidance embeddings; ``tiny-flux-fill``, the same as a FLUX.1 Fill inpainting checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from triton_diffusion.tiny_models.encoders import TINY_T5_ENCODER, clip_text_encoder, reinit_normal, vae
from triton_diffusion.tiny_models.tokenization import clip_tokenizer, t5_tokenizer


def build_flux_bench(target: Path) -> None:
    """A small FLUX.1-style pipeline for step-cache benchmarks on a CPU: 4 double and 8 single blocks of
    width 128 (the tiny default has one of each, too few for the blocks a cache skips to be worth it)."""
    build_tiny_flux(target, layers=(4, 8), heads=4, head_dim=32)


def build_tiny_flux(
    target: Path, fill: bool = False, layers: tuple[int, int] = (1, 1), heads: int = 2, head_dim: int = 16
) -> None:
    """A FLUX.1-dev-style flow-matching pipeline: CLIP + T5 encoders, MMDiT transformer, guidance embeds.
    With ``fill``: a FLUX.1-Fill-style inpainting checkpoint saved as a ``FluxFillPipeline``: its
    transformer takes the packed latents, the packed masked source's latents and the packed 8x8 mask
    (FLUX.1-Fill-dev: 64 + 64 + 256 = 384 input channels) and predicts the latents' channels."""
    import torch
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        FluxFillPipeline,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    tokenizer = clip_tokenizer()
    tokenizer_2 = t5_tokenizer()
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), **TINY_T5_ENCODER))
    latent_channels = 4
    packed = latent_channels * 4  # 2x2 latent patches are packed into channels
    vae_scale_factor = 8
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=2 * packed + 4 * vae_scale_factor**2 if fill else packed,
        out_channels=packed,
        num_layers=layers[0],
        num_single_layers=layers[1],
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[head_dim // 4, head_dim // 4, head_dim // 2],
        guidance_embeds=True,
    )
    reinit_normal(transformer, 0.2)  # so the prompt visibly changes the image
    pipe = (FluxFillPipeline if fill else FluxPipeline)(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae(latent_channels, shift_factor=0.0609, scaling_factor=1.5035),
        text_encoder=clip_text_encoder(len(tokenizer)),
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    pipe.save_pretrained(target, safe_serialization=True)


def build_tiny_flux_fill(target: Path) -> None:
    build_tiny_flux(target, fill=True)
