"""Text-to-image on a diffusers pipeline; the pipeline and its limits are set in config.pbtxt."""

from triton_diffusion.models.text_to_image import TextToImageModel


class TritonPythonModel(TextToImageModel):
    pass
