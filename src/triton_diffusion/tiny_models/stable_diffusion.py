"""Stable Diffusion 1.x: ``tiny-sd``, a tiny default the model repository serves, and ``sd15``, the
full-size architecture with random weights, for GPU benchmarks without downloading weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from triton_diffusion.tiny_models.encoders import clip_text_encoder, reinit_normal, vae
from triton_diffusion.tiny_models.tokenization import clip_tokenizer

if TYPE_CHECKING:
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer


def stable_diffusion_pipeline(
    unet: UNet2DConditionModel,
    autoencoder: AutoencoderKL,
    text_encoder: CLIPTextModel,
    tokenizer: CLIPTokenizer,
    pipeline_class: str = "StableDiffusionPipeline",
) -> StableDiffusionPipeline:
    """SD 1.x scheduler settings (DDIM, so cancelled rows can be dropped mid-call) around the given parts."""
    import diffusers
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    return getattr(diffusers, pipeline_class)(
        unet=unet,
        scheduler=scheduler,
        vae=autoencoder,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def build_tiny_sd(target: Path, inpainting: bool = False) -> None:
    """A Stable-Diffusion-1.x-style pipeline: CLIP text encoder, UNet with cross-attention, DDIM. With
    ``inpainting``: an inpainting checkpoint (``tiny-sd-inpaint``), as ``stable-diffusion-inpainting`` is
    one: a 9-channel UNet (latents, mask, masked source) saved as a ``StableDiffusionInpaintPipeline``."""
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    tokenizer = clip_tokenizer()
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=8,
        in_channels=9 if inpainting else 4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    reinit_normal(unet, 0.2)  # so the prompt visibly changes the image
    pipeline_class = "StableDiffusionInpaintPipeline" if inpainting else "StableDiffusionPipeline"
    pipe = stable_diffusion_pipeline(
        unet, vae(latent_channels=4), clip_text_encoder(len(tokenizer)), tokenizer, pipeline_class
    )
    pipe.save_pretrained(target, safe_serialization=True)


def build_tiny_sd_inpaint(target: Path) -> None:
    build_tiny_sd(target, inpainting=True)


def build_sd15(target: Path) -> None:
    """Full-size Stable Diffusion 1.5 architecture (860M-parameter UNet, CLIP ViT-L/14 text encoder) with
    random weights, for GPU benchmarks without downloading weights. Saved in fp16 (about 2 GB)."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=49408,
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            max_position_embeddings=77,
            hidden_act="quick_gelu",
            projection_dim=768,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
    unet = UNet2DConditionModel(sample_size=64, cross_attention_dim=768, attention_head_dim=8)
    autoencoder = AutoencoderKL(
        block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=2,
        latent_channels=4,
        sample_size=512,
    )
    pipe = stable_diffusion_pipeline(unet, autoencoder, text_encoder, clip_tokenizer())
    pipe.to(torch.float16).save_pretrained(target, safe_serialization=True)
