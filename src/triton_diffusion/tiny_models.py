"""Build the tiny default models: real diffusers/transformers classes, seeded random weights.

No weights can be downloaded, so each family is built from its real classes with small configs (as in
diffusers' own ``get_dummy_components``), with a tokenizer vocabulary written here, and saved with
``save_pretrained`` (safetensors). The server then loads them through ``from_pretrained``, exactly like
real weights. Both use a VAE with scale factor 8, like the real models, so sizes behave the same way.
"""

from __future__ import annotations

import argparse
import shutil
import string
from collections.abc import Callable
from pathlib import Path

from triton_diffusion.serving.launcher import REPO_ROOT

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


def clip_text_encoder(vocab_size: int, with_projection: bool = False):
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
    _reinit_normal(unet, 0.2)  # so the prompt visibly changes the image
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
    _reinit_normal(transformer, 0.2)  # so the prompt visibly changes the image
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


def _train_bpe(corpus: list[str], pre_tokenizer, specials: list[str], alphabet: list[str]):
    """Train a BPE vocabulary on ``corpus`` until every pre-token in it is a single token; returns
    ``(vocab, merges)``. Training is deterministic, so the same corpus always gives the same tokenizer."""
    import json

    from tokenizers import Tokenizer, models, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=1_000_000,
        min_frequency=1,
        special_tokens=specials,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    model = json.loads(backend.to_str())["model"]
    return model["vocab"], [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]


def _corpus(*texts: str) -> list[str]:
    """The texts, then each of their words and the LM's words both alone and after a space."""
    words = [*_WORDS, *_CHARS, *(w for text in texts for w in text.split())]
    return [*texts, *(f"{w} {w}" for w in words)]


# Qwen's chat tokens (Qwen2.5-VL and Qwen3 share them), then the vision placeholders.
_QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# The system prompt QwenImagePipeline wraps every prompt in (34 tokens with the chat tokens around it).
_QWEN_IMAGE_SYSTEM_PROMPT = (
    "system user assistant\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:"
)
_QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def qwen_tokenizer(*texts: str):
    """A byte-level BPE ``Qwen2Tokenizer`` (Qwen's pre-tokenizer) whose merges make every word of ``texts``
    (the prompt templates) and of the LM's word list one token, as a real Qwen vocabulary would: Qwen-Image's
    system prompt then takes 34 tokens, the number the pipeline drops."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    vocab, merges = _train_bpe(
        _corpus(*texts), pre_tokenizer, _QWEN_SPECIALS, pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=_QWEN_SPECIALS[1:],
        model_max_length=32768,
    )
    tokenizer.chat_template = _QWEN_CHAT_TEMPLATE
    return tokenizer


def gemma_tokenizer(*texts: str):
    """A ``GemmaTokenizer`` (BPE on "▁"-joined text, byte fallback) whose merges make every word of ``texts``
    (the pipeline's instruction prompts) and of the LM's word list one token."""
    from tokenizers import normalizers, pre_tokenizers
    from transformers import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    specials += [f"<0x{i:02X}>" for i in range(256)]  # byte fallback for characters not in the vocabulary
    alphabet = sorted(set(string.ascii_letters + string.digits + string.punctuation + "▁\n"))
    # Gemma itself does not pre-tokenize; splitting before each "▁" while training keeps merges inside words.
    pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    normalized = [normalizers.Replace(" ", "▁").normalize_str(text) for text in _corpus(*texts)]
    vocab, merges = _train_bpe(normalized, pre_tokenizer, specials, alphabet)
    return GemmaTokenizer(
        vocab=vocab,
        merges=merges,
        add_bos_token=True,
        additional_special_tokens=specials[5:7],
        model_max_length=8192,
    )


def _reinit_normal(module, std: float) -> None:
    """Redraw every weight matrix and embedding of ``module`` from N(0, std), biases zero. Tiny models keep
    PyTorch's fan-in init otherwise, under which the text conditioning barely reaches the image."""
    import torch

    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, std)
            elif name.endswith("bias"):
                param.zero_()


