"""The model kinds a model.py serves (``TritonPythonModel = serve("text_to_image")``), by the KIND
MODEL_INFO names them: listed here so the type checker holds each to serving/triton_model.py's
``ModelKind`` (models/model_file.py imports each by name, a test holds the two lists to each other)."""

from __future__ import annotations

from triton_diffusion.models.diffusion_lm import DiffusionLMModel
from triton_diffusion.models.image_to_image import ImageToImageModel
from triton_diffusion.models.text_to_image import TextToImageModel
from triton_diffusion.models.text_to_video import TextToVideoModel
from triton_diffusion.serving.triton_model import ModelKind

KINDS: dict[str, type[ModelKind]] = {
    TextToImageModel.KIND: TextToImageModel,
    ImageToImageModel.KIND: ImageToImageModel,
    TextToVideoModel.KIND: TextToVideoModel,
    DiffusionLMModel.KIND: DiffusionLMModel,
}
