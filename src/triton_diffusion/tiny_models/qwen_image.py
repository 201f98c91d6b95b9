"""Qwen-Image: ``tiny-qwen-image``, for the family-matrix tests: a Qwen2.5-VL text encoder, a Wan-like causal
VAE and an MMDiT.
"""

from __future__ import annotations

from pathlib import Path

from triton_diffusion.tiny_models.encoders import reinit_normal
from triton_diffusion.tiny_models.tokenization import qwen_tokenizer

# The system prompt QwenImagePipeline wraps every prompt in (34 tokens with the chat tokens around it).
_QWEN_IMAGE_SYSTEM_PROMPT = (
    "system user assistant\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:"
)


def build_tiny_qwen_image(target: Path) -> None:
    """A Qwen-Image-style pipeline: Qwen2.5-VL text encoder behind Qwen's chat template, the Wan-like causal
    VAE (spatial factor 8), an MMDiT with 3-axis rotary positions over packed 2x2 latent patches."""
    import math

    import torch
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = qwen_tokenizer(_QWEN_IMAGE_SYSTEM_PROMPT)
    torch.manual_seed(0)

    def ids(token: str) -> int:
        found = tokenizer.convert_tokens_to_ids(token)
        assert isinstance(found, int)  # one token, one id
        return found

    hidden = 32
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3]},  # halves of the 16-wide heads
            rope_theta=1000000.0,
            bos_token_id=None,
            eos_token_id=ids("<|im_end|>"),
            pad_token_id=ids("<|endoftext|>"),
        ),
        vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=hidden
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    z_dim = 16
    autoencoder = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],  # three downsamplings: spatial factor 8
        # Not 0 and 1: the per-channel normalisation (img2img's encode, every decode) must matter.
        latents_mean=[round(0.05 * (i % 5) - 0.1, 3) for i in range(z_dim)],
        latents_std=[round(0.8 + 0.1 * (i % 4), 3) for i in range(z_dim)],
    )
    # With its fan-in init this decoder's output barely depends on the latents (a near-constant grey).
    reinit_normal(autoencoder, 0.3)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=z_dim * 4,  # 2x2 latent patches are packed into channels
        out_channels=z_dim,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=hidden,
        guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    )
    reinit_normal(transformer, 0.15)
    # Random image tokens mostly attend to each other; sharper attention onto the (qk-normed) text keys and
    # larger text values make the prompt matter without true CFG, which only runs given a negative prompt.
    with torch.no_grad():
        for block in transformer.transformer_blocks:
            block.attn.norm_added_k.weight.mul_(4.0)
            block.attn.add_v_proj.weight.mul_(5.0)
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen-Image's own schedule: resolution-dependent shift
        base_image_seq_len=256,
        base_shift=math.log(3),
        max_image_seq_len=8192,
        max_shift=math.log(3),
        shift=1.0,
        shift_terminal=0.02,
        use_dynamic_shifting=True,
        time_shift_type="exponential",
    )
    pipe = QwenImagePipeline(
        scheduler=scheduler,
        vae=autoencoder,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(target, safe_serialization=True)
