"""Stable Diffusion 3: ``tiny-sd3``, for the family-matrix tests: two CLIP and one T5 text encoder, an MMDiT,
flow matching; ``tiny-sd3-inpaint``, the same with a 33-channel inpainting transformer.
"""

from __future__ import annotations

from pathlib import Path

from triton_diffusion.tiny_models.encoders import TINY_T5_ENCODER, clip_text_encoder, reinit_normal, vae
from triton_diffusion.tiny_models.tokenization import clip_tokenizer, t5_tokenizer


def build_tiny_sd3(target: Path, inpainting: bool = False) -> None:
    """A Stable-Diffusion-3-style pipeline: two CLIP encoders with projections and a T5 encoder, an MMDiT
    transformer over 2x2 patches of a 16-channel latent, flow matching. With ``inpainting``: an inpainting
    checkpoint saved as a ``StableDiffusion3InpaintPipeline`` whose transformer takes 33 channels (the
    latents, the mask and the masked source's latents)."""
    import torch
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3InpaintPipeline,
        StableDiffusion3Pipeline,
    )
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    tokenizer = clip_tokenizer()
    tokenizer_2 = clip_tokenizer()
    tokenizer_3 = t5_tokenizer()
    # The two CLIP hidden states (32 + 32) are zero-padded to the T5 width, so T5 must be at least 64 wide.
    text_encoder_3 = T5EncoderModel(
        T5Config(vocab_size=len(tokenizer_3), **{**TINY_T5_ENCODER, "d_model": 64})
    )
    transformer = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=33 if inpainting else 16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=64,
        caption_projection_dim=32,
        pooled_projection_dim=64,  # both CLIP projections, concatenated
        pos_embed_max_size=64,  # up to 64 patches a side: 1024 pixels
    )
    reinit_normal(transformer, 0.15)
    pipe = (StableDiffusion3InpaintPipeline if inpainting else StableDiffusion3Pipeline)(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae(
            16, shift_factor=0.0609, scaling_factor=1.5035, use_quant_conv=False, use_post_quant_conv=False
        ),
        text_encoder=clip_text_encoder(len(tokenizer), with_projection=True),
        tokenizer=tokenizer,
        text_encoder_2=clip_text_encoder(len(tokenizer_2), with_projection=True),
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
        transformer=transformer,
    )
    pipe.save_pretrained(target, safe_serialization=True)


def build_tiny_sd3_inpaint(target: Path) -> None:
    build_tiny_sd3(target, inpainting=True)
