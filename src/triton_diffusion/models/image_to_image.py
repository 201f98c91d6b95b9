"""Image-to-image and instruction edits through the same batching core as text-to-image.

The source image is decoded and resized with Pillow while the request is parsed, before planning, and the
resolved size is part of the compatibility key, so requests with different source sizes are grouped apart
instead of failing a fused call (diffusers resizes every image of a call to the first one's size). A
config option can snap every source to a fixed set of sizes (``resize_buckets``) so more requests share
a key. Works with diffusers pipelines that take a list of images with a list of prompts: Stable Diffusion
img2img, Flux img2img, InstructPix2Pix (``pipeline_class``), ...
"""

from __future__ import annotations

import math
from typing import Any

from PIL import Image

from triton_diffusion.codecs.image import decode_image
from triton_diffusion.errors import invalid_field
from triton_diffusion.fields import REQUIRED, Field, FieldSet, Role
from triton_diffusion.models.text_to_image import TEXT_TO_IMAGE_FIELDS, TextToImageModel
from triton_diffusion.serving.triton_model import RowInput
from triton_diffusion.settings import IMAGE, IMAGE_SOURCE, ModelSettings

IMAGE_TO_IMAGE_FIELDS = FieldSet(
    [
        *TEXT_TO_IMAGE_FIELDS,
        Field(
            "image",
            bytes,
            REQUIRED,
            Role.ROW,
            max_length=20_000_000,
            doc="the source image: an encoded PNG, JPEG or WebP (base64 text is accepted too)",
        ),
        Field(
            "strength",
            float,
            None,
            minimum=0.0,
            maximum=1.0,
            doc="how much of the source is re-noised: 0 keeps it, 1 ignores it",
        ),
        Field(
            "image_guidance_scale",
            float,
            None,
            minimum=0.0,
            maximum=30.0,
            doc="instruction-edit pipelines (InstructPix2Pix): pull towards the source image",
        ),
    ]
)


def parse_buckets(text: str | None) -> list[tuple[int, int]]:
    """``resize_buckets``: "WIDTHxHEIGHT,WIDTHxHEIGHT,..." -> [(width, height), ...]."""
    buckets = []
    for item in (text or "").split(","):
        if item.strip():
            width, _, height = item.strip().lower().partition("x")
            buckets.append((int(width), int(height)))
    return buckets


class ImageToImageModel(TextToImageModel):
    FIELDS = IMAGE_TO_IMAGE_FIELDS
    CONFIG_KINDS = (IMAGE, IMAGE_SOURCE)
    PIPELINE_LOADER = "AutoPipelineForImage2Image"
    REQUIRED_CALL_ARGS = ("prompt", "image", "generator", "num_inference_steps")
    OPTIONAL_CALL_FIELDS = (*TextToImageModel.OPTIONAL_CALL_FIELDS, "strength", "image_guidance_scale")

    def load(self, settings: ModelSettings) -> tuple[FieldSet, Any]:
        fields, adapter = super().load(settings)
        config = settings.config
        self.max_pixels = config.max_image_pixels
        self.image_formats = tuple(f.strip().upper() for f in config.image_formats.split(",") if f.strip())
        self.buckets = parse_buckets(config.resize_buckets)
        for width, height in self.buckets:
            fields["width"].validate(width)  # a bucket outside the limits is a config error
            fields["height"].validate(height)
        return fields, adapter

    def derived_defaults(self) -> dict[str, str]:
        # The output size comes from each source image (or its bucket), not from a fixed default.
        derived = super().derived_defaults()
        del derived["default_height"], derived["default_width"]
        return derived

    def resolve(self, values: dict[str, Any]) -> dict[str, Any]:
        image = decode_image(
            values["image"],
            "image",
            self.fields["image"].max_length or 0,
            self.max_pixels,
            self.image_formats,
        )
        self.check_strength(values)
        width, height = self.output_size(image, values["width"], values["height"])
        return {
            **values,
            "image": image.resize((width, height), Image.Resampling.LANCZOS),
            "width": width,
            "height": height,
        }

    def check_strength(self, values: dict[str, Any]) -> None:
        """img2img runs int(num_inference_steps * strength) steps (SD, SDXL; flow-matching pipelines round
        more generously): zero steps would fail inside the pipeline, so refuse it here, naming both."""
        strength, steps = values.get("strength"), values["num_inference_steps"]
        if strength is None or not self.fields["strength"].supported:
            return
        if int(steps * strength) < 1:
            raise invalid_field(
                "strength",
                f"{strength} with num_inference_steps {steps} runs no denoising step "
                f"(allowed: {1 / steps:.4g}..1 for {steps} steps, i.e. strength x steps >= 1)",
            )

    def output_size(self, image: Image.Image, width: int | None, height: int | None) -> tuple[int, int]:
        """Requested size, else the nearest bucket by aspect ratio, else the source size fitted into the
        limits and rounded down to the size multiple."""
        if width and height:
            return width, height
        source_w, source_h = image.size
        if width or height:  # one side given: keep the source's aspect ratio
            scale = (width / source_w) if width else (height / source_h)
            return self._fit(source_w * scale, source_h * scale)
        if self.buckets:
            aspect = math.log(source_w / source_h)
            return min(self.buckets, key=lambda b: abs(math.log(b[0] / b[1]) - aspect))
        return self._fit(source_w, source_h)

    def _fit(self, width: float, height: float) -> tuple[int, int]:
        w_field, h_field = self.fields["width"], self.fields["height"]
        scale = min(1.0, w_field.maximum / width, h_field.maximum / height)
        scale = max(scale, w_field.minimum / width, h_field.minimum / height)
        sizes = []
        for value, field in ((width * scale, w_field), (height * scale, h_field)):
            multiple = field.multiple_of or 1
            size = max(int(field.minimum), int(value) // multiple * multiple)
            if size > field.maximum:
                raise invalid_field("image", f"cannot be fitted into the allowed size ({field.allowed()})")
            sizes.append(size)
        return sizes[0], sizes[1]

    def call_arguments(self, shared: dict[str, Any], rows: list[RowInput]) -> dict[str, Any]:
        kwargs = super().call_arguments(shared, rows)
        kwargs["image"] = [r.values["image"] for r in rows]
        for name in ("height", "width"):  # SD img2img takes the size from the (already resized) images
            if not self.facts.accepts(name):
                kwargs.pop(name, None)
        return kwargs
