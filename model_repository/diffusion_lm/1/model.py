"""A masked diffusion language model (LLaDA-style) with step-level continuous batching."""

from triton_diffusion.models.diffusion_lm import DiffusionLMModel
from triton_diffusion.serving.triton_model import serve

TritonPythonModel = serve(DiffusionLMModel)
