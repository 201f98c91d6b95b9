"""Wan 2.1: ``tiny-wan``, the tiny text-to-video default the model repository serves: a UMT5 text encoder, a
3D transformer and a causal video VAE.
"""

from __future__ import annotations

from pathlib import Path

from triton_diffusion.tiny_models.encoders import TINY_T5_ENCODER
from triton_diffusion.tiny_models.tokenization import t5_tokenizer


def build_tiny_wan(target: Path) -> None:
    """A Wan-2.1-style text-to-video pipeline: UMT5 text encoder, 3D transformer, causal video VAE."""
    import torch
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    tokenizer = t5_tokenizer()
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), **TINY_T5_ENCODER))
    # Spatial factor 8 and temporal factor 4, like the real Wan VAE: frames must be 4k+1. The decoder halves
    # the channels of its upsampling blocks and RMS-normalises them: from 8 channels they keep 4 (from 3 they
    # kept 1, where the norm is sign(x) and a rounding-level change of the latents flips whole pixels).
    autoencoder = AutoencoderKLWan(
        base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=transformer,
        vae=autoencoder,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
    )
    pipe.save_pretrained(target, safe_serialization=True)
