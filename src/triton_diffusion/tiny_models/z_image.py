"""Z-Image: ``tiny-z-image``, for the family-matrix tests: a Qwen3 text encoder, a single-stream DiT and the
Flux autoencoder.
"""

from __future__ import annotations

from pathlib import Path

from triton_diffusion.tiny_models.encoders import reinit_normal, vae
from triton_diffusion.tiny_models.tokenization import qwen_tokenizer


def build_tiny_z_image(target: Path) -> None:
    """A Z-Image-style pipeline: Qwen3 text encoder behind Qwen's chat template (its second-to-last hidden
    states), a single-stream DiT with 3-axis rotary positions over 2x2 patches, the Flux autoencoder."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = qwen_tokenizer()
    torch.manual_seed(0)
    hidden = 32
    text_encoder = Qwen3Model(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            bos_token_id=None,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    latent_channels = 16
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=latent_channels,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        qk_norm=True,
        cap_feat_dim=hidden,
        axes_dims=[8, 4, 4],
        axes_lens=[1024, 512, 512],
    )
    reinit_normal(transformer, 0.15)  # also the (zero-initialised) padding tokens
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae(latent_channels, scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(target, safe_serialization=True)
