"""A masked diffusion language model (LLaDA-style) with step-level continuous batching."""

from triton_diffusion.models.model_file import serve

TritonPythonModel = serve("text_generation")
