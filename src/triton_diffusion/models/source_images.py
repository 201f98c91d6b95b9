"""Source images of image-conditioned requests (img2img and inpainting on text_to_image and image_to_image):
which starts a model serves, and each request's source decoded with Pillow, its strength filled in and
checked, and its output size fixed while the request is parsed, so the engine sees one size per job."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from PIL import Image

from triton_diffusion.codecs.image import decode_image
from triton_diffusion.errors import invalid_field
from triton_diffusion.fields import REQUIRED, Field

if TYPE_CHECKING:
    from triton_diffusion.families import PipelineFacts
    from triton_diffusion.models.diffusion_model import DiffusionModel as _Model
else:
    _Model = object  # a mixin: the type checker reads it as the model it is mixed into


class SourceImages(_Model):
    """Mixed into TextToImageModel: what it does with a source image and mask."""

    # Set by TextToImageModel (its class attributes and load()).
    REQUEST_LEVEL_STARTS: tuple[str, ...]
    OPTIONAL_CALL_FIELDS: tuple[str, ...]
    facts: PipelineFacts

    def load_sources(self, config: Any, adapter: Any) -> list[str]:
        """Which image-conditioned starts this model serves (``text``, ``image``: img2img, ``mask``:
        inpainting): the step adapter's, else the request-level engine's; returns the source fields it
        cannot serve (refused by name when sent)."""
        self.buckets: tuple[tuple[int, int], ...] = ()
        self.starts: tuple[str, ...] = ("text",)
        if "image" not in self.FIELDS:
            return []  # a kind without source images (text_to_video)
        self.starts = adapter.starts if adapter is not None else self.REQUEST_LEVEL_STARTS
        # Where no strength is sent or configured, each start takes its diffusers pipeline's default.
        self.default_strengths = {
            start: adapter.default_strength(start) for start in self.starts if adapter and start != "text"
        }
        self.max_pixels = config.max_image_pixels
        self.image_formats = config.image_formats
        self.buckets = config.resize_buckets
        # Starts this model kind's fields can send: text and img2img, inpainting where it has a mask field.
        sendable = {"text", "image"} | ({"mask"} if "mask_image" in self.FIELDS else set())
        if not sendable & set(self.starts) or (adapter is None and self.facts.accepts("mask_image")):
            raise ValueError(
                f"{self.facts.class_name} serves only {'/'.join(self.starts) or 'no'} jobs here, which "
                f"{type(self).__name__} cannot serve: an inpainting checkpoint (mask and masked source as "
                "UNet inputs, or an inpaint pipeline class) is served by text_to_image on the step engine"
            )
        unsupported = []
        if "image" not in self.starts and "mask" not in self.starts:
            unsupported += ["image", "strength"]
        if "mask" not in self.starts and "mask_image" in self.FIELDS:
            unsupported.append("mask_image")
        return [name for name in unsupported if name not in self.OPTIONAL_CALL_FIELDS]

    def check_source_fields(self, raw: dict[str, Any]) -> None:
        """Refuse source fields this model cannot take, before the request is parsed."""
        if self.starts == ("mask",):  # an inpainting checkpoint: nothing else to serve
            for name in ("image", "mask_image"):
                if raw.get(name) is None:
                    raise invalid_field(
                        name,
                        "is required: this model inpaints (its denoiser takes the mask and the masked "
                        "source as inputs: an SD/SDXL inpainting UNet, SD3's 33-channel transformer, "
                        "FLUX.1 Fill), so every request sends image and mask_image",
                    )
        optional = "image" in self.fields and self.fields["image"].default is not REQUIRED
        if optional and raw.get("image") is None:
            for name in ("strength", "mask_image"):
                if raw.get(name) is not None and name in self.fields and self.fields[name].supported:
                    raise invalid_field(name, "applies only to a request with a source image: send image too")

    def resolve_source(self, values: dict[str, Any]) -> dict[str, Any]:
        """Decode the source image (and mask), fill in the strength of its start and check it, and fix
        the output size: both images are resized to it here, so the engine sees one size per job."""
        if values.get("image") is None:
            return values
        image = self.decode_source(values["image"], "image")
        mask = (
            None
            if values.get("mask_image") is None
            else self.decode_source(values["mask_image"], "mask_image")
        )
        values = dict(values)
        if values.get("strength") is None:
            values["strength"] = self.default_strengths.get("image" if mask is None else "mask")
        self.check_strength(values)
        width, height = self.output_size(image, values["width"], values["height"])
        values.update(
            image=image.resize((width, height), Image.Resampling.LANCZOS), width=width, height=height
        )
        if mask is not None:
            values["mask_image"] = mask.resize((width, height), Image.Resampling.LANCZOS)
        return values

    def decode_source(self, data: bytes, field: str) -> Image.Image:
        limit = self.fields[field].max_length or 0
        return decode_image(data, field, limit, self.max_pixels, self.image_formats)

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
        """Requested size (text_to_image: its default size too), else the nearest bucket by aspect
        ratio, else the source size fitted into the limits and rounded down to the size multiple."""
        if width and height:
            return width, height
        source_w, source_h = image.size
        side = width or height
        if side:  # one side given: keep the source's aspect ratio
            scale = side / (source_w if width else source_h)
            return self._fit(source_w * scale, source_h * scale)
        if self.buckets:
            aspect = math.log(source_w / source_h)
            return min(self.buckets, key=lambda b: abs(math.log(b[0] / b[1]) - aspect))
        return self._fit(source_w, source_h)

    def _fit(self, width: float, height: float) -> tuple[int, int]:
        w_field, h_field = self.fields["width"], self.fields["height"]
        (w_min, w_max), (h_min, h_max) = _bounds(w_field), _bounds(h_field)
        scale = min(1.0, w_max / width, h_max / height)
        scale = max(scale, w_min / width, h_min / height)
        sizes = []
        for value, field in ((width * scale, w_field), (height * scale, h_field)):
            minimum, maximum = _bounds(field)
            multiple = field.multiple_of or 1
            size = max(int(minimum), int(value) // multiple * multiple)
            if size > maximum:
                raise invalid_field("image", f"cannot be fitted into the allowed size ({field.allowed()})")
            sizes.append(size)
        return sizes[0], sizes[1]


def _bounds(field: Field) -> tuple[float, float]:
    """A size field's minimum and maximum (the image fields declare both)."""
    assert field.minimum is not None and field.maximum is not None
    return field.minimum, field.maximum