def build_tiny_sdxl(target: Path) -> None:
    """A Stable-Diffusion-XL-style pipeline: two CLIP text encoders (the second with a projection, whose
    pooled output and the size/crop "time ids" condition the UNet through ``text_time`` embeddings), Euler."""
    import torch
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    torch.manual_seed(0)
    tokenizer = clip_tokenizer()
    tokenizer_2 = clip_tokenizer()
    addition_time_embed_dim = 8
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
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
    _reinit_normal(unet, 0.2)
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        timestep_spacing="leading",
    )
    pipe = StableDiffusionXLPipeline(
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


def build_tiny_sd3(target: Path) -> None:
    """A Stable-Diffusion-3-style pipeline: two CLIP encoders with projections and a T5 encoder, an MMDiT
    transformer over 2x2 patches of a 16-channel latent, flow matching."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
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
        in_channels=16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=64,
        caption_projection_dim=32,
        pooled_projection_dim=64,  # both CLIP projections, concatenated
        pos_embed_max_size=64,  # up to 64 patches a side: 1024 pixels
    )
    _reinit_normal(transformer, 0.15)
    pipe = StableDiffusion3Pipeline(
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
    ids = tokenizer.convert_tokens_to_ids
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
        latents_mean=[0.0] * z_dim,
        latents_std=[1.0] * z_dim,
    )
    # With its fan-in init this decoder's output barely depends on the latents (a near-constant grey).
    _reinit_normal(autoencoder, 0.3)
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
    _reinit_normal(transformer, 0.15)
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


def _default(pipeline_class, argument: str):
    import inspect

    return inspect.signature(pipeline_class.__call__).parameters[argument].default


def gemma2_text_encoder(tokenizer, hidden: int):
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
            attn_implementation="eager",
        )
    )
    # Gemma 2 adds RMS-normalised sublayer outputs to its residual stream: next to them, embeddings drawn
    # with std 0.02 vanish and every prompt token encodes alike. Embeddings of unit scale keep them apart.
    with torch.no_grad():
        text_encoder.embed_tokens.weight.normal_(0.0, 1.0)
    return text_encoder


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


def build_tiny_pixart_sigma(target: Path) -> None:
    """A PixArt-Sigma-style pipeline: T5 encoder (300 tokens), a DiT with cross-attention and adaLN-single,
    learned variance (8 output channels), DPM-Solver. Its ``sample_size`` 32 selects the 256-pixel
    aspect-ratio bins used by default resolution binning."""
    import torch
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel
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
    pipe = PixArtSigmaPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae(latent_channels=4, scaling_factor=0.13025),
        transformer=transformer,
        scheduler=DPMSolverMultistepScheduler(),
    )
    pipe.save_pretrained(target, safe_serialization=True)


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
    _reinit_normal(transformer, 0.15)  # also the (zero-initialised) padding tokens
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae(latent_channels, scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(target, safe_serialization=True)


# name -> builder. The tiny ones are the defaults the model repository serves.
ARCHITECTURES: dict[str, Callable[[Path], None]] = {
    "tiny-sd": build_tiny_sd,
    "tiny-flux": build_tiny_flux,
    "tiny-wan": build_tiny_wan,
    "tiny-dllm": build_tiny_dllm,
    "sd15": build_sd15,
    # More pipeline families, built on request (not served by default).
    "tiny-sdxl": build_tiny_sdxl,
    "tiny-sd3": build_tiny_sd3,
    "tiny-qwen-image": build_tiny_qwen_image,
    "tiny-sana": build_tiny_sana,
    "tiny-pixart-sigma": build_tiny_pixart_sigma,
    "tiny-z-image": build_tiny_z_image,
}
TINY_DEFAULTS = ["tiny-sd", "tiny-flux", "tiny-wan", "tiny-dllm"]
# The tiny families the family-matrix test serves (built on first use, then cached in weights/).
TINY_FAMILIES = ["tiny-sdxl", "tiny-sd3", "tiny-qwen-image", "tiny-sana", "tiny-pixart-sigma", "tiny-z-image"]
# Bump when a builder changes: folders built by an older version are rebuilt.
BUILD_VERSION = "2"
STAMP = ".triton-diffusion-build"


def build_missing(
    weights_dir: Path = DEFAULT_WEIGHTS_DIR, force: bool = False, only: list[str] | None = None
) -> list[Path]:
    built = []
    for name in only or TINY_DEFAULTS:
        target = weights_dir / name
        stamp = target / STAMP
        current = stamp.is_file() and stamp.read_text().strip() == BUILD_VERSION
        if force or not current:
            if target.exists():
                shutil.rmtree(target)
            ARCHITECTURES[name](target)
            stamp.write_text(BUILD_VERSION + "\n")
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
