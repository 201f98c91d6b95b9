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


# Magic numbers of the accepted formats; anything else is tried as base64 text (HTTP generate's JSON).
_MAGIC = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG", b"RIFF": "WEBP"}


def decode_image(
    data: bytes, field: str, max_bytes: int, max_pixels: int, formats: tuple[str, ...]
) -> Image.Image:
    """Decode an uploaded image safely, or raise INVALID_ARG naming the field and the problem.

    The size is checked from the header before any pixel is decoded (a decompression bomb never
    allocates), the format must be one of ``formats``, and truncated or corrupt data is refused.
    """
    from triton_diffusion.errors import invalid_field

    if not data:
        raise invalid_field(field, "is empty (expected an encoded " + "/".join(formats) + " image)")
    if len(data) > max_bytes:
        raise invalid_field(field, f"is {len(data)} bytes (allowed: at most {max_bytes} bytes)")
    if not any(data.startswith(magic) for magic in _MAGIC):
        try:
            data = base64.b64decode(data, validate=True)
        except ValueError:
            raise invalid_field(field, f"is not an image (allowed formats: {', '.join(formats)})") from None
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:  # Pillow's own guard, for sizes far above any sane limit
        raise invalid_field(field, f"is too large to decode (allowed: at most {max_pixels} pixels)") from None
    except (OSError, ValueError) as exc:
        raise invalid_field(field, f"is not a readable image ({exc})") from None
    if image.format not in formats:
        raise invalid_field(field, f"format {image.format} is not allowed (allowed: {', '.join(formats)})")
    width, height = image.size
    if width * height > max_pixels:
        raise invalid_field(
            field, f"is {width}x{height} = {width * height} pixels (allowed: at most {max_pixels} pixels)"
        )
    try:
        image.load()
    except (OSError, ValueError, SyntaxError) as exc:
        raise invalid_field(field, f"is corrupt or truncated ({exc})") from None
    return image.convert("RGB")
