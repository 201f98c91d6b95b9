"""Tiny LoRA adapters for the tiny pipelines, written the way diffusers' training scripts write them: peft
adapters added to the denoiser (and the text encoders), saved with the pipeline's ``save_lora_weights`` as
``pytorch_lora_weights.safetensors`` with their peft metadata (rank and alpha).

``init_lora_weights=False`` draws both low-rank factors at random (training starts with B = 0, which would
change nothing): each adapter visibly changes the image, so an exactness test of adapters proves something.
"""

from __future__ import annotations

from pathlib import Path

from triton_diffusion.adapters import diffusers_compat as compat

# The attention projections of the denoisers (UNet, Flux/SD3 transformers) and of CLIP-style text encoders.
DENOISER_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
TEXT_ENCODER_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]


def build_tiny_lora(base: Path, target: Path, seed: int, rank: int = 4, text_encoders: bool = True) -> None:
    """An adapter for the pipeline in ``base`` (built first if missing) into the folder ``target``."""
    import torch
    from diffusers import DiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from triton_diffusion.tiny_models.registry import build_missing

    build_missing(base.parent, only=[base.name])
    pipe = DiffusionPipeline.from_pretrained(base, use_safetensors=True)
    torch.manual_seed(seed)
    layers, metadata = {}, {}
    for name in compat.lora_loadable_modules(pipe):
        module = getattr(pipe, name, None)
        text_encoder = name.startswith("text_encoder")
        if module is None or (text_encoder and not text_encoders):
            continue
        targets = TEXT_ENCODER_TARGETS if text_encoder else DENOISER_TARGETS
        # alpha != rank, so the adapter's scaling (alpha / rank) is part of what the tests check.
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        module.add_adapter(config)
        layers[f"{name}_lora_layers"] = convert_state_dict_to_diffusers(get_peft_model_state_dict(module))
        metadata[f"{name}_lora_adapter_metadata"] = config.to_dict()
    target.mkdir(parents=True, exist_ok=True)
    type(pipe).save_lora_weights(target, **layers, **metadata, safe_serialization=True)
