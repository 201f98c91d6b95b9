"""Text-to-video on a diffusers pipeline; the pipeline and its limits are set in config.pbtxt."""

from triton_diffusion.models.text_to_video import TextToVideoModel


class TritonPythonModel(TextToVideoModel):
    pass
