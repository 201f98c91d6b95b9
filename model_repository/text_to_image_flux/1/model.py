"""Text-to-image on a diffusers pipeline; the pipeline and its limits are set in config.pbtxt."""

from triton_diffusion.models.text_to_image import TextToImageModel
from triton_diffusion.serving.triton_model import serve

TritonPythonModel = serve(TextToImageModel)
