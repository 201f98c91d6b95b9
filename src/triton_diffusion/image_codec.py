"""Encoding generated images for the response (applied per request, after the fused call)."""

from __future__ import annotations

import base64
import io

from PIL import Image

IMAGE_FORMATS = ("png", "jpeg", "webp")
OUTPUT_ENCODINGS = ("binary", "base64")  # base64 keeps bytes intact through HTTP generate's JSON


def encode_image(image: Image.Image, image_format: str, encoding: str = "binary") -> bytes:
    buffer = io.BytesIO()
    if image_format == "png":
        image.save(buffer, format="PNG", compress_level=1)  # fast; PNG stays lossless
    elif image_format == "jpeg":
        image.convert("RGB").save(buffer, format="JPEG", quality=90)
    elif image_format == "webp":
        image.save(buffer, format="WEBP", quality=90)
    else:
        raise ValueError(f"unknown image format {image_format!r}")
    data = buffer.getvalue()
    return base64.b64encode(data) if encoding == "base64" else data
