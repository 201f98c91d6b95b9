"""Source images of image-conditioned requests (img2img and inpainting on text_to_image and image_to_image):
which starts a model serves, and each request's source decoded with Pillow, its strength filled in and
checked, and its output size fixed while the request is parsed, so the engine sees one size per job."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from PIL import Image

from triton_diffusion.codecs.image import decode_image
from triton_diffusion.errors import invalid_field
from triton_diffusion.fields import REQUIRED, Field

if TYPE_CHECKING:
    from triton_diffusion.adapters.starts import JobStarts
    from triton_diffusion.families import PipelineFacts
    from triton_diffusion.fields import FieldSet


@dataclass(frozen=True)
class SourceImages:
    """What a model does with a source image and mask (a collaborator of TextToImageModel, made at load by
    :meth:`at_load`): the starts it serves, each start's default strength, the limits on a source, the
    output-size buckets, and the source fields it cannot serve. Each request's fields are passed in (the
    model's FieldSet, configured at load after this)."""

    starts: tuple[str, ...] = ("text",)
    default_strengths: dict[str, float] = field(default_factory=dict)
    max_pixels: int = 0
    image_formats: tuple[str, ...] = ()
    buckets: tuple[tuple[int, int], ...] = ()
    unsupported: tuple[str, ...] = ()  # the source fields it cannot serve (refused by name when sent)

    @classmethod
    def at_load(
        cls,
        kind: str,
        kind_fields: FieldSet,
        config: Any,
        starter: JobStarts | None,
        facts: PipelineFacts,
        request_level_starts: tuple[str, ...],
        optional_call_fields: tuple[str, ...],
    ) -> SourceImages:
        """Which image-conditioned starts this model serves (``text``, ``image``: img2img, ``mask``:
        inpainting): the step adapter's (its ``starter``), else the request-level engine's
        (``request_level_starts``)."""
        if "image" not in kind_fields:
            return cls()  # a kind without source images (text_to_video)
        starts = starter.starts if starter is not None else request_level_starts
        # Starts this model kind's fields can send: text and img2img, inpainting where it has a mask field.
        sendable = {"text", "image"} | ({"mask"} if "mask_image" in kind_fields else set())
        if not sendable & set(starts) or (starter is None and facts.accepts("mask_image")):
            raise ValueError(
                f"{facts.class_name} serves only {'/'.join(starts) or 'no'} jobs here, which "
                f"{kind} cannot serve: an inpainting checkpoint (mask and masked source as "
                "UNet inputs, or an inpaint pipeline class) is served by text_to_image on the step engine"
            )
        unsupported = []
        if "image" not in starts and "mask" not in starts:
            unsupported += ["image", "strength"]
        if "mask" not in starts and "mask_image" in kind_fields:
            unsupported.append("mask_image")
        return cls(
            starts=starts,
            # Where no strength is sent or configured, each start takes its diffusers pipeline's default.
            default_strengths={
                start: starter.default_strength(start) for start in starts if starter and start != "text"
            },
            max_pixels=config.max_image_pixels,
            image_formats=config.image_formats,
            buckets=config.resize_buckets,
            unsupported=tuple(name for name in unsupported if name not in optional_call_fields),
        )

    def check_fields(self, raw: dict[str, Any], fields: FieldSet) -> None:
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
        optional = "image" in fields and fields["image"].default is not REQUIRED
        if optional and raw.get("image") is None:
            for name in ("strength", "mask_image"):
                if raw.get(name) is not None and name in fields and fields[name].supported:
                    raise invalid_field(name, "applies only to a request with a source image: send image too")

    def resolve(self, values: dict[str, Any], fields: FieldSet) -> dict[str, Any]:
        """Decode the source image (and mask), fill in the strength of its start and check it, and fix
        the output size: both images are resized to it here, so the engine sees one size per job."""
        if values.get("image") is None:
            return values
        image = self.decode(values["image"], "image", fields)
        mask = (
            None
            if values.get("mask_image") is None
            else self.decode(values["mask_image"], "mask_image", fields)
        )
        values = dict(values)
        if values.get("strength") is None:
            values["strength"] = self.default_strengths.get("image" if mask is None else "mask")
        check_strength(values, fields)
        width, height = self.output_size(image, values["width"], values["height"], fields)
        values.update(
            image=image.resize((width, height), Image.Resampling.LANCZOS), width=width, height=height
        )
        if mask is not None:
            values["mask_image"] = mask.resize((width, height), Image.Resampling.LANCZOS)
        return values

    def decode(self, data: bytes, name: str, fields: FieldSet) -> Image.Image:
        limit = fields[name].max_length or 0
        return decode_image(data, name, limit, self.max_pixels, self.image_formats)

    def output_size(
        self, image: Image.Image, width: int | None, height: int | None, fields: FieldSet
    ) -> tuple[int, int]:
        """Requested size (text_to_image: its default size too), else the nearest bucket by aspect
        ratio, else the source size fitted into the limits and rounded down to the size multiple."""
        if width and height:
            return width, height
        source_w, source_h = image.size
        side = width or height
        if side:  # one side given: keep the source's aspect ratio
            scale = side / (source_w if width else source_h)
            return _fit(source_w * scale, source_h * scale, fields)
        if self.buckets:
            aspect = math.log(source_w / source_h)
            return min(self.buckets, key=lambda b: abs(math.log(b[0] / b[1]) - aspect))
        return _fit(source_w, source_h, fields)


def check_strength(values: dict[str, Any], fields: FieldSet) -> None:
    """img2img runs int(num_inference_steps * strength) steps (SD, SDXL; flow-matching pipelines round
    more generously): zero steps would fail inside the pipeline, so refuse it here, naming both."""
    strength, steps = values.get("strength"), values["num_inference_steps"]
    if strength is None or not fields["strength"].supported:
        return
    if int(steps * strength) < 1:
        raise invalid_field(
            "strength",
            f"{strength} with num_inference_steps {steps} runs no denoising step "
            f"(allowed: {1 / steps:.4g}..1 for {steps} steps, i.e. strength x steps >= 1)",
        )


def _fit(width: float, height: float, fields: FieldSet) -> tuple[int, int]:
    w_field, h_field = fields["width"], fields["height"]
    (w_min, w_max), (h_min, h_max) = _bounds(w_field), _bounds(h_field)
    scale = min(1.0, w_max / width, h_max / height)
    scale = max(scale, w_min / width, h_min / height)
    sizes = []
    for value, side in ((width * scale, w_field), (height * scale, h_field)):
        minimum, maximum = _bounds(side)
        multiple = side.multiple_of or 1
        size = max(int(minimum), int(value) // multiple * multiple)
        if size > maximum:
            raise invalid_field("image", f"cannot be fitted into the allowed size ({side.allowed()})")
        sizes.append(size)
    return sizes[0], sizes[1]


def _bounds(side: Field) -> tuple[float, float]:
    """A size field's minimum and maximum (the image fields declare both)."""
    assert side.minimum is not None and side.maximum is not None
    return side.minimum, side.maximum
