"""Text-to-video on a diffusers pipeline; the pipeline and its limits are set in config.pbtxt."""

from triton_diffusion.models.text_to_video import TextToVideoModel
from triton_diffusion.serving.triton_model import serve

TritonPythonModel = serve(TextToVideoModel)
