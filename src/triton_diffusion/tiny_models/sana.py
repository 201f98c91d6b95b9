"""Sana: ``tiny-sana``, for the family-matrix tests: a Gemma-2 text encoder, the deep compression autoencoder
(spatial factor 32) and a linear-attention DiT sampled with DPM-Solver.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from triton_diffusion.tiny_models.encoders import gemma2_text_encoder
from triton_diffusion.tiny_models.tokenization import gemma_tokenizer


def _default(pipeline_class: type, argument: str) -> Any:
    import inspect

    return inspect.signature(pipeline_class.__call__).parameters[argument].default


def build_tiny_sana(target: Path) -> None:
    """A Sana-style pipeline: Gemma-2 text encoder behind Sana's long "complex human instruction", the deep
    compression autoencoder (spatial factor 32, 32 channels), a linear-attention DiT, DPM-Solver flow
    sampling. Its ``sample_size`` 16 selects the 512-pixel aspect-ratio bins of default resolution binning."""
    import torch
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel

    instruction = "\n".join(_default(SanaPipeline, "complex_human_instruction"))
    tokenizer = gemma_tokenizer(instruction)
    torch.manual_seed(0)
    hidden = 32
    text_encoder = gemma2_text_encoder(tokenizer, hidden)
    latent_channels = 32
    blocks = ("ResBlock",) * 3 + ("EfficientViTBlock",) * 3
    autoencoder = AutoencoderDC(
        in_channels=3,
        latent_channels=latent_channels,
        attention_head_dim=8,
        encoder_block_types=blocks,
        decoder_block_types=blocks,
        encoder_block_out_channels=(8, 8, 16, 16, 32, 32),  # six blocks: spatial factor 32
        decoder_block_out_channels=(8, 8, 16, 16, 32, 32),
        encoder_layers_per_block=(1,) * 6,
        decoder_layers_per_block=(1,) * 6,
        encoder_qkv_multiscales=((),) * 3 + ((5,),) * 3,
        decoder_qkv_multiscales=((),) * 3 + ((5,),) * 3,
        downsample_block_type="Conv",
        upsample_block_type="interpolate",
        decoder_norm_types="rms_norm",
        decoder_act_fns="silu",
        scaling_factor=0.41407,
    )
    transformer = SanaTransformer2DModel(
        in_channels=latent_channels,
        out_channels=latent_channels,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        num_cross_attention_heads=2,
        cross_attention_head_dim=16,
        cross_attention_dim=32,
        caption_channels=hidden,
        sample_size=16,
        patch_size=1,
    )
    scheduler = DPMSolverMultistepScheduler(  # Sana's own: DPM-Solver++ on flow-matching sigmas
        flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction"
    )
    pipe = SanaPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=autoencoder,
        transformer=transformer,
        scheduler=scheduler,
    )
    pipe.save_pretrained(target, safe_serialization=True)
