"""The tiny models' shared parts: CLIP, T5 and Gemma-2 text encoders and the scale-factor-8 VAE, built once
here for every family that uses them, and the re-initialisation that lets a prompt steer random weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, overload

if TYPE_CHECKING:
    import torch
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, Gemma2Model, PreTrainedTokenizerBase


# A two-layer T5 encoder, shared by the T5 (Flux, SD3, PixArt-Sigma) and UMT5 (Wan) text encoders.
TINY_T5_ENCODER: dict[str, Any] = dict(
    d_model=32,
    d_ff=37,
    d_kv=8,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    decoder_start_token_id=0,
    pad_token_id=0,
    eos_token_id=1,
)


@overload
def clip_text_encoder(vocab_size: int, with_projection: Literal[False] = False) -> CLIPTextModel: ...
@overload
def clip_text_encoder(vocab_size: int, with_projection: Literal[True]) -> CLIPTextModelWithProjection: ...
def clip_text_encoder(
    vocab_size: int, with_projection: bool = False
) -> CLIPTextModel | CLIPTextModelWithProjection:
    """A two-layer CLIP text encoder; ``with_projection`` adds the projection whose pooled output SDXL and SD3
    condition on."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        hidden_size=32,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=2,
        vocab_size=vocab_size,
        projection_dim=32,
        max_position_embeddings=77,
    )
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(config)


def vae(latent_channels: int, **kwargs: Any) -> AutoencoderKL:
    """A small ``AutoencoderKL``; ``kwargs`` set the family's own latent scaling (and quant convs)."""
    from diffusers import AutoencoderKL

    # Four blocks: scale factor 8, like the real Stable Diffusion and Flux autoencoders.
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(8, 8, 16, 16),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=64,
        **kwargs,
    )


def gemma2_text_encoder(tokenizer: PreTrainedTokenizerBase, hidden: int) -> Gemma2Model:
    """A two-layer ``Gemma2Model`` (the text encoder of Sana, also of Lumina-Image 2.0) for ``tokenizer``."""
    import torch
    from transformers import Gemma2Config, Gemma2Model

    text_encoder = Gemma2Model(
        Gemma2Config(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
            # A PretrainedConfig keyword that Gemma2Config's own signature does not list.
            attn_implementation="eager",  # type: ignore[call-arg]
        )
    )
    # Gemma 2 adds RMS-normalised sublayer outputs to its residual stream: next to them, embeddings drawn
    # with std 0.02 vanish and every prompt token encodes alike. Embeddings of unit scale keep them apart.
    with torch.no_grad():
        text_encoder.embed_tokens.weight.normal_(0.0, 1.0)
    return text_encoder


def reinit_normal(module: torch.nn.Module, std: float) -> None:
    """Redraw every weight matrix and embedding of ``module`` from N(0, std), biases zero. Tiny models keep
    PyTorch's fan-in init otherwise, under which the text conditioning barely reaches the image."""
    import torch

    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, std)
            elif name.endswith("bias"):
                param.zero_()
