"""Build the tiny default models: real diffusers/transformers classes, seeded random weights.

No weights can be downloaded, so each family is built from its real classes with small configs (as in
diffusers' own ``get_dummy_components``), with a tokenizer vocabulary written here, and saved with
``save_pretrained`` (safetensors). The server then loads them through ``from_pretrained``, exactly like
real weights. Both use a VAE with scale factor 8, like the real models, so sizes behave the same way.
"""

from __future__ import annotations

import argparse
import string
from collections.abc import Callable
from pathlib import Path

from triton_diffusion.launcher import REPO_ROOT

DEFAULT_WEIGHTS_DIR = REPO_ROOT / "weights"
_CHARS = string.ascii_lowercase + string.digits + string.punctuation


def clip_tokenizer():
    from transformers import CLIPTokenizer

    # Character-level BPE (no merges): every character, and every character ending a word.
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in _CHARS:
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def t5_tokenizer():
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    pieces += [(c, -2.0) for c in _CHARS] + [("▁" + c, -1.5) for c in _CHARS]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


# A two-layer T5 encoder, shared by the Flux (T5) and Wan (UMT5) text encoders.
TINY_T5_ENCODER = dict(
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


def clip_text_encoder(vocab_size: int):
    from transformers import CLIPTextConfig, CLIPTextModel

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
    return CLIPTextModel(config)


def vae(latent_channels: int, **kwargs):
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


def stable_diffusion_pipeline(unet, autoencoder, text_encoder, tokenizer):
    """SD 1.x scheduler settings (DDIM, so cancelled rows can be dropped mid-call) around the given parts."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    return StableDiffusionPipeline(
        unet=unet,
        scheduler=scheduler,
        vae=autoencoder,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def build_tiny_sd(target: Path) -> None:
    """A Stable-Diffusion-1.x-style pipeline: CLIP text encoder, UNet with cross-attention, DDIM."""
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    tokenizer = clip_tokenizer()
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    pipe = stable_diffusion_pipeline(
        unet, vae(latent_channels=4), clip_text_encoder(len(tokenizer)), tokenizer
    )
    pipe.save_pretrained(target, safe_serialization=True)


def build_tiny_flux(target: Path) -> None:
    """A FLUX.1-dev-style flow-matching pipeline: CLIP + T5 encoders, MMDiT transformer, guidance embeds."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    tokenizer = clip_tokenizer()
    tokenizer_2 = t5_tokenizer()
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), **TINY_T5_ENCODER))
    latent_channels = 4
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=latent_channels * 4,  # 2x2 latent patches are packed into channels
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
        guidance_embeds=True,
    )
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae(latent_channels, shift_factor=0.0609, scaling_factor=1.5035),
        text_encoder=clip_text_encoder(len(tokenizer)),
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    pipe.save_pretrained(target, safe_serialization=True)


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
    # Spatial factor 8 and temporal factor 4, like the real Wan VAE: frames must be 4k+1.
    autoencoder = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
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


# The tiny diffusion LM's words: enough for readable (if random) text; other words split into characters.
_WORDS = """
the a an and or but if then so of to in on at by for with from as is are was were be been it this that
these those i you he she we they me him her us them my your his its our their what which who when where
why how not no yes all any some many much more most few other such only own same than too very can will
just should now one two three four five six seven eight nine ten first last new old good great small big
long little high low right left time year day week night morning way man woman child people world life
hand part place case point home water room mother father area money story fact month lot study book eye
job word business issue side kind head house service friend power hour game line end member law car city
name team minute idea body information back parent face others level office door health person art war
history party result change reason research girl guy moment air teacher force education sun moon star sky
sea river tree flower bird cat dog horse fish light dark red blue green yellow white black color model
image text language token mask block step diffusion server batch request answer question think know make
go see come take give find tell ask work seem feel try leave call keep let begin help show hear play run
move live believe bring happen write provide sit stand lose pay meet include continue set learn lead
understand watch follow stop create speak read allow add spend grow open walk win offer remember love
consider appear buy wait serve die send expect build stay fall cut reach kill remain
""".split()


def build_tiny_dllm(target: Path) -> None:
    """A bidirectional masked LM (EuroBERT classes, LLaDA-like: rotary positions, SwiGLU) with a
    WordPiece tokenizer and a chat template, as a tiny stand-in for LLaDA."""
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import EuroBertConfig, EuroBertForMaskedLM, PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "<|mask|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {token: i for i, token in enumerate(specials)}
    # The pre-tokenizer splits punctuation off, so only letters and digits continue a word ("##").
    continuations = ["##" + c for c in string.ascii_lowercase + string.digits]
    for piece in [*_WORDS, *_CHARS, *continuations]:
        vocab.setdefault(piece, len(vocab))
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=64))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        mask_token="<|mask|>",
        eos_token="<|eos|>",
        additional_special_tokens=specials[4:],
    )
    tokenizer.chat_template = (
        "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    torch.manual_seed(0)
    config = EuroBertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=1024,
        pad_token_id=vocab["[PAD]"],
        bos_token_id=None,
        eos_token_id=vocab["<|eos|>"],
        mask_token_id=vocab["<|mask|>"],
    )
    # Random weights are nearly uniform over the vocabulary; a wider init gives confident, varied picks.
    config.initializer_range = 0.2
    model = EuroBertForMaskedLM(config)
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)


# name -> builder. The tiny ones are the defaults the model repository serves.
ARCHITECTURES: dict[str, Callable[[Path], None]] = {
    "tiny-sd": build_tiny_sd,
    "tiny-flux": build_tiny_flux,
    "tiny-wan": build_tiny_wan,
    "tiny-dllm": build_tiny_dllm,
    "sd15": build_sd15,
}
TINY_DEFAULTS = ["tiny-sd", "tiny-flux", "tiny-wan", "tiny-dllm"]


def build_missing(
    weights_dir: Path = DEFAULT_WEIGHTS_DIR, force: bool = False, only: list[str] | None = None
) -> list[Path]:
    built = []
    for name in only or TINY_DEFAULTS:
        target = weights_dir / name
        # diffusers pipelines write model_index.json, transformers models config.json
        built_before = (target / "model_index.json").is_file() or (target / "config.json").is_file()
        if force or not built_before:
            ARCHITECTURES[name](target)
            built.append(target)
    return built


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Build random-weight pipelines (the tiny defaults unless named)."
    )
    parser.add_argument("names", nargs="*", help=f"any of {list(ARCHITECTURES)}; default: {TINY_DEFAULTS}")
    parser.add_argument("--weights-dir", type=Path, default=DEFAULT_WEIGHTS_DIR)
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args(argv)
    unknown = set(args.names) - set(ARCHITECTURES)
    if unknown:
        parser.error(f"unknown architectures {sorted(unknown)}; choose from {list(ARCHITECTURES)}")
    for path in build_missing(args.weights_dir, args.force, args.names or None):
        print(f"built {path}")


if __name__ == "__main__":
    main()
