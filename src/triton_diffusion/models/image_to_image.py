"""Image-to-image and instruction edits: the text_to_image model with ``image`` required.

Where the family has a step adapter with an img2img start (SD 1.x/2.x, SDXL, FLUX.1, SD3, Qwen-Image) this
is the same code as text_to_image's image-conditioned requests on the step engine (models/text_to_image.py,
adapters/latent_loop.py): the img2img pipeline this model loads is one of the family's pipelines over one
set of modules, and the others are built over the same modules (no second copy of the weights;
text_to_image takes ``image`` too).

Other families run on the request-level engine, one fused call of the loaded img2img pipeline per
compatible group: the resolved size is part of the compatibility key, so requests with different source
sizes are grouped apart instead of failing a fused call (diffusers resizes every image of a call to the
first one's size), and ``resize_buckets`` can snap every source to a fixed set of sizes so more requests
share a key. Works with diffusers pipelines that take a list of images with a list of prompts: Stable
Diffusion img2img with ``engine: request``, InstructPix2Pix (``pipeline_class``), ...
"""

from __future__ import annotations

from typing import Any

from triton_diffusion.models.diffusion_model import RowInput
from triton_diffusion.models.interfaces import IMAGE_TO_IMAGE_FIELDS
from triton_diffusion.models.text_to_image import TextToImageModel


class ImageToImageModel(TextToImageModel):
    KIND = "image_to_image"
    FIELDS = IMAGE_TO_IMAGE_FIELDS
    PIPELINE_LOADER = "AutoPipelineForImage2Image"
    REQUIRED_CALL_ARGS = ("prompt", "image", "generator", "num_inference_steps")
    OPTIONAL_CALL_FIELDS = (*TextToImageModel.OPTIONAL_CALL_FIELDS, "strength", "image_guidance_scale")
    REQUEST_LEVEL_STARTS = ("image",)  # the loaded img2img pipeline, called as it is

    def derived_defaults(self) -> dict[str, str]:
        # The output size comes from each source image (or its bucket), not from a fixed default.
        derived = super().derived_defaults()
        del derived["default_height"], derived["default_width"]
        return derived

    def call_arguments(self, shared: dict[str, Any], rows: list[RowInput]) -> dict[str, Any]:
        kwargs = super().call_arguments(shared, rows)
        kwargs["image"] = [r.values["image"] for r in rows]
        for name in ("height", "width"):  # SD img2img takes the size from the (already resized) images
            if not self.facts.accepts(name):
                kwargs.pop(name, None)
        return kwargs
