"""Text-to-image on a diffusers pipeline; the pipeline and its limits are set in config.pbtxt."""

from triton_diffusion.models.model_file import serve

TritonPythonModel = serve("text_to_image")
