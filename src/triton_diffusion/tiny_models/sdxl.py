"""Stable Diffusion XL: ``tiny-sdxl``, for the family-matrix tests: two CLIP text encoders and a UNet with
size/crop conditioning; ``tiny-sdxl-inpaint``, the same with a 9-channel inpainting UNet.
"""

from __future__ import annotations

from pathlib import Path

from triton_diffusion.tiny_models.encoders import clip_text_encoder, reinit_normal, vae
from triton_diffusion.tiny_models.tokenization import clip_tokenizer


def build_tiny_sdxl(target: Path, inpainting: bool = False) -> None:
    """A Stable-Diffusion-XL-style pipeline: two CLIP text encoders (the second with a projection, whose
    pooled output and the size/crop "time ids" condition the UNet through ``text_time`` embeddings), Euler.
    With ``inpainting``: an inpainting checkpoint (``tiny-sdxl-inpaint``), as
    ``stable-diffusion-xl-1.0-inpainting-0.1`` is one: a 9-channel UNet (latents, mask, masked source)
    saved as a ``StableDiffusionXLInpaintPipeline``."""
    import torch
    from diffusers import (
        EulerDiscreteScheduler,
        StableDiffusionXLInpaintPipeline,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )

    torch.manual_seed(0)
    tokenizer = clip_tokenizer()
    tokenizer_2 = clip_tokenizer()
    addition_time_embed_dim = 8
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=8,
        in_channels=9 if inpainting else 4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=8,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=addition_time_embed_dim,
        # six time ids (original size, crop corner, target size), then the pooled text embedding
        projection_class_embeddings_input_dim=6 * addition_time_embed_dim + 32,
        cross_attention_dim=64,  # both encoders' hidden states, concatenated
        norm_num_groups=8,
    )
    reinit_normal(unet, 0.2)
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        timestep_spacing="leading",
    )
    pipeline_class = StableDiffusionXLInpaintPipeline if inpainting else StableDiffusionXLPipeline
    pipe = pipeline_class(
        vae=vae(latent_channels=4, scaling_factor=0.13025),
        text_encoder=clip_text_encoder(len(tokenizer)),
        text_encoder_2=clip_text_encoder(len(tokenizer_2), with_projection=True),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=scheduler,
        add_watermarker=False,
    )
    pipe.save_pretrained(target, safe_serialization=True)


def build_tiny_sdxl_inpaint(target: Path) -> None:
    build_tiny_sdxl(target, inpainting=True)
