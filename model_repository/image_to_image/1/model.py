"""Image-to-image on a diffusers pipeline; the pipeline and its limits are set in config.pbtxt."""

from triton_diffusion.models.image_to_image import ImageToImageModel
from triton_diffusion.serving.triton_model import serve

TritonPythonModel = serve(ImageToImageModel)
