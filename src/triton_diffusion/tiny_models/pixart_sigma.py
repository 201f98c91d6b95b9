"""PixArt-Sigma and PixArt-Alpha: ``tiny-pixart-sigma`` and ``tiny-pixart-alpha``, for the family-matrix
tests: a T5 text encoder and a DiT with cross-attention and adaLN-single.
"""

from __future__ import annotations

from pathlib import Path

from triton_diffusion.tiny_models.encoders import TINY_T5_ENCODER, vae
from triton_diffusion.tiny_models.tokenization import t5_tokenizer


def build_tiny_pixart_sigma(target: Path, alpha: bool = False) -> None:
    """A PixArt-Sigma-style pipeline: T5 encoder (300 tokens), a DiT with cross-attention and adaLN-single,
    learned variance (8 output channels), DPM-Solver. Its ``sample_size`` 32 selects the 256-pixel
    aspect-ratio bins used by default resolution binning. With ``alpha``: the same saved as a
    ``PixArtAlphaPipeline`` (120 tokens by default, its own loop)."""
    import torch
    from diffusers import (
        DPMSolverMultistepScheduler,
        PixArtAlphaPipeline,
        PixArtSigmaPipeline,
        PixArtTransformer2DModel,
    )
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    tokenizer = t5_tokenizer()
    text_encoder = T5EncoderModel(T5Config(vocab_size=len(tokenizer), **TINY_T5_ENCODER))
    transformer = PixArtTransformer2DModel(
        sample_size=32,
        num_layers=2,
        patch_size=2,
        attention_head_dim=16,
        num_attention_heads=2,
        caption_channels=TINY_T5_ENCODER["d_model"],
        in_channels=4,
        out_channels=8,
        cross_attention_dim=32,
        attention_bias=True,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_single",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
        use_additional_conditions=False,
        interpolation_scale=0.5,
    )
    # The cross-attention (the only way in for the text) is a near-uniform average of the caption tokens
    # with this init, and small next to the self-attention path: larger caption features and values help.
    with torch.no_grad():
        transformer.caption_projection.linear_2.weight.mul_(3.0)
        for block in transformer.transformer_blocks:
            block.attn2.to_v.weight.mul_(5.0)
    pipe = (PixArtAlphaPipeline if alpha else PixArtSigmaPipeline)(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae(latent_channels=4, scaling_factor=0.13025),
        transformer=transformer,
        scheduler=DPMSolverMultistepScheduler(),
    )
    pipe.save_pretrained(target, safe_serialization=True)


def build_tiny_pixart_alpha(target: Path) -> None:
    build_tiny_pixart_sigma(target, alpha=True)
