"""The tiny default models: real diffusers/transformers classes with small configs and seeded random weights.

No weights can be downloaded, so each family is built from its real classes with small configs (as in
diffusers' own ``get_dummy_components``), with a tokenizer vocabulary written or trained here, and saved with
``save_pretrained`` (safetensors). The server then loads them through ``from_pretrained``, exactly like real
weights. The autoencoders keep the real models' scale factors (8; 32 for Sana), so sizes behave the same way.

One module per family (``stable_diffusion``, ``flux``, ``wan``, ``diffusion_lm``, ``sdxl``, ``sd3``,
``qwen_image``, ``sana``, ``pixart_sigma``, ``z_image``); the tokenizers (``tokenization``) and the text
encoders and VAE (``encoders``) they share; the name -> builder registry and the build command (``registry``).
"""

from triton_diffusion.tiny_models.diffusion_lm import build_tiny_dllm
from triton_diffusion.tiny_models.flux import build_tiny_flux
from triton_diffusion.tiny_models.pixart_sigma import build_tiny_pixart_sigma
from triton_diffusion.tiny_models.qwen_image import build_tiny_qwen_image
from triton_diffusion.tiny_models.registry import (
    ARCHITECTURES,
    BUILD_VERSION,
    DEFAULT_WEIGHTS_DIR,
    STAMP,
    TINY_DEFAULTS,
    TINY_FAMILIES,
    build_missing,
    main,
)
from triton_diffusion.tiny_models.sana import build_tiny_sana
from triton_diffusion.tiny_models.sd3 import build_tiny_sd3
from triton_diffusion.tiny_models.sdxl import build_tiny_sdxl
from triton_diffusion.tiny_models.stable_diffusion import build_sd15, build_tiny_sd
from triton_diffusion.tiny_models.wan import build_tiny_wan
from triton_diffusion.tiny_models.z_image import build_tiny_z_image

__all__ = [
    "ARCHITECTURES",
    "BUILD_VERSION",
    "DEFAULT_WEIGHTS_DIR",
    "STAMP",
    "TINY_DEFAULTS",
    "TINY_FAMILIES",
    "build_missing",
    "build_sd15",
    "build_tiny_dllm",
    "build_tiny_flux",
    "build_tiny_pixart_sigma",
    "build_tiny_qwen_image",
    "build_tiny_sana",
    "build_tiny_sd",
    "build_tiny_sd3",
    "build_tiny_sdxl",
    "build_tiny_wan",
    "build_tiny_z_image",
    "main",
]
