"""``python -m triton_diffusion.tiny_models``: the same as ``triton-diffusion-build-tiny``."""

from triton_diffusion.tiny_models.registry import main

main()
